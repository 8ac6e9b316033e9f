"""Issue #80: a graph library's region cut at its branches for the schedule, and put back
together where the schedule runs its pieces in turn (``schedule.split``)."""
from __future__ import annotations

import numpy as np
import tvm

from collage_tvm.placement import Candidate, order_groups
from collage_tvm.registry import get_backend
from collage_tvm.schedule import Stage, group_dag
from collage_tvm.schedule.ios import Schedule, sequential
from collage_tvm.schedule.split import pieces, remerge, split_for_schedule, was_split
from collage_tvm.target import make_target

from test_ios_schedule import _inception_block


def _whole_on(backend: str):
    graph = _inception_block()
    whole = Candidate(backend, frozenset(range(len(graph))), f"{backend}.whole")
    return graph, whole, {backend: get_backend(backend)}


def _ops(graph, nodes) -> list:
    return [graph.nodes[i].op_name.rsplit(".", 1)[-1] for i in sorted(nodes)]


def test_a_region_is_cut_into_its_chains_so_each_branch_is_a_piece():
    graph, whole, backends = _whole_on("onnxruntime")
    cut = pieces(graph, whole.nodes)
    assert [_ops(graph, p) for p in cut] == [["conv2d"], ["conv2d"], ["conv2d"],
                                            ["concat", "relu"]]
    groups, origin = split_for_schedule(graph, [whole], backends, cores=4)
    assert [g.nodes for g in groups] == cut and all(origin[g] is whole for g in groups)
    assert was_split(origin) == 1
    # on 2 cores nothing is cut (each piece runs well on both: module ``SPLIT_FROM_CORES``)
    assert split_for_schedule(graph, [whole], backends, cores=2)[0] == [whole]
    # the pieces are a valid placement whose three convolutions are branches
    _, succ = group_dag(graph, groups)
    assert succ[0] == succ[1] == succ[2] == {3}
    # a TVM region (one fused kernel) and a chain stay whole
    tvm_groups, tvm_origin = split_for_schedule(graph, [Candidate("tvm", whole.nodes)],
                                                {"tvm": get_backend("tvm")}, cores=4)
    assert len(tvm_groups) == 1 and was_split(tvm_origin) == 0
    chain = frozenset(i for i in whole.nodes if _ops(graph, [i])[0] in ("concat", "relu"))
    assert pieces(graph, chain) == [chain]


def test_what_runs_in_turn_is_put_back_and_only_concurrent_cuts_remain():
    graph, whole, backends = _whole_on("onnxruntime")
    groups, origin = split_for_schedule(graph, [whole], backends, cores=4)
    ordered, succ = group_dag(graph, groups)
    # in turn: the region as it was
    again, stages = remerge(ordered, sequential(succ), origin)
    assert again == [whole] and again[0] is whole and stages == []
    # the first convolution alone, the other two at once, then concat + relu
    plan = Schedule([Stage(((0,),)), Stage(((1,), (2,))), Stage(((3,),))], 0.0)
    staged, stages = remerge(ordered, plan, origin)
    assert [g.nodes for g in staged] == [ordered[k].nodes for k in range(4)]
    assert [[[g.nodes for g in chain] for chain in s] for s in stages] == [
        [[ordered[1].nodes], [ordered[2].nodes]]]
    assert order_groups(graph, staged)  # (no cycle: each group is convex)
    # all three at once: the last piece is put back as what is left of the region
    plan = Schedule([Stage(((0,), (1,), (2,))), Stage(((3,),))], 0.0)
    staged, stages = remerge(ordered, plan, origin)
    assert len(staged) == 4 and len(stages) == 1 and len(stages[0]) == 3
    assert frozenset().union(*(g.nodes for g in staged)) == whole.nodes


def test_a_concurrent_build_of_an_onnx_runtime_regions_branches_computes_the_same():
    from tvm import relax

    from collage_tvm.byoc import compile_placement
    from collage_tvm.schedule.concurrent import compile_staged
    from collage_tvm.schedule.plan import plan

    target = make_target("llvm")
    graph, whole, backends = _whole_on("onnxruntime")
    groups, origin = split_for_schedule(graph, [whole], backends, cores=4)
    p = plan(graph, groups, backends, target, cores=2)
    # the three convolutions are the branches, each timed as an ONNX Runtime region
    assert sorted(p.branches) == [0, 1, 2] and all(set(p.group_ms[k]) == {1, 2}
                                                    for k in p.branches)
    ordered = p.ordered
    staged, stages = remerge(ordered, Schedule([Stage(((0,), (1,), (2,))), Stage(((3,),))],
                                               0.0), origin)
    executable, mod = compile_staged(graph, order_groups(graph, staged), stages, backends,
                                     target, cores=2)
    seq, _ = compile_placement(graph, [whole], backends, target)
    x = tvm.runtime.tensor(np.random.default_rng(3).standard_normal((1, 8, 16, 16))
                           .astype("float32"))
    got = relax.VirtualMachine(executable, tvm.cpu())["main"](x).numpy()
    want = relax.VirtualMachine(seq, tvm.cpu())["main"](x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_optimize_cuts_a_library_region_for_a_forced_schedule_and_ships_it(tmp_path,
                                                                             monkeypatch):
    """The search puts the whole block on ONNX Runtime (one region): on a machine where
    regions are cut (forced here), the plan sees its branches, and a forced concurrent
    schedule ships ONNX Runtime pieces side by side that compute what the region does."""
    import collage_tvm
    import collage_tvm.schedule.split as split
    from test_concurrent_schedule import _forced_plan

    monkeypatch.setattr(split, "SPLIT_FROM_CORES", 2)
    _forced_plan(monkeypatch)
    mod = tvm.IRModule({"main": _inception_block().func})
    kw = dict(backends="tvm,onnxruntime", db=str(tmp_path / "c.db"), graph_level=False,
              progress=False, placement_log=str(tmp_path / "p.jsonl"), schedule="concurrent")
    res = collage_tvm.optimize(mod, "llvm", **kw)
    assert res.report.schedule["split"] == {"regions": 1, "pieces": 4}
    assert res.report.schedule["shipped"] is True
    (stage,) = res.placement.stages
    assert len(stage) == 3 and all(g.backend == "onnxruntime" for chain in stage for g in chain)
    seq = collage_tvm.optimize(mod, "llvm", **{**kw, "schedule": "sequential",
                                                "placement_log": str(tmp_path / "q.jsonl")})
    assert [g.backend for g in seq.placement.groups] == ["onnxruntime"]
    x = tvm.runtime.tensor(np.random.default_rng(4).standard_normal((1, 8, 16, 16))
                           .astype("float32"))
    from tvm import relax

    got, want = (relax.VirtualMachine(r.executable, tvm.cpu())["main"](x).numpy()
                 for r in (res, seq))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
