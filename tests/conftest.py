"""Shared test settings."""
import importlib

import pytest

from collage_tvm.measure import timing


@pytest.fixture(autouse=True)
def _short_settle(monkeypatch):
    """Interleaved timings in tests pause 2 ms before each batch instead of 50: the tests
    check what is compared and chosen, not how fairly a loaded CI machine times it (the
    pause itself is tested in test_baselines.py, which passes ``settle_s``). The final
    check's runoff stops at the re-timing's 7 rounds, open close calls too (their own tests
    in test_floor.py set the rounds they check)."""
    monkeypatch.setattr(timing, "SETTLE_S", 0.002)
    never_slower = importlib.import_module("collage_tvm.check.never_slower")
    monkeypatch.setattr(never_slower, "RUNOFF_ROUNDS", 7)
    monkeypatch.setattr(never_slower, "RUNOFF_MAX_ROUNDS", 7)
