"""Shared test settings."""
import pytest

from collage_tvm.measure import timing


@pytest.fixture(autouse=True, scope="session")
def _short_timing():
    """Timings in tests are short: the tests check what is compared and chosen, not how
    fairly a loaded CI machine times it. Session-wide, so that module-scoped fixtures (a
    bench run that serves several tests) time under them too.

    - Interleaved timings pause at most 2 ms before each batch, not 50 (the pause itself is
      tested in test_baselines.py, which passes ``settle_s``).
    - The final check's runoff stops at the re-timing's 7 rounds, open close calls too
      (their own tests in test_floor.py set the rounds they check).
    - The frameworks a row or a bench is judged against: 6 rounds of 20-ms batches, 8 with
      the runoff (the product: 15 of 200 ms, 45), enough for a paired ratio
      (``timing.PAIRED_MIN_ROUNDS``) of figures nobody reads.
    - A timing found noisy (other load, an A/A control astray) is timed again after half a
      second, not ten (the retries themselves are tested with a clock of their own), a
      dynamic model's shape point too."""
    from collage_tvm import options
    from collage_tvm.dynamic import search
    from collage_tvm.tools import bench, suites

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(timing, "SETTLE_S", 0.002)
        # the final check's default settings (``options.FinalCheck``): one object
        mp.setattr(options, "DEFAULT_FINAL_CHECK", options.FinalCheck(
            runoff_rounds=7, runoff_max_rounds=7, busy_retry_s=0.5))
        mp.setattr(bench, "FRAMEWORK_ROUNDS", timing.PAIRED_MIN_ROUNDS + 1)
        mp.setattr(bench, "ROW_RUNOFF_ROUNDS", timing.PAIRED_MIN_ROUNDS + 3)
        mp.setattr(bench, "FRAMEWORK_BATCH_MS", 20.0)
        mp.setattr(suites, "BUSY_PAUSE_S", 0.5)
        mp.setattr(search, "BUSY_WAIT_S", 0.5)
        yield
