"""collage_tvm.measure.timing.interleaved: the timing every comparison of whole builds goes through."""
import threading
import time

import numpy as np

from collage_tvm.measure.timing import interleaved, settle


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


def _spin_until(state: dict) -> None:
    """A thread of this process that keeps a core busy until ``state["until"]`` (a pool
    spinning). Its work is numpy's, which lets go of the GIL: the main thread's timing is
    not held up by it, only by what the test says the spin costs."""
    buf = np.ones(1 << 18)

    def spin():
        while time.perf_counter() < state["until"]:
            np.add(buf, 1.0, out=buf)

    threading.Thread(target=spin, daemon=True).start()


def test_interleaved_lets_what_the_function_before_left_behind_settle():
    # "spinner" keeps a thread spinning for 30 ms after its last call (a thread pool spinning
    # on every core): more than one untimed 1 ms call absorbs. A function timed within that
    # window pays 5 ms a call.
    state = {"until": 0.0}

    def spinner():
        time.sleep(0.001)
        state["until"] = time.perf_counter() + 0.03
        _spin_until(state)

    def victim():
        time.sleep(0.006 if time.perf_counter() < state["until"] else 0.001)

    ms = interleaved({"spinner": spinner, "victim": victim}, rounds=3, min_ms=5.0,
                     settle_s=0.04)
    assert ms["victim"] < 3.0, ms
    dirty: dict = {}
    interleaved({"spinner": spinner, "victim": victim}, rounds=3, min_ms=5.0, settle_s=0.0,
                samples=dirty)
    # the pause is what keeps it fair: a batch right after the spinner's pays without it
    assert max(dirty["victim"]) > 3.0, dirty


def test_the_pause_before_a_batch_lasts_while_a_thread_spins_and_no_longer():
    # A tiny model's call wakes no pool: its batches need not wait the whole pause.
    assert settle(0.3) < 0.1
    _spin_until({"until": time.perf_counter() + 0.08})
    waited = settle(0.5)
    assert 0.07 < waited < 0.3, waited
    assert settle(0.0) == 0.0


def test_interleaved_counts_the_batches_an_earlier_call_kept():
    samples = {"quick": [100.0] * 10}
    ms = interleaved({"quick": lambda: None}, rounds=3, min_ms=1.0, settle_s=0.0,
                     samples=samples)
    assert len(samples["quick"]) == 13
    assert ms["quick"] == 100.0  # the median of all 13: ten of them from before


def test_interleaved_gives_no_function_the_same_predecessor_every_round(monkeypatch):
    # What a function leaves behind beyond the pause (a pool still spinning, its weights in
    # the cache) lands on whichever batch comes next: with rounds that only rotate, that is
    # the same function every round. Each round's order is shuffled: every function follows
    # more than one other, and several start a round.
    log = []
    monkeypatch.setattr(time, "sleep", lambda s: log.append("|"))  # the pause before a batch
    names = ["a", "b", "c", "d"]
    rounds = 24
    interleaved({n: (lambda n=n: log.append(n)) for n in names}, rounds=rounds, min_ms=0.5)
    timed = [b for b in "".join(log).split("|")[1:]]  # one string of calls per batch
    order = [b[0] for b in timed]
    assert len(order) == rounds * len(names) and all(set(b) == {b[0]} for b in timed)
    for n in names:  # no function follows one other in most of its batches
        before = [order[i - 1] for i in range(1, len(order)) if order[i] == n]
        assert max(before.count(m) for m in set(before)) < 0.6 * len(before), (n, before)
    assert len({order[k * len(names)] for k in range(rounds)}) >= 3, order


def _clocked(monkeypatch, costs: dict):
    """Functions that each advance a fake clock by their cost (ms) per call, and no pauses:
    ``interleaved`` without a real clock."""
    from collage_tvm.measure import timing

    clock = [0.0]
    monkeypatch.setattr(timing, "_done", lambda sync: clock[0])
    monkeypatch.setattr(time, "sleep", lambda s: None)

    def fn(ms):
        def call():
            clock[0] += ms / 1e3
        return call
    return {n: fn(ms) for n, ms in costs.items()}


def test_interleaved_drops_a_function_that_lost_even_at_its_best(monkeypatch):
    fns = _clocked(monkeypatch, {"fast": 1.0, "close": 1.02, "slow": 1.3})
    samples: dict = {}
    dropped: set = set()
    ms = interleaved(fns, rounds=10, min_ms=10.0, samples=samples, drop=0.05, dropped=dropped)
    from collage_tvm.measure.timing import DROP_AFTER
    assert dropped == {"slow"}
    assert len(samples["slow"]) == DROP_AFTER  # timed no further once it lost at its best
    assert len(samples["fast"]) == len(samples["close"]) == 10  # within the margin: all rounds
    assert abs(ms["slow"] - 1.3) < 1e-6 and abs(ms["fast"] - 1.0) < 1e-6
    # Without ``drop`` every function gets every round.
    samples = {}
    interleaved(fns, rounds=10, min_ms=10.0, samples=samples)
    assert {len(s) for s in samples.values()} == {10}


def test_interleaved_stops_when_one_function_is_left_and_only_leaders_set_the_bar(monkeypatch):
    fns = _clocked(monkeypatch, {"a": 1.0, "b": 2.0, "advice": 0.5})
    samples: dict = {}
    dropped: set = set()
    interleaved(fns, rounds=10, min_ms=10.0, samples=samples, drop=0.05, dropped=dropped,
                lead={"a", "b"})
    # "advice" (faster, but not a contender) does not set the bar: "a" stays, "b" goes;
    # "advice" is not dropped either, being the fastest. Two functions left: all rounds.
    assert dropped == {"b"} and len(samples["a"]) == len(samples["advice"]) == 10
    samples, dropped = {}, set()
    interleaved({n: fns[n] for n in ("a", "b")}, rounds=10, min_ms=10.0, samples=samples,
                drop=0.05, dropped=dropped)
    from collage_tvm.measure.timing import DROP_AFTER
    assert dropped == {"b"} and len(samples["a"]) == DROP_AFTER  # alone: nothing to compare


def test_interleaved_keeps_a_function_that_beat_the_leader_in_a_round(monkeypatch):
    """A function whose fastest batch is past the drop margin is still timed on when it was
    faster than the leader in one round (the leader hit a slow stretch there): the rounds
    are paired, and one noisy stretch must not drop the build that may be the faster."""
    from collage_tvm.measure import timing

    clock = [0.0]
    monkeypatch.setattr(timing, "_done", lambda sync: clock[0])
    monkeypatch.setattr(time, "sleep", lambda s: None)
    # the leader's calls: 1.0 ms, but its whole third batch (3 timed calls after 1 lead-in
    # and the warm-up's 3) at 2.0 ms; the other's always 1.1 ms (past 1.05x the median)
    leader_calls = iter([1.0] * 3 + [1.0] * 2 * 4 + [2.0] * 4 + [1.0] * 1000)

    def leader():
        clock[0] += next(leader_calls) / 1e3

    def other():
        clock[0] += 1.1 / 1e3

    samples: dict = {}
    dropped: set = set()
    interleaved({"leader": leader, "other": other}, rounds=8, min_ms=3.0, samples=samples,
                drop=0.05, dropped=dropped)
    assert max(samples["leader"]) > min(samples["other"]) > 1.05 * 1.0  # one round won
    assert dropped == set() and len(samples["other"]) == 8
    # the same without the leader's slow round: dropped after DROP_AFTER rounds
    samples, dropped = {}, set()
    leader_calls = iter([1.0] * 1000)
    interleaved({"leader": leader, "other": other}, rounds=8, min_ms=3.0, samples=samples,
                drop=0.05, dropped=dropped)
    assert dropped == {"other"} and len(samples["other"]) == timing.DROP_AFTER
