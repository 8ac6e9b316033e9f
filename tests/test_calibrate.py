"""In-context calibration (placer.calibrate) and the per-call timing hook it rests on."""
import math
import time

import numpy as np
import pytest
import tvm
from tvm import relax

from collage_tvm.placement import Candidate
from collage_tvm.graph import DataflowGraph
from collage_tvm.byoc import placement_runner
from collage_tvm.placer.calibrate import calibrate
from collage_tvm.placer.op_level import place
from collage_tvm.registry import Backend, get_backend
from collage_tvm.target import make_target

SLEEP_S = 0.004


class SlowInContextLowering:
    """A real (numpy) ReLU whose every call sleeps 4 ms: what an isolated cost table that
    says 0.01 ms misses. Stands in for a library whose calls cost more in a whole run."""

    def available(self):
        return True, ""

    def version(self):
        return "slow-1"

    def lower(self, func):
        from collage_tvm.backends._graphlib import as_numpy, new_output

        def call(x):
            time.sleep(SLEEP_S)
            out, view = new_output(tuple(x.shape), "float32")
            np.maximum(as_numpy(x), 0.0, out=view)
            return out

        return call


def _chain(n=6):
    """relu -> add -> relu -> add ... on a 1x64x32x32 tensor."""
    x = relax.Var("x", relax.TensorType((1, 64, 32, 32), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            for i in range(n):
                y = bb.emit(relax.op.nn.relu(y) if i % 2 == 0 else relax.op.add(y, y))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return DataflowGraph(bb.get()["main"])


@pytest.fixture
def setup():
    graph = _chain()
    slow = Backend(name="slowlib", kind="op", lowering=SlowInContextLowering())
    backends = {"tvm": get_backend("tvm"), "slowlib": slow}
    cands = [Candidate("tvm", frozenset([i]), "tvm.op") for i in range(len(graph))]
    cands += [Candidate("slowlib", frozenset([i]), "slowlib.relu")
              for i, n in enumerate(graph.nodes) if n.op_name == "relax.nn.relu"]
    # The isolated cost table: slowlib looks 10x cheaper than TVM for every ReLU.
    costs = {c: (0.01 if c.backend == "slowlib" else 0.1) for c in cands}
    return graph, backends, cands, costs


def test_external_calls_are_timed_in_place(setup):
    from collage_tvm.byoc import lower_placement

    graph, backends, cands, costs = setup
    groups = place(graph.producers, cands, costs, {}).groups
    slow_at = [k for k, g in enumerate(groups) if g.backend == "slowlib"]
    assert slow_at  # the cost table sends every ReLU to slowlib
    timings: dict = {}
    ex = tvm.compile(lower_placement(graph, groups, backends, timings), make_target("llvm"))
    vm = relax.VirtualMachine(ex, tvm.cpu())
    x = tvm.runtime.tensor(np.random.default_rng(0).standard_normal((1, 64, 32, 32))
                           .astype("float32"))
    vm["main"](x)
    vm["main"](x)
    assert sorted(timings) == slow_at
    assert all(len(v) == 2 and min(v) >= SLEEP_S for v in timings.values())


def test_calibration_learns_the_in_context_cost_and_moves_groups_back(setup):
    graph, backends, cands, costs = setup
    eps = {"tvm": 0.0, "slowlib": 0.0}
    first = place(graph.producers, cands, costs, eps)
    assert any(g.backend == "slowlib" for g in first.groups)
    seen = []
    cal = calibrate(graph, cands, costs, eps, {}, first,
                    placement_runner(graph, backends, make_target("llvm")), rounds=3, min_ms=50.0, on_round=seen.append)
    # Round 0 timed slowlib's calls at >= 4 ms each: that became its in-context epsilon ...
    assert seen[0]["extra_epsilon"]["slowlib"] >= SLEEP_S * 1e3 * 0.9
    assert seen[0]["measured_ms"] >= 3 * SLEEP_S * 1e3
    # ... the DP then put every ReLU back on TVM, which round 1 measured far faster ...
    assert len(seen) >= 2 and all(g.backend == "tvm" for g in cal.placement.groups)
    assert seen[1]["measured_ms"] < seen[0]["measured_ms"] / 2
    # ... and the placement kept is the faster one, re-timed side by side.
    assert seen[1]["retimed_ms"] < seen[0]["retimed_ms"]
    assert math.isclose(cal.extra_epsilon["slowlib"], seen[-1]["extra_epsilon"]["slowlib"],
                        abs_tol=1e-3)


def test_a_placement_of_one_library_group_is_not_calibrated(setup, monkeypatch):
    # The whole model on one library runs in place as it was measured alone: a round would
    # read the machine's noise into its epsilon (ResNet-50: +5.9 ms on OpenVINO, then the
    # DP moved the model onto ONNX Runtime for that). Two groups: calibrated.
    import importlib

    from collage_tvm.options import SearchOptions
    from collage_tvm.placement import Placement
    from collage_tvm.placer.op_stage import OpLevel
    from collage_tvm.placing import Placing
    from collage_tvm.report import BuildReport

    build = importlib.import_module("collage_tvm.placing")
    graph, backends, cands, costs = setup
    called = []
    monkeypatch.setattr(importlib.import_module("collage_tvm.placer.op_stage"), "calibrate",
                        lambda *a, **kw: called.append(1) or
                        type("C", (), {"history": [], "placement": a[5]})())
    p = Placing(graph, backends, make_target("llvm"), None,
                SearchOptions(calibrate_rounds=4), BuildReport(backends=[]))
    whole = Placement([Candidate("slowlib", frozenset(range(len(graph))), "slowlib.region")], 1.0)
    work = OpLevel(whole, cands, costs, {"tvm": 0.0, "slowlib": 0.0}, {})
    assert build._calibrated(p, work) is whole and not called
    work.placement = place(graph.producers, cands, costs, work.eps)
    assert len(work.placement.groups) > 1
    build._calibrated(p, work)
    assert called
