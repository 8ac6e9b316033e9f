"""collage_tvm.measure.timing.interleaved: the timing every comparison of whole builds goes through."""
import time

from collage_tvm.measure.timing import interleaved


def test_interleaved_does_not_charge_a_function_for_what_the_one_before_left_behind():
    # "spinner" leaves the machine dirty (think: a thread pool still spinning); the next
    # call of anything else pays 10 ms for it. b always follows spinner in a fixed order.
    state = {"dirty": False}

    def spinner():
        time.sleep(0.001)
        state["dirty"] = True

    def victim():
        time.sleep(0.011 if state["dirty"] else 0.001)
        state["dirty"] = False

    calls = []

    def b():
        calls.append("b")
        victim()

    def c():
        calls.append("c")
        victim()

    ms = interleaved({"spinner": spinner, "b": b, "c": c}, rounds=5, min_ms=5.0)
    # Without the untimed lead-in call b's batches would average >= 2.5 ms per call.
    assert abs(ms["b"] - ms["c"]) < 1.0, ms
    assert ms["b"] < 2.0, ms
    assert len(calls) > 10


def test_interleaved_lets_what_the_function_before_left_behind_settle():
    # "spinner" keeps the machine busy for 30 ms after its last call (a thread pool spinning
    # on every core): more than one untimed 1 ms call absorbs. A function timed within that
    # window pays 5 ms a call.
    state = {"until": 0.0}

    def spinner():
        time.sleep(0.001)
        state["until"] = time.perf_counter() + 0.03

    def victim():
        time.sleep(0.006 if time.perf_counter() < state["until"] else 0.001)

    ms = interleaved({"spinner": spinner, "victim": victim}, rounds=3, min_ms=5.0,
                     settle_s=0.04)
    assert ms["victim"] < 3.0, ms
    dirty = interleaved({"spinner": spinner, "victim": victim}, rounds=3, min_ms=5.0,
                        settle_s=0.0)
    assert dirty["victim"] > 3.0, dirty  # the pause is what keeps it fair


def test_interleaved_counts_the_batches_an_earlier_call_kept():
    samples = {"quick": [100.0] * 10}
    ms = interleaved({"quick": lambda: None}, rounds=3, min_ms=1.0, settle_s=0.0,
                     samples=samples)
    assert len(samples["quick"]) == 13
    assert ms["quick"] == 100.0  # the median of all 13: ten of them from before
