"""Shared test settings."""
import pytest

from collage_tvm.measure import timing


@pytest.fixture(autouse=True)
def _short_settle(monkeypatch):
    """Interleaved timings in tests pause 2 ms before each batch instead of 50: the tests
    check what is compared and chosen, not how fairly a loaded CI machine times it (the
    pause itself is tested in test_baselines.py, which passes ``settle_s``)."""
    monkeypatch.setattr(timing, "SETTLE_S", 0.002)
