"""Tests for the op-level placer (Collage paper, Algorithm 1)."""
from __future__ import annotations

import logging
import math
import random

import pytest


from collage_tvm.placement import Candidate
from collage_tvm.placer.op_level import place

INF = math.inf


# ---------------------------------------------------------------- helpers

def _descendants(producers):
    n = len(producers)
    cons = [[] for _ in range(n)]
    for i, ps in enumerate(producers):
        for p in ps:
            cons[p].append(i)
    desc = [set() for _ in range(n)]
    for i in range(n - 1, -1, -1):
        for j in cons[i]:
            desc[i] |= {j} | desc[j]
    return desc


def _feasible(producers, groups):
    """Independent check: each group convex and the quotient graph of groups acyclic."""
    desc = _descendants(producers)
    where = {}
    for gi, grp in enumerate(groups):
        for v in grp.nodes:
            where[v] = gi
    for grp in groups:
        inside = set(grp.nodes)
        for a in inside:
            for y in desc[a] - inside:   # path leaves the group at y ...
                if desc[y] & inside:     # ... and comes back: non-convex
                    return False
    edges = {gi: set() for gi in range(len(groups))}
    indeg = [0] * len(groups)
    for v, ps in enumerate(producers):
        for p in ps:
            a, b = where[p], where[v]
            if a != b and b not in edges[a]:
                edges[a].add(b)
                indeg[b] += 1
    ready = [gi for gi in range(len(groups)) if indeg[gi] == 0]
    seen = 0
    while ready:
        gi = ready.pop()
        seen += 1
        for b in edges[gi]:
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    return seen == len(groups)


def _brute_force(producers, candidates, costs, epsilon, cover_cost=None):
    """Cheapest feasible cover; ``cover_cost(groups)`` prices one (default: additive)."""
    n = len(producers)
    finite = [c for c in candidates if costs[c] + epsilon[c.backend] < INF]
    best = INF
    if cover_cost is None:
        def cover_cost(chosen):
            return sum(costs[c] + epsilon[c.backend] for c in chosen)

    def rec(covered, chosen):
        nonlocal best
        if len(covered) == n:
            if _feasible(producers, chosen):
                best = min(best, cover_cost(chosen))
            return
        v = min(set(range(n)) - covered)  # every partition is enumerated exactly once
        for c in finite:
            if v in c.nodes and not (c.nodes & covered):
                rec(covered | c.nodes, chosen + [c])

    rec(frozenset(), [])
    return best


def _check_placement(producers, placement, costs, epsilon):
    """Groups partition the nodes, run in the given order, and the cost adds up."""
    placed = set()
    for grp in placement.groups:
        assert not (grp.nodes & placed), f"{grp} overlaps earlier groups"
        for v in grp.nodes:
            for p in producers[v]:
                assert p in placed or p in grp.nodes, f"{grp} placed before producer {p}"
        placed |= grp.nodes
    assert placed == set(range(len(producers)))
    total = sum(costs[c] + epsilon[c.backend] for c in placement.groups)
    assert math.isclose(placement.cost, total, rel_tol=1e-9, abs_tol=1e-9)
    assert placement.chosen_by == {c: "op-level" for c in placement.groups}


def _random_case(rng):
    n = rng.randint(4, 9)
    producers = []
    for i in range(n):
        if i == 0:
            producers.append([])
            continue
        k = rng.choice([0, 1, 1, 1, 2, 2]) if i > 1 else rng.choice([0, 1])
        producers.append(sorted(rng.sample(range(i), min(k, i))))
    consumers = [[] for _ in range(n)]
    for i, ps in enumerate(producers):
        for p in ps:
            consumers[p].append(i)

    backends = ["tvm", "cutlass", "dnnl"][: rng.randint(2, 3)]
    cands = {Candidate("tvm", frozenset([v]), "tvm.single") for v in range(n)}
    for _ in range(rng.randint(3, 10)):
        # Connected group grown along edges in either direction: often non-convex,
        # and pairs of such groups can form cycles between groups.
        size = rng.randint(2, 4)
        grp = {rng.randrange(n)}
        for _ in range(20):
            if len(grp) == size:
                break
            v = rng.choice(sorted(grp))
            nbrs = producers[v] + consumers[v]
            if nbrs:
                grp.add(rng.choice(nbrs))
        if len(grp) >= 2:
            cands.add(Candidate(rng.choice(backends), frozenset(grp), "grp"))
    for _ in range(rng.randint(0, 3)):
        # Arbitrary (maybe disconnected) sets: more cycle-forming pairs.
        grp = frozenset(rng.sample(range(n), rng.randint(2, min(3, n))))
        cands.add(Candidate(rng.choice(backends), grp, "any"))
    for v in range(n):
        if rng.random() < 0.3:
            cands.add(Candidate(rng.choice(backends[1:]), frozenset([v]), "single"))
    cands = sorted(cands, key=lambda c: (c.backend, sorted(c.nodes)))
    costs = {}
    for c in cands:
        costs[c] = INF if (c.label != "tvm.single" and rng.random() < 0.15) \
            else round(rng.uniform(0.1, 3.0) * len(c.nodes) ** 0.7, 3)
    epsilon = {b: round(rng.uniform(0.0, 0.5), 3) for b in backends}
    return producers, cands, costs, epsilon


# ---------------------------------------------------------------- tests

# 908 and 2142 caught an unsound pruning (group-graph ancestry via an intermediate group).
@pytest.mark.parametrize("seed", [*range(200), 908, 2142])
def test_dp_matches_brute_force_on_random_dags(seed):
    rng = random.Random(seed)
    producers, cands, costs, epsilon = _random_case(rng)
    expected = _brute_force(producers, cands, costs, epsilon)
    assert expected < INF  # tvm singles always give a feasible cover
    # Pass costs both ways: as a dict and as a list parallel to the candidates.
    got = place(producers, cands, costs, epsilon)
    got_list = place(producers, cands, [costs[c] for c in cands], epsilon)
    for p in (got, got_list):
        assert math.isclose(p.cost, expected, rel_tol=1e-9, abs_tol=1e-9), (p, expected)
        _check_placement(producers, p, costs, epsilon)
        assert _feasible(producers, p.groups)


def test_non_convex_group_is_excluded():
    # 0 -> 1 -> 2 and 0 -> 2: {0, 2} is non-convex (path 0 -> 1 -> 2 leaves and re-enters).
    producers = [[], [0], [0, 1]]
    bad = Candidate("cutlass", frozenset([0, 2]))
    cands = [Candidate("tvm", frozenset([v])) for v in range(3)] + [bad]
    costs = {c: 1.0 for c in cands}
    costs[bad] = 0.01
    p = place(producers, cands, costs, {"tvm": 0.0, "cutlass": 0.0})
    assert bad not in p.groups
    assert math.isclose(p.cost, 3.0)


def test_cyclic_groups_are_excluded():
    # 2 and 3 both read 0 and 1. {0,3} and {1,2} are each convex, but {0,3} needs 1
    # (from {1,2}) and {1,2} needs 0 (from {0,3}): a cycle between groups.
    producers = [[], [], [0, 1], [0, 1]]
    a = Candidate("cutlass", frozenset([0, 3]))
    b = Candidate("cutlass", frozenset([1, 2]))
    singles = [Candidate("tvm", frozenset([v])) for v in range(4)]
    costs = {c: 1.0 for c in singles}
    costs[a] = costs[b] = 0.1
    eps = {"tvm": 0.0, "cutlass": 0.0}
    p = place(producers, singles + [a, b], costs, eps)
    assert not (a in p.groups and b in p.groups)
    assert math.isclose(p.cost, 2.1)  # one of them plus two singles
    _check_placement(producers, p, costs, eps)
    with pytest.raises(ValueError, match="no valid placement"):
        place(producers, [a, b], costs, eps)


def test_indirect_ancestor_group_is_tried_first():
    # Best plan: {1}, then {2,3}, then {0,4}. The group {0,4} holding the smallest
    # node 0 needs {2,3} (via 3 -> 4), which needs {1} (via 1 -> 2), yet node 1 has
    # no path to {0,4}: the search must follow ancestry through the group {2,3}.
    producers = [[], [], [1], [], [0, 3]]
    one, mid, head = (Candidate("dnnl", frozenset(s)) for s in ([1], [2, 3], [0, 4]))
    singles = [Candidate("tvm", frozenset([v])) for v in range(5)]
    costs = {c: 10.0 for c in singles}
    costs.update({one: 1.0, mid: 1.0, head: 1.0})
    eps = {"tvm": 0.0, "dnnl": 0.0}
    p = place(producers, singles + [one, mid, head], costs, eps)
    assert p.groups == [one, mid, head] and math.isclose(p.cost, 3.0)


def test_node_with_only_infinite_candidates_raises():
    producers = [[], [0], [1]]
    cands = [Candidate("tvm", frozenset([0])), Candidate("tvm", frozenset([1])),
             Candidate("tvm", frozenset([2])), Candidate("dnnl", frozenset([1, 2]))]
    costs = {cands[0]: 1.0, cands[1]: INF, cands[2]: 1.0, cands[3]: INF}
    with pytest.raises(ValueError, match=r"\[1\]"):
        place(producers, cands, costs, {"tvm": 0.0, "dnnl": 0.0})


def test_epsilon_changes_the_decision():
    producers = [[], [0], [1]]
    singles = [Candidate("tvm", frozenset([v]), "tvm.single") for v in range(3)]
    fused = Candidate("tvm", frozenset([0, 1, 2]), "tvm.fused")
    cands = singles + [fused]
    costs = {c: 1.0 for c in singles}
    costs[fused] = 3.1  # 0.1 ms dearer than three singles
    p0 = place(producers, cands, costs, {"tvm": 0.0})
    assert set(p0.groups) == set(singles) and math.isclose(p0.cost, 3.0)
    # Three kernels pay epsilon three times, one fused kernel pays it once.
    p1 = place(producers, cands, costs, {"tvm": 0.06})
    assert p1.groups == [fused] and math.isclose(p1.cost, 3.16)


def test_groups_are_in_execution_order():
    # Diamond with a side branch; the cheap fused group {1, 3} needs 2 placed first.
    producers = [[], [0], [0], [1, 2], [3], [0]]
    singles = [Candidate("tvm", frozenset([v])) for v in range(6)]
    fused = Candidate("dnnl", frozenset([1, 3]))
    tail = Candidate("cutlass", frozenset([4]))
    cands = singles + [fused, tail]
    costs = {c: 1.0 for c in singles}
    costs[fused] = 0.5
    costs[tail] = 0.2
    eps = {"tvm": 0.0, "dnnl": 0.0, "cutlass": 0.0}
    p = place(producers, cands, costs, eps)
    assert fused in p.groups and tail in p.groups
    order = p.groups
    assert order.index(singles[2]) < order.index(fused) < order.index(tail)
    _check_placement(producers, p, costs, eps)


def test_fallback_when_state_budget_exceeded(caplog):
    rng = random.Random(7)
    producers, cands, costs, epsilon = _random_case(rng)
    with caplog.at_level(logging.WARNING, logger="collage_tvm"):
        p = place(producers, cands, costs, epsilon, max_states=1)
    assert any("max_states" in r.message for r in caplog.records)
    _check_placement(producers, p, costs, epsilon)


def _chain_like(n, rng):
    """Mostly a chain with residual skips, like a ResNet body."""
    producers = [[]]
    for i in range(1, n):
        ps = [i - 1]
        if i >= 3 and rng.random() < 0.15:
            ps.append(i - rng.randint(2, 3))
        producers.append(sorted(ps))
    backends = ["tvm", "cutlass", "dnnl"]
    cands = []
    for i in range(n):
        cands.append(Candidate("tvm", frozenset([i])))
        cands.append(Candidate(rng.choice(backends[1:]), frozenset([i])))
        for length in (2, 3, 4):
            if i + length <= n:
                cands.append(Candidate(rng.choice(backends),
                                       frozenset(range(i, i + length))))
    cands = list(dict.fromkeys(cands))
    costs = {c: (INF if rng.random() < 0.1 and len(c.nodes) > 1
                 else rng.uniform(0.05, 1.0) * len(c.nodes) ** 0.8) for c in cands}
    eps = {"tvm": 0.01, "cutlass": 0.02, "dnnl": 0.015}
    return producers, cands, costs, eps


def test_speed_sanity_300_node_chain_like_graph():
    rng = random.Random(0)
    producers, cands, costs, eps = _chain_like(300, rng)
    assert len(cands) / 300 > 4
    seen = []
    p = place(producers, cands, costs, eps, progress=seen.append)
    _check_placement(producers, p, costs, eps)
    print(f"300-node chain-like graph: {len(cands)} candidates, "
          f"{seen[-1]} states expanded, cost {p.cost:.4f}")


def test_empty_graph():
    p = place([], [], {}, {})
    assert p.groups == [] and p.cost == 0.0


# ---------------------------------------------------------------- switching costs

def _sequence_cost(groups, costs, epsilon, switch):
    total, last = 0.0, None
    for c in groups:
        total += costs[c] + epsilon[c.backend]
        if last is not None:
            total += switch.get((last, c.backend), switch.get((c.backend, last), 0.0))
        last = c.backend
    return total


def _best_order_cost(producers, groups, costs, epsilon, switch):
    """Cheapest sequence cost over every execution order of ``groups`` (memoised over
    (groups done, last group); independent of the placer's search)."""
    from functools import lru_cache

    where = {v: gi for gi, grp in enumerate(groups) for v in grp.nodes}
    needs = [0] * len(groups)
    for v, ps in enumerate(producers):
        for p in ps:
            if where[p] != where[v]:
                needs[where[v]] |= 1 << where[p]
    full = (1 << len(groups)) - 1

    @lru_cache(maxsize=None)
    def rest(done, last):
        if done == full:
            return 0.0
        best = INF
        for i, grp in enumerate(groups):
            if not (done >> i) & 1 and needs[i] & ~done == 0:
                step = _sequence_cost([groups[last], grp] if last >= 0 else [grp],
                                      costs, epsilon, switch)
                if last >= 0:
                    step -= costs[groups[last]] + epsilon[groups[last].backend]
                best = min(best, step + rest(done | (1 << i), i))
        return best

    return rest(0, -1)


def _brute_force_sequence(producers, candidates, costs, epsilon, switch):
    return _brute_force(producers, candidates, costs, epsilon, lambda chosen: _best_order_cost(
        producers, chosen, costs, epsilon, switch))


@pytest.mark.parametrize("seed", range(120))
def test_dp_with_switching_costs_matches_brute_force_over_orders(seed):
    rng = random.Random(1000 + seed)
    producers, cands, costs, epsilon = _random_case(rng)
    backends = sorted({c.backend for c in cands})
    switch = {(a, b): round(rng.uniform(0.0, 1.5), 3)
              for a in backends for b in backends if a < b}
    if rng.random() < 0.5:  # asymmetric pairs too
        switch.update({(b, a): round(rng.uniform(0.0, 1.5), 3) for (a, b) in list(switch)})
    if rng.random() < 0.5:  # a library whose consecutive kernels pay too (graph libraries)
        b = rng.choice(backends)
        switch[(b, b)] = round(rng.uniform(0.0, 1.0), 3)
    expected = _brute_force_sequence(producers, cands, costs, epsilon, switch)
    got = place(producers, cands, costs, epsilon, switch=switch)
    assert math.isclose(got.cost, expected, rel_tol=1e-9, abs_tol=1e-9), (got, expected)
    # The returned order is executable and its sequence cost is the reported cost.
    placed = set()
    for grp in got.groups:
        assert all(p in placed or p in grp.nodes for v in grp.nodes for p in producers[v])
        placed |= grp.nodes
    assert placed == set(range(len(producers)))
    assert math.isclose(_sequence_cost(got.groups, costs, epsilon, switch), got.cost,
                        rel_tol=1e-9, abs_tol=1e-9)


def test_switching_cost_keeps_a_backend_across_a_cheap_foreign_op():
    # dnnl conv -> relu -> dnnl conv: the relu is cheapest on tvm in isolation, but two
    # switches cost more than running it on dnnl (the ReLU-on-TVM case seen on ResNet-50).
    producers = [[], [0], [1]]
    conv0, conv2 = Candidate("dnnl", frozenset([0])), Candidate("dnnl", frozenset([2]))
    relu_tvm, relu_dnnl = Candidate("tvm", frozenset([1])), Candidate("dnnl", frozenset([1]))
    cands = [conv0, conv2, relu_tvm, relu_dnnl, Candidate("tvm", frozenset([0])),
             Candidate("tvm", frozenset([2]))]
    costs = {c: 10.0 for c in cands}
    costs.update({conv0: 1.0, conv2: 1.0, relu_tvm: 0.05, relu_dnnl: 0.1})
    eps = {"tvm": 0.0, "dnnl": 0.0}
    assert relu_tvm in place(producers, cands, costs, eps).groups
    p = place(producers, cands, costs, eps, switch={("dnnl", "tvm"): 0.2})
    assert p.groups == [conv0, relu_dnnl, conv2] and math.isclose(p.cost, 2.1)


def test_switching_cost_orders_parallel_branches_by_backend():
    # Two branches a0 -> a1 and b0 -> b1 off one input; a* cheapest on x, b* on y.
    # The additive pruning would place a0, then (holding the smallest node) interleave;
    # with a switching cost the order x, x, y, y pays one switch.
    producers = [[], [0], [0], [1], [2], [3, 4]]
    x = {v: Candidate("x", frozenset([v])) for v in (0, 1, 3, 5)}
    y = {v: Candidate("y", frozenset([v])) for v in (2, 4)}
    cands = list(x.values()) + list(y.values())
    costs = {c: 1.0 for c in cands}
    eps = {"x": 0.0, "y": 0.0}
    p = place(producers, cands, costs, eps, switch={("x", "y"): 0.5})
    # x0 then the y branch or the x branch as a block: two switches at best (x..y..x).
    assert math.isclose(p.cost, 6.0 + 2 * 0.5)
    backends = [g.backend for g in p.groups]
    assert sum(a != b for a, b in zip(backends, backends[1:])) == 2


def test_speed_sanity_300_node_chain_like_graph_with_switching_costs():
    rng = random.Random(0)
    producers, cands, costs, eps = _chain_like(300, rng)
    switch = {("tvm", "dnnl"): 0.05, ("tvm", "cutlass"): 0.03, ("cutlass", "dnnl"): 0.2}
    seen = []
    p = place(producers, cands, costs, eps, progress=seen.append, switch=switch)
    assert math.isclose(_sequence_cost(p.groups, costs, eps, switch), p.cost, rel_tol=1e-9)
    additive = place(producers, cands, costs, eps)
    assert p.cost <= _sequence_cost(additive.groups, costs, eps, switch) + 1e-9
    print(f"with switching costs: {seen[-1]} states expanded, cost {p.cost:.4f}")


def test_switching_search_falls_back_to_the_pruned_search_on_a_small_budget(caplog):
    rng = random.Random(7)
    producers, cands, costs, epsilon = _random_case(rng)
    switch = {("tvm", "cutlass"): 0.3, ("tvm", "dnnl"): 0.2, ("cutlass", "dnnl"): 0.1}
    with caplog.at_level(logging.WARNING, logger="collage_tvm"):
        p = place(producers, cands, costs, epsilon, switch=switch, max_states=10)
    assert any("ready search passed" in r.message for r in caplog.records)
    placed = set()
    for grp in p.groups:
        assert all(q in placed or q in grp.nodes for v in grp.nodes for q in producers[v])
        placed |= grp.nodes
    assert placed == set(range(len(producers)))
    assert math.isclose(_sequence_cost(p.groups, costs, epsilon, switch), p.cost, rel_tol=1e-9)


def test_restricted_search_only_when_not_exact_and_flagged():
    rng = random.Random(11)
    producers, cands, costs, epsilon = _random_case(rng)
    full = place(producers, cands, costs, epsilon)
    assert full.exact
    quick = place(producers, cands, costs, epsilon, exact=False)
    assert not quick.exact
    _check_placement(producers, quick, costs, epsilon)
    assert quick.cost >= full.cost - 1e-9  # the exact search is the optimum
    fallback = place(producers, cands, costs, epsilon, max_states=1)
    assert not fallback.exact


def test_wide_graph_with_switching_costs_falls_back_quickly_and_stays_valid():
    """Parallel branches (NASNet-like cells) explode the exact switching search's states
    (every interleaving of the branches); the fallback still returns a valid order."""
    rng = random.Random(3)
    producers, cands = [[]], []
    backends = ["tvm", "dnnl", "onnxruntime"]
    for cell in range(4):
        root = len(producers) - 1
        tails = []
        for _ in range(5):
            prev = root
            for _ in range(4):
                producers.append([prev])
                prev = len(producers) - 1
            tails.append(prev)
        producers.append(sorted(tails))
    n = len(producers)
    for v in range(n):
        for b in backends:
            cands.append(Candidate(b, frozenset([v])))
        if producers[v] and len(producers[v]) == 1:
            cands.append(Candidate("dnnl", frozenset([producers[v][0], v])))
    costs = {c: rng.uniform(0.1, 1.0) * len(c.nodes) for c in cands}
    eps = {b: 0.01 for b in backends}
    switch = {("tvm", "dnnl"): 0.05, ("dnnl", "onnxruntime"): 0.2, ("tvm", "onnxruntime"): 0.1,
              ("onnxruntime", "onnxruntime"): 0.02}
    p = place(producers, cands, costs, eps, switch=switch, max_states=2000)
    assert not p.exact
    placed = set()
    for grp in p.groups:
        assert all(q in placed or q in grp.nodes for v in grp.nodes for q in producers[v])
        placed |= grp.nodes
    assert placed == set(range(n))
    assert math.isclose(_sequence_cost(p.groups, costs, eps, switch), p.cost, rel_tol=1e-9)
