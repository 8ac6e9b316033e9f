"""The race of the first calls (``check.race``, issue #77): where the search left two builds
close, the serving process's calls decide. The callables are small numpy functions; where a
test needs a winner, the clock is fixed (``Race._timed``), the calls still run."""
import itertools
import threading

import numpy as np
import pytest
import tvm

from collage_tvm.check import race as race_module
from collage_tvm.check.race import RACE_ROUNDS, Making, Race
from collage_tvm.dynamic.dispatch import Dispatch, close_labels
from collage_tvm.dynamic.shapes import ShapeRanges


class Fn:
    """x -> x * 2 + offset, on TVM tensors and (``numpy_call``) numpy arrays; counts calls."""

    def __init__(self, offset=0.0, fail=False):
        self.offset, self.fail, self.calls = offset, fail, 0

    def numpy_call(self, x):
        self.calls += 1
        if self.fail:
            raise RuntimeError("no kernel for this shape")
        return [x * 2 + self.offset]

    def __call__(self, x):
        return tvm.runtime.tensor(self.numpy_call(x.numpy())[0])


X = np.arange(6, dtype="float32").reshape(2, 3)


class _Load:
    """``OtherLoad`` with a fixed share of the CPU taken by other processes."""
    share = 0.0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    @property
    def busy(self):
        return self.share > 0.25


def _clock(monkeypatch, ms: dict, others: float = 0.0):
    """Each call of label ``n`` takes ``ms[n]`` ms by the race's clock; other processes
    take ``others`` of the CPU meanwhile (a test run beside others stays quiet)."""
    load = type("Load", (_Load,), {"share": others})
    monkeypatch.setattr(race_module, "OtherLoad", load)
    real = Race._timed
    monkeypatch.setattr(Race, "_timed", lambda self, name, args, numpy: (
        real(self, name, args, numpy)[0], ms[name]))


def _settle(race, n=10_000, numpy=True):
    outs = []
    for _ in range(n):
        if race.settled:
            break
        outs.append(race.numpy_call(X)[0] if numpy else race(tvm.runtime.tensor(X)).numpy())
    return outs


@pytest.mark.parametrize("other_ms, chose", [(0.998, "a"), (0.98, "a"), (0.95, "b"),
                                             (1.2, "a")])
def test_the_faster_serves_once_decided_and_only_past_the_margin(monkeypatch, other_ms, chose):
    a, b = Fn(), Fn()
    _clock(monkeypatch, {"a": 1.0, "b": other_ms})
    race = Race({"a": a, "b": b})
    assert not race.settled and race.chose is None
    outs = _settle(race)
    assert race.settled and race.chose == chose
    assert all(np.array_equal(o, X * 2) for o in outs)  # every raced call is right
    record = race.record
    assert record["shipped"] == "a" and record["chose"] == chose and record["left_out"] == {}
    assert record["ms"]["a"] == 1.0 and record["ms"]["b"] == other_ms
    assert record["rounds"] <= RACE_ROUNDS and record["calls"] == len(outs)
    assert len(record["turns"]["a"]) == record["rounds"] and record["turns"]["a"][0] == 1.0
    if other_ms > 1.1:  # slower in every round: outrun before the last round
        assert record["rounds"] < RACE_ROUNDS and "b" in race.outrun
    # decided: every later call goes to the winner alone
    before = (a.calls, b.calls)
    race.numpy_call(X)
    race(tvm.runtime.tensor(X))
    winner, loser = (a, b) if chose == "a" else (b, a)
    assert (a.calls, b.calls) != before and loser.calls == before[(winner is a)]


def test_a_lead_timed_while_others_took_the_cores_does_not_overturn_the_search(monkeypatch):
    _clock(monkeypatch, {"a": 1.0, "b": 0.8}, others=0.6)
    race = Race({"a": Fn(), "b": Fn()})
    _settle(race)
    assert race.settled and race.chose == "a"
    assert race.record["other_load"] == 0.6 and race.record["ms"]["b"] == 0.8


def test_a_turn_waits_for_the_last_pool_then_times_the_calls_after_the_switch(monkeypatch):
    seen, pauses = [], []
    real = Race._timed

    def timed(self, name, args, numpy):
        out, _ = real(self, name, args, numpy)
        seen.append(name)
        return out, 5.0
    monkeypatch.setattr(Race, "_timed", timed)
    monkeypatch.setattr(race_module, "settle", lambda s: pauses.append(len(seen)) or 0.0)
    race = Race({"a": Fn(), "b": Fn()}, turn_ms=20.0)
    _settle(race)
    # a turn: a pause (the other library's pool goes idle), the switch call, then timed calls
    # until 20 ms: 1 + 4 calls of one contender (b's check beside a is no part of a turn)
    runs = [len(list(g)) for _, g in itertools.groupby(seen)]
    assert set(runs) == {5}, runs
    assert pauses == [5 * k for k in range(len(runs))]


def test_a_lead_the_rounds_do_not_bear_out_races_on_and_the_first_stays(monkeypatch):
    _clock(monkeypatch, {"a": 1.0, "b": 0.9})
    monkeypatch.setattr(Race, "_clear", lambda self, name: False)
    race = Race({"a": Fn(), "b": Fn()})
    _settle(race)
    assert race.chose == "a" and race.record["rounds"] == race_module.MAX_RACE_ROUNDS


def test_a_lead_is_clear_when_the_rounds_agree():
    race = Race({"a": Fn(), "b": Fn()})
    race.samples = {"a": [1.0, 1.1, 0.9, 1.0, 1.05, 1.0, 0.95], "b": [0.9, 1.0, 0.8, 0.9, 0.95,
                                                                      0.9, 0.85]}
    assert race._clear("b")
    race.samples["b"] = [0.6, 1.4, 0.7, 1.3, 0.8, 1.2, 0.9]  # as fast on the whole, and noisy
    assert not race._clear("b")


def test_a_contender_whose_outputs_differ_or_that_fails_is_left_out():
    a, wrong, broken = Fn(), Fn(offset=0.5), Fn(fail=True)
    race = Race({"a": a, "wrong": wrong, "broken": broken})
    outs = _settle(race, numpy=False)
    assert race.chose == "a" and set(race.left_out) == {"wrong", "broken"}
    assert "differ" in race.left_out["wrong"] and "RuntimeError" in race.left_out["broken"]
    assert all(np.array_equal(o, X * 2) for o in outs)


def test_the_first_one_failing_is_the_caller_s_error():
    race = Race({"a": Fn(fail=True), "b": Fn()})
    with pytest.raises(RuntimeError, match="no kernel"):
        race.numpy_call(X)


def test_a_contender_still_being_made_leaves_the_first_serving_alone(monkeypatch):
    _clock(monkeypatch, {"a": 1.0, "b": 0.5})
    gate = threading.Event()
    made = Fn()

    def make():
        gate.wait(5)
        return made

    a = Fn()
    race = Race({"a": a}, making={"b": Making(make)})
    for _ in range(20):  # b is not made yet: a serves, untimed, and nothing is decided
        assert np.array_equal(race.numpy_call(X)[0], X * 2)
    assert not race.settled and race.calls == 0 and a.calls == 20
    gate.set()
    race.making["b"].wait(5)
    _settle(race)
    assert race.chose == "b" and made.calls > 0


def test_a_contender_that_cannot_be_made_is_left_out_and_the_first_serves():
    def make():
        raise OSError("the library is missing")

    making = Making(make)
    making.wait(5)
    race = Race({"a": Fn()}, making={"b": making})
    race.numpy_call(X)
    assert race.settled and race.chose == "a" and "missing" in race.left_out["b"]


RANGES = {"inputs": [{"name": "x", "dtype": "float32", "dims": ["batch", 3]}],
          "axes": {"batch": [1, 1, 4]}, "given": []}


def _dispatch(points: list, fns: dict, **kw) -> Dispatch:
    ranges = ShapeRanges.from_json(RANGES)
    table = {f"batch={p['point']['batch']}": p["chose"] for p in points}
    return Dispatch(ranges, table, fns, close=close_labels(points), **kw)


def test_close_labels_keep_the_libraries_within_the_share():
    points = [{"point": {"batch": 1}, "chose": "a", "ms": {"a": 1.0, "b": 1.2}},
              {"point": {"batch": 4}, "chose": "a", "ms": {"a": 1.0, "b": 2.0}}]
    assert close_labels(points) == {"batch=1": ["a", "b"]}
    assert close_labels(points, share=1.5) == {"batch=1": ["a", "b"], "batch=4": ["a", "b"]}


def test_a_dynamic_build_races_each_close_call_shape_and_no_other(monkeypatch):
    _clock(monkeypatch, {"a": 1.0, "b": 0.5})
    points = [{"point": {"batch": 1}, "chose": "a", "ms": {"a": 1.0, "b": 1.1}},
              {"point": {"batch": 4}, "chose": "a", "ms": {"a": 1.0, "b": 3.0}}]
    a, b = Fn(), Fn()
    dispatch = _dispatch(points, {"a": a, "b": b})
    x1 = np.ones((1, 3), "float32")
    assert dispatch.label_for([(1, 3)]).startswith("racing: a, b")
    race = dispatch.race_at([(1, 3)])
    while not race.settled:
        assert np.array_equal(dispatch.numpy_call(x1)[0], x1 * 2)
    assert dispatch.label_for([(1, 3)]) == "b"
    assert dispatch.race_at([(4, 3)]) is None and dispatch.label_for([(4, 3)]) == "a"
    assert list(dispatch.races) == [((1, 3),)]


def test_race_rounds_are_enough_for_by_round():
    assert RACE_ROUNDS >= race_module.PAIRED_MIN_ROUNDS


def test_a_program_that_ends_at_once_waits_for_a_contender_still_being_made(tmp_path):
    import subprocess
    import sys

    # (a daemon thread still inside OpenVINO's compile at exit aborted the process)
    flag = tmp_path / "made"
    script = ("import time\nfrom collage_tvm.check.race import Making\n"
              f"Making(lambda: (time.sleep(0.5), open({str(flag)!r}, 'w').write('x')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-500:]
    assert flag.read_text() == "x"
