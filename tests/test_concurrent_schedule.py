"""Issue #80, parts 1 and 3: a placement's independent groups built to run at the same time
(``schedule.concurrent``), on workers limited to their share of the cores
(``schedule.workers``), and the measured schedule (``schedule.plan``)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import tvm
from tvm import relax

from collage_tvm.placement import Candidate, single_ops
from collage_tvm.registry import get_backend
from collage_tvm.schedule import Stage, group_dag, schedule, sequential
from collage_tvm.schedule.concurrent import STAGE_PREFIX, compile_scheduled
from collage_tvm.schedule.ios import Schedule
from collage_tvm.schedule.plan import branch_groups, plan
from collage_tvm.schedule.workers import Crew, split_cores
from collage_tvm.target import library_threads, make_target, thread_share

from test_ios_schedule import _inception_block


def test_cores_split_between_a_stages_groups():
    assert split_cores(2, 2) == [1, 1]
    assert split_cores(8, 3) == [3, 3, 2]
    assert split_cores(2, 3) == [1, 1, 1]  # more groups than cores: one thread each
    assert split_cores(4, 1) == [4]
    with pytest.raises(ValueError):
        split_cores(4, 0)


def test_a_thread_share_limits_the_libraries_lowered_inside_it():
    from collage_tvm.backends._graphlib import threads

    outside = library_threads()
    with thread_share(1):
        assert threads() == 1
        with thread_share(None):
            assert threads() == outside
    assert threads() == outside
    with pytest.raises(ValueError):
        with thread_share(0):
            pass


def test_a_crew_runs_its_calls_at_once_and_raises_what_one_raised():
    crew = Crew([1, 1])
    meet = threading.Barrier(2, timeout=10)  # passes only when both calls run at once

    def both(x):
        meet.wait()
        return x * 2

    assert crew.run([(both, (1,)), (both, (5,))]) == [2, 10]

    def boom():
        raise RuntimeError("group failed")

    with pytest.raises(RuntimeError, match="group failed"):
        crew.run([(boom, ()), (lambda: 3, ())])
    assert crew.run([(lambda: 1, ()), (lambda: 2, ())]) == [1, 2]  # still serving
    with pytest.raises(ValueError):
        crew.run([(lambda: 1, ())])
    crew.close()


def test_branches_are_the_groups_some_other_group_is_independent_of():
    # 0 -> {1, 2} -> 3 -> 4: 1 and 2 are branches, 0, 3, 4 on the trunk
    succ = [{1, 2}, {3}, {3}, {4}, set()]
    assert branch_groups(succ) == [1, 2]
    assert branch_groups([{1}, {2}, set()]) == []


def _placed_block():
    """The Inception block with its 3x3 convolution on ONNX Runtime, the rest on TVM."""
    graph = _inception_block()
    groups = single_ops(graph)
    ops = [graph.nodes[min(g.nodes)].op_name for g in groups]
    convs = [k for k, op in enumerate(ops) if op == "relax.nn.conv2d"]
    groups = [Candidate("onnxruntime", g.nodes) if k == convs[2] else g
              for k, g in enumerate(groups)]
    backends = {n: get_backend(n) for n in {g.backend for g in groups}}
    return graph, groups, backends


def _run(executable, x):
    return relax.VirtualMachine(executable, tvm.cpu())["main"](x).numpy()


def test_a_concurrent_stage_runs_as_one_call_and_computes_what_the_sequential_build_does():
    from collage_tvm.byoc import compile_placement

    target = make_target("llvm")
    graph, groups, backends = _placed_block()
    ordered, succ = group_dag(graph, groups)

    def cost(stage: Stage) -> float:  # side by side pays
        return 0.01 + max(len(g) for g in stage.groups) * (1 + 0.2 * (len(stage.groups) - 1))

    best = schedule(succ, cost, max_groups=3)
    assert any(len(s.groups) > 1 for s in best.stages)
    executable, mod = compile_scheduled(graph, ordered, best, backends, target, cores=2)
    text = mod["main"].script()
    stage_calls = text.count(f"collage.{STAGE_PREFIX}")
    assert stage_calls == sum(len(s.groups) > 1 for s in best.stages)
    seq, _ = compile_placement(graph, ordered, backends, target, keep=True)
    rng = np.random.default_rng(0)
    for _ in range(2):
        x = tvm.runtime.tensor(rng.standard_normal((1, 8, 16, 16)).astype("float32"))
        np.testing.assert_allclose(_run(executable, x), _run(seq, x), rtol=1e-5, atol=1e-5)
    # the sequential schedule builds no stage call at all
    _, plain = compile_scheduled(graph, ordered, sequential(succ), backends, target, cores=2)
    assert f"collage.{STAGE_PREFIX}" not in plain["main"].script()
    with pytest.raises(NotImplementedError, match="merge"):
        compile_scheduled(graph, ordered, Schedule([Stage(((0,), (1,)), "merge")], 0.0),
                          backends, target)


def test_the_measured_plan_is_a_valid_schedule_and_its_build_matches():
    target = make_target("llvm")
    graph, groups, backends = _placed_block()
    p = plan(graph, groups, backends, target, cores=2)
    # the three convolutions are the branches; each was timed on 2 cores and on 1
    assert len(p.branches) == 3 and all(set(p.group_ms[k]) == {1, 2} for k in p.branches)
    assert all(ms > 0 for k in p.branches for ms in p.group_ms[k].values())
    seen = sorted(k for s in p.schedule.stages for g in s.groups for k in g)
    assert seen == list(range(len(p.ordered)))
    # every concurrent stage of the answer was measured as built, not estimated
    assert all(s.key in p.stage_ms for s in p.concurrent_stages)
    assert p.sequential_ms > 0 and p.scheduled_ms > 0
    assert p.summary()["groups"] == len(p.ordered)
    executable, _ = compile_scheduled(graph, p.ordered, p.schedule, backends, target, cores=2)
    x = tvm.runtime.tensor(np.random.default_rng(1).standard_normal((1, 8, 16, 16))
                           .astype("float32"))
    from collage_tvm.byoc import compile_placement

    seq, _ = compile_placement(graph, p.ordered, backends, target, keep=True)
    np.testing.assert_allclose(_run(executable, x), _run(seq, x), rtol=1e-5, atol=1e-5)


def test_a_placement_with_too_many_branches_is_not_timed(monkeypatch):
    import collage_tvm.schedule.plan as plan_module

    target = make_target("llvm")
    graph, groups, backends = _placed_block()
    monkeypatch.setattr(plan_module, "MAX_BRANCHES", 2)
    p = plan(graph, groups, backends, target, cores=2)
    assert p.skipped.startswith("3 groups on branches") and not p.group_ms
    assert not p.concurrent_stages and p.summary()["skipped"] == p.skipped


def test_a_chain_has_nothing_to_schedule_and_measures_nothing():
    graph = _inception_block()
    # one group for the whole block: a chain of one
    whole = [Candidate("tvm", frozenset(range(len(graph))))]
    p = plan(graph, whole, {"tvm": get_backend("tvm")}, make_target("llvm"), cores=2)
    assert p.branches == [] and not p.concurrent_stages and p.group_ms == {}
    assert not p.worth_building


def test_the_schedule_suite_counts_the_rows_where_the_concurrent_build_wins():
    from collage_tvm.tools import schedule_suite as ss

    def row(model, seq, conc, best):
        frameworks = {ss.SEQUENTIAL: {"ms": seq}, ss.CONCURRENT: {"ms": conc},
                      "onnxruntime": {"ms": best, "match": True},
                      "openvino (default)": {"ms": best / 2, "match": False}}
        return {"model": model, "batch": 1, "plan": {"groups": 9, "branches": 6,
                                                     "concurrent_stages": ["concurrent:1|2"]},
                **ss._ratios(frameworks)}

    rows = [row("a", 10.0, 8.0, 9.0), row("b", 10.0, 12.0, 11.0),
            {"model": "c", "batch": 4, "error": "boom"}]
    assert rows[0]["shipped"] == ss.CONCURRENT and rows[0]["speedup"] == pytest.approx(1.25)
    assert rows[0]["vs_best_framework"] == pytest.approx(9.0 / 8.0)  # f32 frameworks only
    assert rows[1]["shipped"] == ss.SEQUENTIAL and rows[1]["vs_best_framework"] == \
        pytest.approx(1.1)
    sm = ss.summary(rows)
    assert sm["concurrent_faster"] == 1 and sm["errors"] == 1 and sm["rows"] == 3
    text = ss.markdown("torchvision", rows)
    assert "| a | 1 | 9 (6) | 1 |" in text and "error: boom" in text
    assert "faster than the sequential one in 1 of 2 rows" in text


def _forced_plan(monkeypatch):
    """``schedule.plan.plan`` answering with the Inception block's three convolutions in one
    concurrent stage (its figures from a fake cost: which schedule the machine prefers is
    not what these tests are about)."""
    import collage_tvm.schedule.plan as plan_module

    real = plan_module.plan

    def forced(graph, groups, backends, target, **kw):
        found = real(graph, groups, backends, target, cores=2)

        def cost(stage: Stage) -> float:
            return 0.01 + max(len(g) for g in stage.groups) * (1 + 0.2 * (len(stage.groups) - 1))

        found.schedule = schedule(found.succ, cost, max_groups=3)
        found.scheduled_ms, found.sequential_ms = 1.0, 2.0
        return found

    monkeypatch.setattr(plan_module, "plan", forced)


def test_optimize_ships_a_forced_schedule_and_saves_logs_and_reloads_it(tmp_path, monkeypatch):
    """``schedule="concurrent"``: the final check times the concurrent build beside the
    sequential one and ships it (its outputs match); the saved build runs its stage from the
    parts' own artifacts; the placement log's record rebuilds it without a search."""
    import collage_tvm
    from collage_tvm.check.never_slower import CONCURRENT

    _forced_plan(monkeypatch)
    mod = _inception_block().func
    mod = tvm.IRModule({"main": mod})
    kw = dict(backends="tvm", db=str(tmp_path / "c.db"), graph_level=False, progress=False,
              placement_log=str(tmp_path / "p.jsonl"), schedule="concurrent")
    result = collage_tvm.optimize(mod, "llvm", **kw)
    assert result.placement.stages, (result.report.schedule, list(result.report.comparison), result.report.placement_from_log)
    assert result.report.schedule["shipped"] is True
    assert result.report.shipped == CONCURRENT
    assert result.report.comparison[CONCURRENT].match
    assert f"collage.{STAGE_PREFIX}" in result.module["main"].script()
    x = np.random.default_rng(2).standard_normal((1, 8, 16, 16)).astype("float32")
    want = _run(result.executable, tvm.runtime.tensor(x))
    seq = collage_tvm.optimize(mod, "llvm", **{**kw, "schedule": "sequential",
                                                "placement_log": str(tmp_path / "q.jsonl")})
    assert not seq.placement.stages
    np.testing.assert_allclose(want, _run(seq.executable, tvm.runtime.tensor(x)),
                               rtol=1e-5, atol=1e-5)
    loaded = collage_tvm.load(collage_tvm.save(result, tmp_path / "built"))
    stage = [e for e in loaded.manifest["regions"] if e.get("format") == "stage"]
    assert len(stage) == len(result.placement.stages)
    assert all(p["share"] == 1 for p in stage[0]["parts"])
    assert loaded.manifest["placement"]["concurrent_stages"] == [
        [len(chain) for chain in s] for s in result.placement.stages]
    np.testing.assert_allclose(np.asarray(loaded(x)), want, rtol=1e-5, atol=1e-5)
    from collage_tvm.tools.show_saved import describe

    text = describe(tmp_path / "built")  # ``collage-tvm show DIR``
    assert f"shipped: {CONCURRENT}" in text
    assert f"{len(result.placement.stages)} concurrent stage(s)" in text
    # ``collage-tvm show`` boxes the stage around its groups
    from collage_tvm.placement import placement_record
    from collage_tvm.tools.show import render

    record = placement_record(result.placement, result.graph, "llvm", shipped=CONCURRENT)
    assert len(record["stages"][0]) == len(result.placement.stages[0])
    svg = open(render(record, str(tmp_path / "p.svg"))).read()
    assert svg.count('class="stage"') == len(result.placement.stages)
    assert "1 concurrent stage" in svg and "groups at once" in svg
    again = collage_tvm.optimize(mod, "llvm", **kw)  # from the placement log
    assert again.report.placement_from_log
    assert [[set(g.nodes) for g in chain] for chain in again.placement.stages[0]] == \
        [[set(g.nodes) for g in chain] for chain in result.placement.stages[0]]
    np.testing.assert_allclose(_run(again.executable, tvm.runtime.tensor(x)), want,
                               rtol=1e-5, atol=1e-5)


def test_the_check_ships_the_concurrent_build_only_when_fastest(monkeypatch):
    """Under "auto" the concurrent build is one more contender: whatever ships is the fastest
    correct one (never a schedule slower than the build in turn)."""
    from collage_tvm.check.never_slower import CONCURRENT, never_slower
    from collage_tvm.placement import Placement
    from collage_tvm.schedule.concurrent import chains_of

    target = make_target("llvm")
    graph, groups, backends = _placed_block()
    ordered, succ = group_dag(graph, groups)
    best = schedule(succ, lambda s: 0.01 + max(len(g) for g in s.groups) * (
        1 + 0.2 * (len(s.groups) - 1)), max_groups=3)
    placement = Placement(ordered, 1.0)
    staged = Placement(ordered, 1.0, stages=chains_of(ordered, best))
    verdict = never_slower(graph, placement, backends, target, scheduled=staged)
    results = verdict.comparison
    assert results[CONCURRENT].match and results[CONCURRENT].ms > 0
    ok = {n: r.ms for n, r in results.items() if r.can_ship}
    assert verdict.shipped == min(ok, key=ok.get)
    assert bool(verdict.placement.stages) == (verdict.shipped == CONCURRENT)
    assert results[CONCURRENT].ops == {"tvm": len(graph) - 1, "onnxruntime": 1}


@pytest.mark.parametrize("name", ["randwire", "detection_head"])
def test_ios_models_have_independent_branches(tmp_path, name):
    """IOS's models defined in code (the schedule suite's rows): exported to ONNX and
    imported, many of their operators sit on branches another one is independent of."""
    import torch

    from collage_tvm.graph import DataflowGraph
    from collage_tvm.frontend import load_model
    from collage_tvm.tools import zoo

    model, x = zoo.IOS[name]("small")
    path = str(tmp_path / f"{name}.onnx")
    torch.onnx.export(model, (x,), path, input_names=["x"], opset_version=17, dynamo=False)
    graph = DataflowGraph.from_module(load_model(path))
    _, succ = group_dag(graph, single_ops(graph))
    assert len(branch_groups(succ)) > len(graph) // 4


def test_a_stage_with_a_library_part_saves_and_loads(tmp_path):
    """A stage whose parts include an ONNX Runtime region: each part saved as a build of its
    own (the region as its ONNX file, made for the part's thread share) and loaded back."""
    from types import SimpleNamespace

    import collage_tvm
    from collage_tvm.byoc import compile_placement
    from collage_tvm.placement import Placement
    from collage_tvm.report import BuildReport
    from collage_tvm.schedule.concurrent import chains_of, compile_staged

    target = make_target("llvm")
    graph, groups, backends = _placed_block()
    ordered, succ = group_dag(graph, groups)
    best = schedule(succ, lambda s: 0.01 + max(len(g) for g in s.groups) * (
        1 + 0.2 * (len(s.groups) - 1)), max_groups=3)
    stages = chains_of(ordered, best)
    assert any(g.backend == "onnxruntime" for st in stages for ch in st for g in ch)
    executable, lowered = compile_staged(graph, ordered, stages, backends, target, keep=True)
    result = SimpleNamespace(executable=executable, module=lowered, graph=graph,
                             placement=Placement(ordered, 1.0, stages=stages), target=target,
                             report=BuildReport(backends=list(backends)), model_file=None)
    loaded = collage_tvm.load(collage_tvm.save(result, tmp_path / "built"))
    entry = next(e for e in loaded.manifest["regions"] if e.get("format") == "stage")
    assert entry["libraries"] == ["onnxruntime"]
    x = np.random.default_rng(3).standard_normal((1, 8, 16, 16)).astype("float32")
    seq, _ = compile_placement(graph, ordered, backends, target, keep=True)
    np.testing.assert_allclose(np.asarray(loaded(x)), _run(seq, tvm.runtime.tensor(x)),
                               rtol=1e-5, atol=1e-5)
