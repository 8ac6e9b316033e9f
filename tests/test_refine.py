"""Alternative covers of the op-level DP (placer.alternatives) and their side-by-side re-timing
(placer.alternatives.refine, Measurer.retime_side_by_side)."""
import math

import numpy as np
import pytest
import tvm
from tvm import relax

from collage_tvm.placement import Candidate, Placement
from collage_tvm.graph import DataflowGraph
from collage_tvm.graph.subgraph import function_key
from collage_tvm.measure.db import CostDB
from collage_tvm.measure.keys import SIDE_KEY
from collage_tvm.measure.measurer import Measurer
from collage_tvm.measure.timing import time_side_by_side
from collage_tvm.candidates import generate_candidates
from collage_tvm.byoc import candidate_vm
from collage_tvm.placer.alternatives import alternative_covers, functions_of, refine
from collage_tvm.placer.op_level import place
from collage_tvm.registry import get_backend
from collage_tvm.target import make_target


def _c(backend, *nodes):
    return Candidate(backend, frozenset(nodes), f"{backend}{list(nodes)}")


def test_merge_and_split_alternatives_within_the_threshold():
    # Chain 0 -> 1 -> 2: conv, bias, relu. The placement splits conv (dnnl) from bias+relu
    # (tvm); dnnl's fused conv+bias+relu is 10% dearer as measured: an alternative
    # cover within the threshold.
    conv, fused, tail = _c("dnnl", 0), _c("dnnl", 0, 1, 2), _c("tvm", 1, 2)
    singles = [_c("tvm", 1), _c("tvm", 2)]
    far = _c("tvm", 0, 1, 2)  # 3x dearer: not close
    costs = {conv: 1.0, tail: 0.1, fused: 1.2, singles[0]: 0.06, singles[1]: 0.06, far: 3.3}
    eps = {"dnnl": 0.0, "tvm": 0.0}
    p = Placement(groups=[conv, tail], cost=1.1)
    found = alternative_covers(p, list(costs), costs, eps, threshold=0.25)
    pairs = {(tuple(sorted(x.label for x in a)), tuple(sorted(x.label for x in b)))
             for a, b in found}
    assert (("dnnl[0]", "tvm[1, 2]"), ("dnnl[0, 1, 2]",)) in pairs          # merge
    assert (("tvm[1, 2]",), ("tvm[1]", "tvm[2]")) in pairs                 # split
    assert not any("tvm[0, 1, 2]" in b for _, b in pairs)                  # 3x: not close
    # A tighter threshold drops the 20% merge; epsilon counts per kernel.
    tight = alternative_covers(p, list(costs), costs, eps, threshold=0.05)
    assert not any(b == [fused] for _, b in tight)
    with_eps = alternative_covers(p, list(costs), costs, {"dnnl": 0.0, "tvm": 0.1}, threshold=0.05)
    assert any(b == [fused] for _, b in with_eps)  # 1.2 vs 1.0 + 0.1 + 0.1 + epsilon
    members = functions_of([(p.groups, [fused])])[0]
    assert {m.label for m in members} == {"dnnl[0]", "tvm[1, 2]", "dnnl[0, 1, 2]"}


def test_only_exact_covers_count_and_infinite_costs_are_ignored():
    a, b = _c("tvm", 0), _c("tvm", 1)
    partial = _c("dnnl", 0, 1, 2)  # covers a node the chosen groups do not: not a merge
    dead = _c("dnnl", 0, 1)        # failed to build: inf
    costs = {a: 1.0, b: 1.0, partial: 2.0, dead: math.inf, _c("tvm", 2): 1.0}
    p = Placement(groups=[a, b, _c("tvm", 2)], cost=3.0)
    found = alternative_covers(p, list(costs), costs, {}, threshold=0.5)
    assert all(len(alt) == 1 and alt[0].nodes == frozenset({0, 1, 2}) for _, alt in found)
    assert all(dead not in alt for _, alt in found)


def test_time_side_by_side_orders_costs():
    import time

    def slow():
        time.sleep(0.002)

    def fast():
        pass

    a, b = time_side_by_side([(slow, []), (fast, [])], rounds=3, target_ms=5)
    assert a >= 1.5 and b < 0.5


def _conv_relu_graph():
    x = relax.Var("x", relax.TensorType((1, 16, 16, 16), "float32"))
    w = relax.const(tvm.runtime.tensor(__import__("numpy").random.default_rng(0)
                                       .standard_normal((16, 16, 3, 3)).astype("float32")))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
            y = bb.emit(relax.op.nn.relu(y))
            out = bb.emit_output(relax.op.add(y, y))
        bb.emit_func_output(out)
    return DataflowGraph(bb.get()["main"])


def _refine(measurer, *args, **kwargs) -> tuple:
    """``refine`` as (costs, number of alternative covers)."""
    result = refine(measurer, *args, **kwargs)
    return result.raw, result.alternative_covers


@pytest.mark.parametrize("isolate", [False, True])
def test_refine_retimes_alternative_covers_once_and_the_db_keeps_them(tmp_path, isolate):
    graph = _conv_relu_graph()
    tvm_b = get_backend("tvm")
    backends = {"tvm": tvm_b}
    cands = generate_candidates(graph, [tvm_b])
    target = make_target("llvm")
    db = CostDB(str(tmp_path / "c.db"))
    m = Measurer(target, db, candidate_vm, isolate=isolate, progress=False)
    try:
        raw = m.costs(graph, cands, backends)
        # A cost table where the fused kernel looks a little dearer than the split: every
        # alternative cover is within the threshold (75%).
        fake = {c: 0.1 * len(c.nodes) * (1.1 if len(c.nodes) == len(graph) else 1.0)
                for c in cands}
        p = place(graph.producers, cands, fake, {})
        refined, close = _refine(m, p, cands, fake, {}, backends)
    finally:
        m.close()
    assert close > 0 and m.side_by_side > 0
    changed = [c for c in cands if refined[c] != fake[c]]
    assert changed and all(math.isfinite(refined[c]) and refined[c] > 0 for c in changed)
    # Same magnitude as the isolated measurement (the fake table is far from either).
    assert all(0.2 < refined[c] / raw[c] < 5 for c in changed)
    assert any(r["key"].startswith(SIDE_KEY) for r in db.rows())
    # Next build: every side-by-side time comes from the DB, none is re-timed.
    m2 = Measurer(target, db, candidate_vm, isolate=isolate, progress=False)
    try:
        m2.costs(graph, cands, backends)
        again, _ = _refine(m2, p, cands, fake, {}, backends)
    finally:
        m2.close()
    assert m2.side_by_side == 0 and m2.measured == 0
    assert again == refined


def test_fit_side_by_side_removes_each_sets_drift():
    from collage_tvm.measure.side_by_side import fit_side_by_side

    # True times: a 1.0, b 1.05, c 0.1. Set 1 ran 30% slow, set 2 10% fast: taken as
    # measured, a (1.3) looks dearer than b (0.945); c, timed in both, gives the drift away.
    fit = fit_side_by_side([{"a": 1.3, "c": 0.13}, {"b": 1.05 * 0.9, "c": 0.09}])
    assert fit["b"] / fit["a"] == pytest.approx(1.05, rel=1e-6)
    # Contradicting sets: least squares in between. A set alone keeps its own times.
    fit = fit_side_by_side([{"a": 1.0, "b": 2.0}, {"a": 1.0, "b": 3.0}, {"z": 4.0}])
    assert 2.0 < fit["b"] / fit["a"] < 3.0 and fit["z"] == pytest.approx(4.0)
    assert fit_side_by_side([]) == {}


def test_library_candidates_are_timed_in_graph_order_and_twice(tmp_path):
    # dnnl candidates of conv -> relu -> add: each is measured once in graph order (the
    # alternatives for the conv side by side in time), then again in reverse order; the
    # lower time is kept, in the returned costs and in the DB. TVM candidates: once.
    graph = _conv_relu_graph()
    backends = {"tvm": get_backend("tvm"), "dnnl": get_backend("dnnl")}
    cands = generate_candidates(graph, list(backends.values()))
    db = CostDB(str(tmp_path / "c.db"))
    m = Measurer(make_target("llvm"), db, candidate_vm, isolate=False, progress=False)
    seen: list = []
    first_of: dict = {}

    def scripted(backend, func, cutoff_ms, key=None):
        key = function_key(func)
        n = sum(1 for b, k in seen if (b, k) == (backend.name, key))
        seen.append((backend.name, key))
        first_of.setdefault((backend.name, key), len(seen))
        if backend.name == "tvm":
            return 5.0, None, {}
        # dnnl: the first pass is slow for the first function it times, fast for the rest;
        # the second pass the other way round.
        slow = (first_of[(backend.name, key)] == 1) == (n == 0)
        return (2.0 if slow else 1.0), None, {}

    m._measure = scripted
    costs = m.costs(graph, cands, backends)
    dnnl = [c for c in cands if c.backend == "dnnl"]
    assert len({c.nodes for c in dnnl}) >= 2
    calls = [b for b, _ in seen]
    n_dnnl = len({k for b, k in seen if b == "dnnl"})
    # dnnl first (one pass), then TVM, then dnnl again (second pass)
    assert calls[:n_dnnl] == ["dnnl"] * n_dnnl and calls[-n_dnnl:] == ["dnnl"] * n_dnnl
    assert calls.count("tvm") == len({k for b, k in seen if b == "tvm"})
    assert all(costs[c] == 1.0 for c in dnnl)  # every one kept its faster pass
    rows = [r for r in db.rows() if r["backend"] == "dnnl" and not r["key"].startswith("__")]
    assert rows and all(r["cost_ms"] == 1.0 for r in rows)
    assert any(r["extra"].get("passes") == [2.0, 1.0] for r in rows)
    # graph order: the first dnnl function timed covers node 0 (the conv)
    first = next(c for c in dnnl if function_key(m._func_of[c][1]) == seen[0][1])
    assert 0 in first.nodes
    # a warm DB: nothing is timed again
    seen.clear()
    m2 = Measurer(make_target("llvm"), db, candidate_vm, isolate=False, progress=False)
    m2._measure = scripted
    assert m2.costs(graph, cands, backends) == costs and not seen


def test_past_its_deadline_a_measurer_answers_from_the_db_and_measures_nothing(tmp_path):
    import time

    from collage_tvm.measure.measurer import DeadlinePassed

    graph = _conv_relu_graph()
    backends = {"tvm": get_backend("tvm")}
    cands = generate_candidates(graph, list(backends.values()))
    db = CostDB(str(tmp_path / "c.db"))
    m = Measurer(make_target("llvm"), db, candidate_vm, isolate=False, progress=False)
    m._measure = lambda backend, func, cutoff_ms, key=None: (5.0, None, {})
    m.deadline = time.perf_counter() - 1.0
    with pytest.raises(DeadlinePassed, match="not measured, the deadline has passed"):
        m.costs(graph, cands, backends)
    assert m.measured == 0
    m.deadline = None
    costs = m.costs(graph, cands, backends)
    m.deadline = time.perf_counter() - 1.0  # everything is in the DB now: no measuring
    assert m.costs(graph, cands, backends) == costs


def test_refine_takes_the_largest_stakes_first_and_keeps_to_its_budget(tmp_path):
    graph = _conv_relu_graph()
    tvm_b = get_backend("tvm")
    backends = {"tvm": tvm_b}
    cands = generate_candidates(graph, [tvm_b])
    db = CostDB(str(tmp_path / "c.db"))
    m = Measurer(make_target("llvm"), db, candidate_vm, isolate=False, progress=False)
    conv = next(i for i, n in enumerate(graph.nodes) if n.op_name == "relax.nn.conv2d")
    try:
        m.costs(graph, cands, backends)
        # The conv costs 100x the elementwise ops: decisions that hold it are the stakes.
        fake = {c: sum(10.0 if v == conv else 0.1 for v in c.nodes)
                * (1.1 if len(c.nodes) > 1 else 1.0) for c in cands}
        p = place(graph.producers, cands, fake, {})
        seen = []
        real = m._measure_side_by_side

        def record(funcs):
            seen.append(len(funcs))
            return real(funcs)

        m._measure_side_by_side = record
        none, close = _refine(m, p, cands, fake, {}, backends, budget_s=0.0)
        assert close > 0 and seen == [] and none == fake  # no time: first times kept
        m.side_by_side = 0
        result = refine(m, p, cands, fake, {}, backends)
        refined = result.raw
        assert m.side_by_side == len(seen) > 0
        stakes = result.stakes
        assert stakes == sorted(stakes, reverse=True)
        assert stakes[0] > 5.0 > stakes[-1]  # the conv decisions first, the ReLU+add ones last
        # What was timed once is used whatever the budget.
        again, _ = _refine(m, p, cands, fake, {}, backends, budget_s=0.0)
        assert again == refined
    finally:
        m.close()


def test_a_measuring_child_over_its_memory_limit_is_replaced_and_measuring_goes_on(
        tmp_path, monkeypatch):
    graph = _conv_relu_graph()
    tvm_b = get_backend("tvm")
    cands = generate_candidates(graph, [tvm_b])[:4]  # a child started for each: seconds
    m = Measurer(make_target("llvm"), CostDB(str(tmp_path / "c.db")), candidate_vm,
                 isolate=True, progress=False)
    # The process's shared child: every child is over the limit after its first answer.
    monkeypatch.setattr(m._worker, "rss_limit", 1)
    restarts = m._worker.restarts
    try:
        costs = m.costs(graph, cands, {"tvm": tvm_b})
    finally:
        m.close()
    assert len(costs) == len(cands) and all(math.isfinite(v) and v > 0 for v in costs.values())
    assert m._worker.restarts - restarts >= 2 and m.failures == []


def test_a_child_that_drops_its_pipe_but_lingers_is_a_failed_measurement_not_a_crash():
    """Seen on densenet169: the child's pipe closed while the process took over 5 s to go
    (a large heap being freed); waiting for it raised out of the search. Now it is killed
    and the measurement is an infinite cost with the reason."""
    import subprocess
    import sys

    from collage_tvm.measure.worker import Worker

    class Lingering(Worker):
        def _start(self):
            self._proc = subprocess.Popen(
                [sys.executable, "-c", "import os, time; os.close(1); time.sleep(60)"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    w = Lingering()
    try:
        cost, reason, _ = w._ask(("measure_function", [], "{}", None, ()))
    finally:
        w.close()
    assert math.isinf(cost) and "measurement process died" in reason


def _slow_first_vm(first_s: float, then_s: float, out=None):
    """A VM whose main sleeps ``first_s`` on its first call, ``then_s`` after (its
    ``time_evaluator`` calls main), and returns ``out``."""
    import time

    calls = [0]

    def main(*args):
        calls[0] += 1
        s = first_s if calls[0] == 1 else then_s
        if s:
            time.sleep(s)
        return out

    class FakeVM:
        def __getitem__(self, name):
            return main

        def time_evaluator(self, name, dev, number, repeat):
            def run(*args):
                out = []
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    for _ in range(number):
                        main()
                    out.append((time.perf_counter() - t0) / number)
                return type("R", (), {"results": out})()
            return run

    return FakeVM(), calls


def test_time_main_sizes_its_samples_on_a_warm_call():
    # A fresh build's first call can be far slower than the rest (lazy initialisation):
    # the samples are sized on a warm call, so a fast kernel is called many times per
    # sample, not once.
    from collage_tvm.measure.timing import time_main

    vm, _ = _slow_first_vm(0.05, 0.0)
    ms, why, extra = time_main(vm, [], None, target_ms=1.0)
    assert why is None and ms < 1.0
    assert extra["repeats"] >= 100  # 1 ms of a call well under 10 us, ten samples at least


def test_a_slow_first_run_near_the_cutoff_gets_a_second_look():
    # A kernel of microseconds whose first call took 20 ms (a lazy start) against a cutoff of
    # 10 ms: its warm second run is under the cutoff, so it is timed, not cut short at 20 ms.
    from collage_tvm.measure.timing import SECOND_LOOK_MS, time_main

    assert SECOND_LOOK_MS > 10
    vm, calls = _slow_first_vm(0.020, 0.0)
    ms, why, extra = time_main(vm, [], None, cutoff_ms=10.0)
    assert why is None and ms < 1.0 and extra["repeats"] > 2, (ms, why, extra)
    # slow on the second run too: cut short after two runs, at the warm one's time
    vm, calls = _slow_first_vm(0.020, 0.015)
    ms, why, extra = time_main(vm, [], None, cutoff_ms=10.0)
    assert why and "cut short" in why and calls[0] == 2 and 14 < ms < 40, (ms, why)
    # far past the cutoff (a hopeless kernel of a big model): one run is enough
    vm, calls = _slow_first_vm((10.0 + SECOND_LOOK_MS + 20) / 1e3, 0.0)
    ms, why, extra = time_main(vm, [], None, cutoff_ms=10.0)
    assert why and "cut short" in why and calls[0] == 1 and extra["repeats"] == 1


def test_a_build_whose_first_run_counts_gets_the_second_look_too(monkeypatch):
    # The final check's all-TVM builds are cut on the run that gives their outputs: a build
    # whose first call is slow only by a lazy start is timed warm, not recorded at that call.
    import importlib
    import types

    from collage_tvm.measure.timing import SECOND_LOOK_MS

    # (``collage_tvm.check.evaluate`` is the function the package re-exports: the module so)
    ev = importlib.import_module("collage_tvm.check.evaluate")

    graph = _conv_relu_graph()
    out = tvm.runtime.tensor(np.zeros((1, 16, 16, 16), "float32"))

    def check(first_s):
        vm, calls = _slow_first_vm(first_s, 0.0, out)
        monkeypatch.setattr(ev, "relax", types.SimpleNamespace(VirtualMachine=lambda e, d: vm))
        return ev.evaluate(None, graph, make_target("llvm"), cutoff_ms=10.0,
                           first_run_counts=True), calls

    r, calls = check(0.020)
    assert not r["timed_once"] and r["ms"] < 1.0 and calls[0] > 2, r
    r, calls = check((10.0 + SECOND_LOOK_MS + 20) / 1e3)  # far past it: the one run counts
    assert r["timed_once"] and r["ms"] > 10.0 + SECOND_LOOK_MS and calls[0] == 1, r


def test_a_second_measurement_of_the_same_candidate_reuses_its_build(tmp_path):
    # The second pass and side-by-side re-timing time a candidate again: the process that
    # measures keeps the build under the candidate's key; a measurer's end forgets it.
    from collage_tvm.measure import runner

    from collage_tvm.graph.subgraph import extract_function

    graph = _conv_relu_graph()
    f = extract_function(graph, frozenset(range(len(graph))))[0]
    backend = get_backend("tvm")
    builds = []

    def counting_vm(f, b, t):
        builds.append(f)
        return candidate_vm(f, b, t)

    target = make_target("llvm")
    runner.clear_cache()
    try:
        a = runner.measure_function([(f, backend, "k1")], target, counting_vm)
        b = runner.measure_function([(f, backend, "k1")], target, counting_vm)
        times = runner.measure_side_by_side([(f, backend, "k1")], target, counting_vm)
        assert len(builds) == 1 and math.isfinite(a[0]) and math.isfinite(b[0]) and times[0]
        runner.measure_function([(f, backend, None)], target, counting_vm)  # no key: no cache
        assert len(builds) == 2
        runner.clear_cache()
        runner.measure_function([(f, backend, "k1")], target, counting_vm)
        assert len(builds) == 3
    finally:
        runner.clear_cache()
