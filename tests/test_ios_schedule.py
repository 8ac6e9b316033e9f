"""IOS's schedule by dynamic programming (issue #80): against brute force on small random DAGs.

The brute force here shares nothing with ``collage_tvm.schedule.ios`` but the ``Stage`` type:
it walks every sequence of stages forward (each stage any subset of the nodes not yet run whose
predecessors ran or are in it), builds groups from connected components itself, and keeps the
cheapest sequence. The costs are fake tables: a concurrent stage pays an overhead plus its
longest group slowed by a contention factor per extra group; a merge pays a share of its nodes'
costs, or inf where it gets too large.
"""
from __future__ import annotations

import itertools
import math
import random

import pytest

from collage_tvm.schedule import (MAX_GROUP_OPS, MAX_GROUPS, Schedule, Stage, same_kind_siblings,
                                  schedule, sequential, topological_order)

SEEDS = range(60)
LIMITS = [(MAX_GROUPS, MAX_GROUP_OPS), (2, 2), (1, 3), (3, 1), (2, 1), (1, 1)]


def predecessors(succ) -> list[set[int]]:
    preds = [set() for _ in succ]
    for i, targets in enumerate(succ):
        for j in targets:
            preds[j].add(i)
    return preds


def random_dag(rng: random.Random, n: int, p: float) -> list[set[int]]:
    """Edges i -> j (i < j) with probability p, then the labels shuffled: ids not in order."""
    label = list(range(n))
    rng.shuffle(label)
    succ = [set() for _ in range(n)]
    for i, j in itertools.combinations(range(n), 2):
        if rng.random() < p:
            succ[label[i]].add(label[j])
    return succ


def fake_cost(op_cost, overhead=1.0, contention=0.25, merge_share=0.75, merge_cap=math.inf):
    """A stage's cost; ``calls`` counts the calls of each stage."""
    calls: dict[Stage, int] = {}

    def cost(stage: Stage) -> float:
        calls[stage] = calls.get(stage, 0) + 1
        work = [sum(op_cost[x] for x in group) for group in stage.groups]
        if stage.kind == "merge":
            return math.inf if sum(work) > merge_cap else overhead + merge_share * sum(work)
        return overhead + max(work) * (1 + contention * (len(work) - 1))
    cost.calls = calls
    return cost


def components(nodes: set[int], succ) -> list[list[int]]:
    """The weakly connected components of ``nodes``, each in a topological order."""
    left, comps = set(nodes), []
    while left:
        todo, comp = [min(left)], set()
        while todo:
            x = todo.pop()
            if x in comp:
                continue
            comp.add(x)
            todo += [y for y in nodes if y not in comp and (y in succ[x] or x in succ[y])]
        left -= comp
        ordered = []
        while len(ordered) < len(comp):  # a node whose predecessors in comp are placed
            ordered.append(min(x for x in comp - set(ordered)
                               if all(x not in succ[y] for y in comp - set(ordered))))
        comps.append(ordered)
    return comps


def brute_force(succ, stage_cost, max_groups, max_group_ops, merge=None) -> Schedule:
    """Every valid stage sequence, the cheapest kept (exponential: small graphs only)."""
    n, preds = len(succ), predecessors(succ)
    best = Schedule([], math.inf)

    def stages_of(subset: tuple[int, ...]):
        comps = components(set(subset), succ)
        if (max_groups is None or len(comps) <= max_groups) and \
                (max_group_ops is None or all(len(c) <= max_group_ops for c in comps)):
            yield Stage(tuple(tuple(c) for c in comps), "concurrent")
        if merge is not None and len(subset) > 1 and len(comps) == len(subset):
            keys = {merge(x) for x in subset}
            if len(keys) == 1 and None not in keys:
                yield Stage(tuple((x,) for x in subset), "merge")

    def walk(done: frozenset, stages: list, total: float) -> None:
        if len(done) == n:
            if total < best.cost:
                best.stages, best.cost = list(stages), total
            return
        left = [x for x in range(n) if x not in done]
        for size in range(1, len(left) + 1):
            for subset in itertools.combinations(left, size):
                if any(not preds[x] <= done | set(subset) for x in subset):
                    continue
                for stage in stages_of(subset):
                    if stage.kind == "merge" and any(not preds[x] <= done for x in subset):
                        continue
                    cost = stage_cost(stage)
                    walk(done | set(subset), stages + [stage], total + cost)

    walk(frozenset(), [], 0.0)
    return best


def assert_valid(succ, sched: Schedule, stage_cost, max_groups=None, max_group_ops=None,
                 merge=None) -> None:
    """Every node once; a node after its predecessors (in earlier stages, or earlier in its own
    group); groups of a stage independent; the limits kept; the cost the stages' sum."""
    preds = predecessors(succ)
    nodes = [x for st in sched.stages for x in st.nodes]
    assert sorted(nodes) == list(range(len(succ))), sched
    done: set[int] = set()
    for st in sched.stages:
        assert st.groups and all(st.groups), st
        if st.kind == "merge":
            assert len(st.groups) > 1 and all(len(g) == 1 for g in st.groups), st
            assert merge is not None and len({merge(x) for x in st.nodes}) == 1, st
            assert merge(st.nodes[0]) is not None, st
            assert all(preds[x] <= done for x in st.nodes), st
        else:
            assert st.kind == "concurrent", st
            assert max_groups is None or len(st.groups) <= max_groups, st
            assert max_group_ops is None or all(len(g) <= max_group_ops for g in st.groups), st
            for group in st.groups:
                for k, x in enumerate(group):
                    assert preds[x] <= done | set(group[:k]), (st, x)
            for a, b in itertools.permutations(st.groups, 2):
                assert not any(y in succ[x] for x in a for y in b), (st, "groups depend")
        done |= set(st.nodes)
    assert math.isclose(sched.cost, sum(stage_cost(st) for st in sched.stages))


@pytest.mark.parametrize("seed", SEEDS)
def test_dp_matches_brute_force_on_random_dags(seed):
    rng = random.Random(seed)
    n = 3 + seed % 6  # 3..8 nodes, each size ten times
    succ = random_dag(rng, n, rng.choice([0.25, 0.4, 0.6]))
    op_cost = [rng.randint(1, 9) for _ in range(n)]
    cost = fake_cost(op_cost, overhead=rng.choice([0.0, 0.5, 2.0]),
                     contention=rng.choice([0.0, 0.25, 0.75, 1.5]),
                     merge_share=rng.choice([0.5, 0.75, 1.25]), merge_cap=rng.choice([8, 20]))
    merge = same_kind_siblings([rng.choice("ab") for _ in range(n)], succ) \
        if seed % 2 else None
    baseline = sequential(succ, cost)
    assert_valid(succ, baseline, cost)
    for limits in [(None, None), rng.choice(LIMITS)]:
        got = schedule(succ, cost, *limits, merge=merge)
        assert_valid(succ, got, cost, *limits, merge=merge)
        want = brute_force(succ, cost, *limits, merge=merge)
        assert math.isclose(got.cost, want.cost), (succ, limits, got, want)
        assert got.cost <= baseline.cost + 1e-9


def test_every_distinct_stage_is_costed_once():
    succ = random_dag(random.Random(7), 8, 0.3)
    cost = fake_cost([3, 1, 4, 1, 5, 9, 2, 6])
    got = schedule(succ, cost, None, None, merge=same_kind_siblings(["a"] * 8, succ))
    assert cost.calls and set(cost.calls.values()) == {1}
    assert got.costed == len(cost.calls) and got.states > len(succ)


def test_a_chain_has_no_concurrency():
    succ = [{1}, {2}, {3}, {4}, set()]
    cost = fake_cost([5, 1, 4, 2, 3], overhead=1.0)
    one_by_one = schedule(succ, cost, max_group_ops=1)
    assert [st.groups for st in one_by_one.stages] == [((x,),) for x in range(5)]
    assert math.isclose(one_by_one.cost, sequential(succ, cost).cost)
    grouped = schedule(succ, cost, max_group_ops=3)  # with an overhead, fewer stages pay
    assert all(len(st.groups) == 1 for st in grouped.stages)
    assert [x for st in grouped.stages for x in st.nodes] == list(range(5))
    assert [len(st.nodes) for st in grouped.stages] in ([3, 2], [2, 3])


@pytest.mark.parametrize("contention, stages", [(0.2, 1), (1.5, 2)])
def test_two_heavy_branches_run_at_once_only_where_it_pays(contention, stages):
    # 0 -> 1 -> 2 and 3 -> 4 -> 5: two independent branches of 10 + 10
    succ = [{1}, {2}, set(), {4}, {5}, set()]
    cost = fake_cost([4, 3, 3, 5, 2, 3], overhead=0.5, contention=contention)
    got = schedule(succ, cost)
    assert len(got.stages) == stages
    if stages == 1:
        assert got.stages[0].groups == ((0, 1, 2), (3, 4, 5))
        assert math.isclose(got.cost, 0.5 + 10 * 1.2)
    else:
        assert sorted(st.groups for st in got.stages) == [((0, 1, 2),), ((3, 4, 5),)]
        assert math.isclose(got.cost, 2 * (0.5 + 10))
    assert got.cost < sequential(succ, cost).cost


def test_a_merge_of_same_kind_siblings():
    # 0 feeds 1, 2, 3, 5 (1, 2, 5 convolutions of one input, 3 a pool); all four feed 4
    succ = [{1, 2, 3, 5}, {4}, {4}, {4}, set(), {4}]
    merge = same_kind_siblings(["in", "conv", "conv", "pool", "cat", "conv"], succ)
    cost = fake_cost([1, 4, 4, 4, 1, 4], overhead=1.0, contention=2.0, merge_share=0.5)
    got = schedule(succ, cost, merge=merge)
    assert Stage(((1,), (2,), (5,)), "merge") in got.stages
    assert_valid(succ, got, cost, MAX_GROUPS, MAX_GROUP_OPS, merge)
    assert merge(1) == merge(2) != merge(3) and merge(4) is None  # 4 reads four inputs


def test_one_group_may_hold_a_fork():
    # 0 -> 1, 0 -> 2: with one group a stage, the fork is still one group (run in turn)
    succ = [{1, 2}, set(), set()]
    got = schedule(succ, fake_cost([1, 1, 1], overhead=5.0), max_groups=1, max_group_ops=3)
    assert [st.groups for st in got.stages] == [((0, 1, 2),)]


def test_max_part_schedules_parts_in_turn():
    succ = random_dag(random.Random(3), 8, 0.3)
    cost = fake_cost([2, 7, 1, 8, 2, 8, 1, 8], contention=0.1)
    whole = schedule(succ, cost, None, None)
    assert math.isclose(schedule(succ, cost, None, None, max_part=8).cost, whole.cost)
    parted = schedule(succ, cost, None, None, max_part=3)
    assert_valid(succ, parted, cost)
    assert parted.cost >= whole.cost - 1e-9
    order = topological_order(succ)
    part = {x: order.index(x) // 3 for x in order}
    assert all(len({part[x] for x in st.nodes}) == 1 for st in parted.stages)


def test_bad_graphs_and_parameters_raise():
    cost = fake_cost([1, 1, 1])
    with pytest.raises(ValueError, match="cycle"):
        schedule([{1}, {2}, {0}], cost)
    with pytest.raises(ValueError, match="cycle"):
        schedule([{0}], cost)
    with pytest.raises(ValueError, match="outside"):
        schedule([{3}, set(), set()], cost)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_groups"):
            schedule([set()], cost, max_groups=bad)
    with pytest.raises(ValueError, match="max_group_ops"):
        schedule([set()], cost, max_group_ops=0)
    with pytest.raises(ValueError, match="finite cost"):
        schedule([{1}, set()], lambda st: math.inf)
    with pytest.raises(ValueError, match="must be >= 0"):
        schedule([set()], lambda st: -1.0)
    assert schedule([], cost).stages == [] and schedule([], cost).cost == 0.0



def _inception_block():
    """x -> three convolutions side by side (two 1x1, one 3x3) -> concat -> relu: an
    Inception block's shape, as a ``DataflowGraph``."""
    import numpy as np
    import tvm
    from tvm import relax

    from collage_tvm.graph import DataflowGraph

    rng = np.random.default_rng(0)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 8, 16, 16), "float32"))

    def weight(o, k):
        return relax.const(rng.standard_normal((o, 8, k, k)).astype("float32"))

    with bb.function("main", [x]):
        with bb.dataflow():
            a = bb.emit(relax.op.nn.conv2d(x, weight(4, 1)))
            b = bb.emit(relax.op.nn.conv2d(x, weight(6, 1)))
            c = bb.emit(relax.op.nn.conv2d(x, weight(4, 3), padding=(1, 1)))
            cat = bb.emit(relax.op.concat([a, b, c], axis=1))
            out = bb.emit_output(relax.op.nn.relu(cat))
        bb.emit_func_output(out)
    return DataflowGraph.from_module(bb.get())


def test_a_placements_groups_are_the_dag_and_its_branches_can_share_a_stage():
    """A placement's groups (``schedule.group_dag``): the three convolutions of an Inception
    block read only the input and feed the concat, so a cost that rewards running them side
    by side schedules them in one stage; the two 1x1 convolutions share a merge key, the
    3x3 (other padding) does not."""
    from collage_tvm.placement import single_ops
    from collage_tvm.schedule import group_dag, merge_keys

    graph = _inception_block()
    groups, succ = group_dag(graph, single_ops(graph))
    ops = [graph.nodes[min(g.nodes)].op_name for g in groups]
    convs = {k for k, op in enumerate(ops) if op == "relax.nn.conv2d"}
    (cat,) = [k for k, op in enumerate(ops) if op == "relax.concat"]
    assert len(convs) == 3 and all(succ[k] == {cat} for k in convs)
    assert topological_order(succ).index(cat) > max(topological_order(succ).index(k)
                                                    for k in convs)
    keys = merge_keys(graph, groups)
    assert len({keys[k] for k in convs}) == 2  # the two 1x1s alike, the 3x3 apart

    def cost(stage: Stage) -> float:  # side by side: the longest group, 20% contention
        longest = max(len(g) for g in stage.groups)
        return 0.01 + longest * (1 + 0.2 * (len(stage.groups) - 1))

    best = schedule(succ, cost, max_groups=3)
    assert best.cost < sequential(succ, cost).cost
    assert any({n for n in s.nodes} == convs for s in best.stages), best.stages
    # a group that is not convex (a convolution with the relu after the concat, the concat
    # apart) leaves no order to run them in
    from collage_tvm.placement import Candidate

    by_op = {}
    for node in graph.nodes:
        by_op.setdefault(node.op_name, []).append(node.index)
    first, rest = by_op["relax.nn.conv2d"][0], by_op["relax.nn.conv2d"][1:]
    bad = [Candidate("tvm", frozenset([first, *by_op["relax.nn.relu"]])),
           Candidate("tvm", frozenset(by_op["relax.concat"]))] + \
        [Candidate("tvm", frozenset([i])) for i in rest]
    with pytest.raises(ValueError, match="cycle"):
        group_dag(graph, bad)
