"""Graph-level placer (DEAP): convexity, merging of offloaded groups, and the search itself
against a fake latency model (the product always measures; a test may not)."""
import itertools
import math

import numpy as np
import pytest
from tvm import relax

from collage_tvm.placement import order_groups
from collage_tvm.placement import Candidate, Placement
from collage_tvm.graph import DataflowGraph
from collage_tvm.placer.graph_level import GraphLevelSearch
from collage_tvm.placement import is_convex, merge_offloaded
from collage_tvm.registry import Backend, PatternRule


def _diamond_chain():
    """x -> conv -> relu -> {sigmoid, tanh} -> add -> softmax -> mul(by relu) : 7 nodes."""
    x = relax.Var("x", relax.TensorType((1, 4, 8, 8), "float32"))
    w = relax.const(np.random.default_rng(0).random((4, 4, 3, 3), dtype="float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            c = bb.emit(relax.op.nn.conv2d(x, w, padding=[1, 1, 1, 1]))   # 0
            r = bb.emit(relax.op.nn.relu(c))                              # 1
            s = bb.emit(relax.op.sigmoid(r))                              # 2
            t = bb.emit(relax.op.tanh(r))                                 # 3
            a = bb.emit(relax.op.add(s, t))                               # 4
            m = bb.emit(relax.op.nn.softmax(a))                           # 5
            out = bb.emit_output(relax.op.multiply(m, r))                 # 6
        bb.emit_func_output(out)
    return DataflowGraph(bb.get()["main"])


def _lib(name, invalid_ops=()):
    return Backend(name=name, kind="graph",
                   rules=[PatternRule(valid_op=lambda n, bad=tuple(invalid_ops):
                                      n.call is not None and n.op_name not in bad)])


def _op_level(graph):
    groups = [Candidate("tvm", frozenset([i]), "tvm.op") for i in range(len(graph))]
    return Placement(groups, 0.0, {g: "op-level" for g in groups})


def test_convexity():
    g = _diamond_chain()
    assert is_convex(g, {1, 2, 3, 4})
    assert not is_convex(g, {1, 4})          # 1 -> 2 -> 4 leaves and re-enters
    assert not is_convex(g, {1, 6})          # 1 -> ... -> 5 -> 6
    assert is_convex(g, {5, 6}) and is_convex(g, {0})


def test_merge_offloaded_merges_touching_groups_only_while_convex():
    g = _diamond_chain()
    groups = [Candidate("tvm", frozenset([i])) for i in range(len(g))]
    lib = [Candidate("ort", frozenset([i])) if i in (1, 4) else groups[i] for i in range(len(g))]
    merged = merge_offloaded(g, lib, {1, 4})
    assert {c.nodes for c in merged if c.backend == "ort"} == {frozenset([1]), frozenset([4])}
    lib = [Candidate("ort", frozenset([i])) for i in range(len(g))]
    merged = merge_offloaded(g, lib, set(range(len(g))))
    assert [c.nodes for c in merged] == [frozenset(range(len(g)))]
    # Two libraries never merge with each other.
    lib = [Candidate("ort" if i < 3 else "ov", frozenset([i])) for i in range(len(g))]
    merged = merge_offloaded(g, lib, set(range(len(g))))
    assert sorted(len(c.nodes) for c in merged) == [3, 4]
    order_groups(g, merged)  # executable


def _fake_latency(graph, overhead):
    """Per call: the library's overhead + per-node work; the library halves the work."""
    calls = []

    def evaluate(groups):
        calls.append(groups)
        assert sorted(i for c in groups for i in c.nodes) == list(range(len(graph)))
        order_groups(graph, groups)  # raises on a cycle
        return sum(overhead[c.backend] + len(c.nodes) * (0.5 if c.backend != "tvm" else 1.0)
                   for c in groups), None

    return evaluate, calls


def _brute_force(search):
    best = math.inf
    for genes in itertools.product([0, 1], repeat=search.n_genes):
        groups, _ = search.decode(list(genes))
        best = min(best, search.evaluate(groups)[0])
    return best


@pytest.mark.parametrize("overhead,expect_all", [(0.1, True), (50.0, False)])
def test_search_finds_the_optimum_of_a_fake_latency_model(overhead, expect_all):
    g = _diamond_chain()
    evaluate, calls = _fake_latency(g, {"tvm": 0.0, "ort": overhead})
    search = GraphLevelSearch(g, _op_level(g), {"ort": _lib("ort")}, evaluate, seed=1)
    assert search.n_genes == len(g)
    res = search.run(budget_s=30, population=8, patience=6)
    calls = list(calls)  # before the brute force below adds its own
    assert res.best_ms == pytest.approx(_brute_force(search))
    assert res.seed_ms == pytest.approx(len(g))
    offloaded = [c for c in res.placement.groups if c.backend == "ort"]
    if expect_all:  # cheap calls: the whole graph as one library call
        assert [c.nodes for c in offloaded] == [frozenset(range(len(g)))]
        assert all(res.placement.chosen_by[c] == "graph-level" for c in offloaded)
    else:           # a call costs more than all the work it saves: keep the op-level placement
        assert not offloaded
    # Memoised: every distinct placement was evaluated once.
    assert len(calls) == len({search.key(c) for c in calls}) == res.evaluated
    assert res.history and res.history[-1]["best_ms"] == pytest.approx(res.best_ms)
    assert res.stopped in ("saturation", "exhausted", "budget")


@pytest.mark.parametrize("overhead", [0.1, 2.0, 50.0])
def test_placements_whose_library_calls_alone_lose_are_not_built(overhead):
    """With each library call's least time known (its measured per-call overhead), a
    placement whose calls alone take BOUND_MARGIN times the best measured is not built:
    the search finds the same optimum, builds fewer placements, and none it left unbuilt
    could have won (the fake model's latency of each is past the best)."""
    from collage_tvm.placer.graph_level import BOUND_MARGIN

    g = _diamond_chain()
    cost = {"tvm": 0.0, "ort": overhead}
    evaluate, plain_calls = _fake_latency(g, cost)
    plain = GraphLevelSearch(g, _op_level(g), {"ort": _lib("ort")}, evaluate, seed=1)
    plain_res = plain.run(budget_s=30, population=8, patience=6)
    evaluate, calls = _fake_latency(g, cost)
    search = GraphLevelSearch(g, _op_level(g), {"ort": _lib("ort")}, evaluate, seed=1,
                              call_ms={"ort": overhead, "not-a-library": 1e9})
    res = search.run(budget_s=30, population=8, patience=6)
    built, plain_built = len(calls), len(plain_calls)  # before the brute force adds its own
    assert res.best_ms == pytest.approx(_brute_force(search)) == pytest.approx(plain_res.best_ms)
    assert res.bounded == len(search.bounded) and res.evaluated == len(search.memo)
    assert not set(search.bounded) & set(search.memo)  # left unbuilt: never evaluated
    truth = {search.key(gs): search.evaluate(gs)[0] for gs in
             (search.decode(list(genes))[0]
              for genes in itertools.product([0, 1], repeat=search.n_genes))}
    for key, bound in search.bounded.items():
        assert bound > BOUND_MARGIN * res.best_ms
        assert truth[key] >= bound > res.best_ms  # a lower bound, and a loser
    if overhead == 50.0:  # one call costs more than the whole seed: only the seed is built
        assert res.evaluated == 1 and res.bounded > 0
        assert built == 1 < plain_built
    if overhead == 0.1:  # calls cheap against the work: nothing can be bounded out
        assert res.bounded == 0


def test_search_is_repeatable_and_leaves_the_global_random_alone():
    """DEAP draws from the global ``random``: the search seeds it from its own seed and
    gives it back, so the same seed finds the same placement and a caller's stream of
    random numbers is not disturbed."""
    import random
    g = _diamond_chain()
    runs = []
    for _ in range(2):
        evaluate, calls = _fake_latency(g, {"tvm": 0.0, "ort": 1.5})
        random.seed(1234)
        search = GraphLevelSearch(g, _op_level(g), {"ort": _lib("ort")}, evaluate, seed=7)
        res = search.run(budget_s=30, population=8, patience=4)
        runs.append(([search.key(c) for c in calls], res.best_ms, random.random()))
    random.seed(1234)
    untouched = random.random()
    assert runs[0] == runs[1]
    assert runs[0][2] == untouched


def test_two_libraries_and_ops_one_library_cannot_run():
    g = _diamond_chain()
    libs = {"ort": _lib("ort"), "ov": _lib("ov", invalid_ops=("relax.nn.softmax",))}
    evaluate, _ = _fake_latency(g, {"tvm": 0.0, "ort": 2.0, "ov": 0.2})
    search = GraphLevelSearch(g, _op_level(g), libs, evaluate, seed=3)
    assert search.choice_bits == 1 and search.n_genes == 2 * len(g)
    # ov cannot run softmax: a gene asking for ov there falls back to ort.
    genes = [1] * len(g) + [1] * len(g)
    groups, _ = search.decode(genes)
    softmax = next(c for c in groups if 5 in c.nodes)
    assert softmax.backend == "ort"
    seeds = [evaluate(search.decode(genes)[0])[0] for genes in search.seeds()]
    assert seeds == pytest.approx([7.0, 5.5, 5.9])  # op-level, all-ort, all-ov (+ort softmax)
    res = search.run(budget_s=60, population=16, patience=10)
    # Never worse than the best seed; usually the optimum (4.4), which a GA cannot promise.
    assert _brute_force(search) <= res.best_ms <= min(seeds)
    assert res.evaluated > len(seeds)


def test_invalid_individuals_are_skipped_and_the_search_goes_on(caplog):
    g = _diamond_chain()
    base, _ = _fake_latency(g, {"tvm": 0.0, "ort": 0.1})

    def evaluate(groups):  # the library "fails to load" any subgraph above 3 operators
        if any(c.backend == "ort" and len(c.nodes) > 3 for c in groups):
            return math.inf, "ort: cannot load a subgraph of more than 3 operators"
        return base(groups)

    search = GraphLevelSearch(g, _op_level(g), {"ort": _lib("ort")}, evaluate, seed=0)
    with caplog.at_level("WARNING", logger="collage_tvm"):
        res = search.run(budget_s=30, population=10, patience=6)
    assert res.invalid and all("cannot load" in r for r in res.invalid.values())
    # one warning for the one reason, however many placements it made invalid
    assert len(res.invalid) > 1
    assert sum("placement invalid" in r.message for r in caplog.records) == 1
    assert math.isfinite(res.best_ms) and res.best_ms < res.seed_ms
    assert all(len(c.nodes) <= 3 for c in res.placement.groups if c.backend == "ort")


def test_nothing_to_search_without_eligible_groups():
    g = _diamond_chain()
    evaluate, calls = _fake_latency(g, {"tvm": 0.0, "ort": 0.1})
    lib = Backend(name="ort", kind="graph", rules=[PatternRule(valid_op=lambda n: False)])
    res = GraphLevelSearch(g, _op_level(g), {"ort": lib}, evaluate).run(budget_s=5)
    assert res.stopped == "exhausted" and not calls and res.placement.groups == _op_level(g).groups


def test_the_search_stops_once_every_distinct_placement_was_measured():
    """One eligible group, two libraries that can run it: 2 genes (4 patterns) but 3
    placements (stay, on one, on the other), all of them seeds: measured in generation 0,
    no generation after it (it ran to saturation, 5 more generations, before)."""
    g = _diamond_chain()
    softmax_only = {name: Backend(name=name, kind="graph", rules=[PatternRule(
        valid_op=lambda n: n.op_name == "relax.nn.softmax")]) for name in ("ort", "ov")}
    evaluate, calls = _fake_latency(g, {"tvm": 0.0, "ort": 0.1, "ov": 0.2})
    search = GraphLevelSearch(g, _op_level(g), softmax_only, evaluate, seed=0)
    assert search.n_genes == 2 and search._distinct_placements() == 3
    res = search.run(budget_s=30, population=8, patience=5)
    assert res.stopped == "exhausted" and res.evaluated == len(calls) == 3
    assert len(res.history) == 1  # generation 0 only
    assert res.best_ms == pytest.approx(_brute_force(search))


def test_reachable_lists_every_placement_the_genes_decode_to_and_gives_up_on_many():
    g = _diamond_chain()
    softmax_only = {name: Backend(name=name, kind="graph", rules=[PatternRule(
        valid_op=lambda n: n.op_name == "relax.nn.softmax")]) for name in ("ort", "ov")}
    search = GraphLevelSearch(g, _op_level(g), softmax_only, lambda groups: (1.0, None))
    reach = search.reachable()
    assert len(reach) == search._distinct_placements() == 3
    assert {b for key in reach for b, nodes in key if nodes == frozenset([5])} == \
        {"tvm", "ort", "ov"}  # the softmax stays, or goes to either library
    every = GraphLevelSearch(g, _op_level(g), {"ort": _lib("ort")}, lambda groups: (1.0, None))
    assert every.n_genes == 7 and every.reachable(limit=64) is None
    assert len(every.reachable(limit=128)) > 7


def test_offloaded_groups_merge_with_op_level_library_groups():
    g = _diamond_chain()
    groups = [Candidate("ort" if i in (1, 2) else "tvm", frozenset([i]),
                        "ort.op" if i in (1, 2) else "tvm.op") for i in range(len(g))]
    op_level = Placement(groups, 0.0, {c: "op-level" for c in groups})
    evaluate, _ = _fake_latency(g, {"tvm": 0.0, "ort": 0.1})
    one = GraphLevelSearch(g, op_level, {"ort": _lib("ort")}, evaluate)
    assert [k for k, _ in one.eligible] == [0, 3, 4, 5, 6]  # one library: its groups left out
    assert one.decode([0] * one.n_genes)[0] == groups          # all 0 = the op-level placement
    genes = [1, 0, 0, 0, 0]                                    # offload the conv (node 0)
    merged, chosen = one.decode(genes)
    lib_groups = [c for c in merged if c.backend == "ort"]
    assert [c.nodes for c in lib_groups] == [frozenset({0, 1, 2})]
    assert chosen[lib_groups[0]] == "graph-level"
    two = GraphLevelSearch(g, op_level, {"ort": _lib("ort"), "ov": _lib("ov")}, evaluate)
    assert len(two.eligible) == len(g)                          # several libraries: all groups


def test_library_calls_merge_when_every_eligible_group_is_on_the_library_already():
    """One graph library that the op level already gave every group it can run: no gene is
    left, but its touching single calls still run merged when that measures faster."""
    g = _diamond_chain()
    on_ort = {1, 2, 3, 4}
    groups = [Candidate("ort" if i in on_ort else "tvm", frozenset([i]),
                        "ort.op" if i in on_ort else "tvm.op") for i in range(len(g))]
    op_level = Placement(groups, 0.0, {c: "op-level" for c in groups})
    lib = _lib("ort", invalid_ops=("relax.nn.conv2d", "relax.nn.softmax", "relax.multiply"))
    evaluate, calls = _fake_latency(g, {"tvm": 0.0, "ort": 1.0})
    search = GraphLevelSearch(g, op_level, {"ort": lib}, evaluate)
    assert search.n_genes == 0
    res = search.run(budget_s=5)
    assert len(calls) == 2 and res.best_ms < res.seed_ms
    ort = [c for c in res.placement.groups if c.backend == "ort"]
    assert len(ort) == 1 and ort[0].nodes == frozenset(on_ort)
    assert res.placement.chosen_by[ort[0]] == "graph-level"
    # A per-call cost of 0 gains nothing from merging: the op-level placement stays.
    evaluate, calls = _fake_latency(g, {"tvm": 0.0, "ort": 0.0})
    res = GraphLevelSearch(g, op_level, {"ort": lib}, evaluate).run(budget_s=5)
    assert res.placement.groups == op_level.groups


def _crossing():
    """0 a=relu(x); 1 c=tanh(x); 2 b=sigmoid(a); 3 d=add(a, c); 4 out=mul(b, d)."""
    x = relax.Var("x", relax.TensorType((1, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.nn.relu(x))
            c = bb.emit(relax.op.tanh(x))
            b = bb.emit(relax.op.sigmoid(a))
            d = bb.emit(relax.op.add(a, c))
            out = bb.emit_output(relax.op.multiply(b, d))
        bb.emit_func_output(out)
    return DataflowGraph(bb.get()["main"])


def test_merge_never_makes_groups_need_each_other():
    """{0, 3} is convex on its own, but with the TVM group {1, 2} it would need {1, 2}'s
    output (c) while {1, 2} needs its output (a): the merge is refused, the result orders."""
    g = _crossing()
    assert is_convex(g, {0, 3})
    groups = [Candidate("ort", frozenset([0])), Candidate("tvm", frozenset([1, 2])),
              Candidate("ort", frozenset([3])), Candidate("tvm", frozenset([4]))]
    with pytest.raises(ValueError):
        order_groups(g, [Candidate("ort", frozenset([0, 3])), groups[1], groups[3]])
    merged = merge_offloaded(g, groups, {0, 2})
    assert {c.nodes for c in merged if c.backend == "ort"} == {frozenset([0]), frozenset([3])}
    assert len(order_groups(g, merged)) == 4
