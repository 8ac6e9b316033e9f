"""Op-level placer: exact DP over frontiers (Collage paper, Algorithm 1, Eq. 2-4).

Given a DAG of ``n`` nodes in topological order, a list of candidates (a backend
plus a set of nodes), a compute cost per candidate and a per-backend call overhead
``epsilon`` (ms per kernel), choose candidates that cover every node exactly once,
can be executed in some order, and minimise

    sum(cost[c] + epsilon[c.backend])                               (Eq. 2-4)

The DP state is the set of nodes already placed, held as a Python int bitmask.
Every state is downward-closed (it holds all producers of its nodes), so placing a
candidate ``c`` at state ``S`` is legal iff ``c`` is disjoint from ``S`` and *ready*:
every producer of every node of ``c`` is in ``S`` or in ``c``. Readiness alone rules
out non-convex groups (a path that leaves ``c`` and re-enters it runs through an
unplaced node outside ``c``) and cycles between groups (a sequence of ready
placements *is* an execution order).

Rather than the paper's recursion from the full graph, the DP runs forwards from
the empty state as an A* search over states: edge weights are
``cost + epsilon`` and the heuristic ``h(S) = sum over unplaced v of lb[v]``, with
``lb[v] = min over candidates c containing v of w(c) / |c|``. Any completion pays
at least ``h`` (split each group's weight evenly over its nodes) and
``h(S) - h(S | c) <= w(c)`` for every edge, so ``h`` is consistent: the first time a
state is popped its cost is optimal and the search is exact.

Switch costs (``switch``): a kernel of backend ``b`` that runs right after
one of backend ``a`` pays ``switch[a, b]`` more (thread pools of two runtimes waking,
spinning against each other; ``switch[a, a]``: two sessions of one graph library, each
with its own state; measured by ``Measurer.switch_costs``). The cost
then depends on the execution order, so the state becomes (placed nodes, backend of
the last kernel), every ready candidate is tried (not only those the additive pruning
keeps: placing a non-ancestor group earlier can save a switch), and the path found is
the execution order the build uses. Weights stay >= the additive ones, so ``h`` stays
consistent and the search stays exact for this sequence cost.
"""
from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass, field
from typing import Callable

from ..placement import Candidate, Placement

log = logging.getLogger("collage_tvm")

_PROGRESS_EVERY = 10_000


def pair_cost(switch: dict | None, a: str, b: str) -> float:
    """What ``place`` charges for a ``b`` kernel right after an ``a`` kernel."""
    if not switch:
        return 0.0
    v = switch.get((a, b), switch.get((b, a), 0.0))
    return float(v) if v > 0 and math.isfinite(v) else 0.0


def ensure_cover(n_nodes: int, candidates: list, costs: dict, fallback: str = "tvm") -> tuple:
    """A finite cover exists, by construction: every node no finite-cost candidate covers
    gets its single-node ``fallback`` candidate (TVM, which compiles whatever the frontend
    emitted) at cost 0. Such a node could not be timed alone (a symbolic shape, an input no
    random array fits); it stays where TVM alone would run it. Returns (costs, the nodes)."""
    covered = set()
    for c in candidates:
        if math.isfinite(costs.get(c, math.inf)):
            covered |= c.nodes
    missing = [i for i in range(n_nodes) if i not in covered]
    if not missing:
        return costs, []
    costs = dict(costs)
    singles = {min(c.nodes): c for c in candidates if c.backend == fallback and len(c.nodes) == 1}
    for i in missing:
        if i not in singles:
            raise ValueError(f"node {i} has no single-node {fallback} candidate: the {fallback} "
                             "pattern rule must accept every node")
        costs[singles[i]] = 0.0
    return costs, missing


@dataclass
class _Dag:
    """The graph as bitmasks: node ``i`` is bit ``i``."""

    n: int
    producers: list[int]          # bitmask of the nodes node i reads
    consumers: list[list[int]]    # nodes reading node i
    descendants: list[int]        # bitmask of every node reachable from node i
    roots: int                    # bitmask of the nodes reading no node


def _dag(producers: list[list[int]]) -> _Dag:
    """Bitmasks of ``producers``; nodes must be in topological order (that is what makes
    "the smallest unplaced node" a frontier node)."""
    n = len(producers)
    prod_mask = [0] * n
    consumers: list[list[int]] = [[] for _ in range(n)]
    for i, ps in enumerate(producers):
        for p in ps:
            if not 0 <= p < i:
                raise ValueError(f"node {i}: producer {p} is not an earlier node "
                                 "(nodes must be in topological order)")
            prod_mask[i] |= 1 << p
            consumers[p].append(i)
    desc = [0] * n
    for i in range(n - 1, -1, -1):   # reverse topological sweep
        for j in consumers[i]:
            desc[i] |= (1 << j) | desc[j]
    roots = sum(1 << v for v in range(n) if not prod_mask[v])
    return _Dag(n, prod_mask, consumers, desc, roots)


@dataclass
class _SwitchCosts:
    """Backends as small ints and the switch cost of a kernel right after another (row: the
    previous kernel's backend; the extra last row is "no kernel yet", free)."""

    names: list[str]
    index: dict[str, int]
    matrix: list[list[float]]
    on: bool                      # any positive entry: the cost depends on the order


def _switch_costs(candidates: list[Candidate], switch: dict | None) -> _SwitchCosts:
    names = sorted({c.backend for c in candidates})
    index = {b: i for i, b in enumerate(names)}
    matrix = [[0.0] * len(names) for _ in range(len(names) + 1)]
    for a in names:
        for b in names:
            matrix[index[a]][index[b]] = pair_cost(switch, a, b)
    return _SwitchCosts(names, index, matrix, any(v > 0 for row in matrix for v in row))


def _weights(candidates: list[Candidate], costs, overhead: dict[str, float]) -> list[float]:
    """Eq. 2-4's weight of each candidate: its cost plus its backend's call overhead
    (``epsilon``)."""
    if isinstance(costs, dict):
        cost_list = [costs.get(c, math.inf) for c in candidates]
    else:
        cost_list = list(costs)
        if len(cost_list) != len(candidates):
            raise ValueError(
                f"costs has {len(cost_list)} entries for {len(candidates)} candidates")
    return [float(cost) + float(overhead.get(c.backend, 0.0))
            for c, cost in zip(candidates, cost_list)]


def _cheapest(candidates: list[Candidate], weights: list[float], n: int,
              per_backend: bool) -> dict:
    """The cheapest finite candidate per node set (per node set and backend when the order
    matters): a dearer one can always be swapped for it. Key -> (weight, candidate index)."""
    best: dict = {}
    for k, c in enumerate(candidates):
        w = weights[k]
        if math.isnan(w) or math.isinf(w) or not c.nodes:
            continue
        mask = 0
        for v in c.nodes:
            if not 0 <= v < n:
                raise ValueError(f"candidate {c!r} names node {v}, graph has {n} nodes")
            mask |= 1 << v
        key = (mask, c.backend) if per_backend else mask
        if key not in best or w < best[key][0]:
            best[key] = (w, k)
    return best


@dataclass
class _Kernels:
    """The candidates worth trying, as flat arrays indexed by kernel id."""

    mask: list[int] = field(default_factory=list)       # its nodes
    external: list[int] = field(default_factory=list)   # producers outside: ready at S iff
    #                                                     external & ~S == 0
    descendants: list[int] = field(default_factory=list)  # nodes outside reachable from it
    weight: list[float] = field(default_factory=list)
    size: list[int] = field(default_factory=list)
    original: list[int] = field(default_factory=list)   # index into the caller's candidates
    backend: list[int] = field(default_factory=list)    # _SwitchCosts.index of its backend
    by_node: list[list[int]] = field(default_factory=list)  # kernels holding node v
    by_min: list[list[int]] = field(default_factory=list)   # kernels whose smallest node is v
    reduced: list[float] = field(default_factory=list)  # weight less the heuristic's drop


def _kernels(dag: _Dag, candidates: list[Candidate], best: dict, sw: _SwitchCosts) -> _Kernels:
    t = _Kernels(by_node=[[] for _ in range(dag.n)], by_min=[[] for _ in range(dag.n)])
    for w, k in best.values():
        nodes = sorted(candidates[k].nodes)
        mask = sum(1 << v for v in candidates[k].nodes)
        ext = dsc = 0
        for v in nodes:
            ext |= dag.producers[v]
            dsc |= dag.descendants[v]
        kid = len(t.mask)
        t.mask.append(mask)
        t.external.append(ext & ~mask)
        t.descendants.append(dsc & ~mask)
        t.weight.append(w)
        t.size.append(len(nodes))
        t.original.append(k)
        t.backend.append(sw.index[candidates[k].backend])
        for v in nodes:
            t.by_node[v].append(kid)
        t.by_min[nodes[0]].append(kid)
    uncovered = [v for v in range(dag.n) if not t.by_node[v]]
    if uncovered:
        raise ValueError(f"no finite-cost candidate covers node(s) {uncovered}; "
                         "no valid placement exists")
    return t


def _heuristic(t: _Kernels, candidates: list[Candidate], n: int) -> float:
    """A*'s heuristic: ``lb[v]``, the least share of a group's weight node ``v`` can carry;
    ``h(S)`` sums it over the unplaced nodes. Fills ``t.reduced`` (the edge weight less
    ``h(S) - h(S|c)``, >= 0 by consistency; rounding clamped) and returns ``h(empty)``."""
    lb = [min(t.weight[c] / t.size[c] for c in t.by_node[v]) for v in range(n)]
    t.reduced = [max(0.0, t.weight[c] - math.fsum(lb[v] for v in candidates[t.original[c]].nodes))
                 for c in range(len(t.mask))]
    return math.fsum(lb)


@dataclass
class _Outcome:
    found: int | None             # the full state reached, None if the search gave up
    g: dict                       # state -> cost of the cheapest path found to it
    parent: dict                  # state -> (previous state, kernel) | None
    expanded: int
    stuck: tuple                  # (placed count, smallest unplaced node) of the deepest dead end


class _AStar:
    """Algorithm 1 run forwards as A* over placed-node states (see the module docstring).

    A state is one int: the placed-node mask shifted left by ``kb`` bits that hold the
    backend of the last kernel (``kb == 0`` when the order costs nothing)."""

    def __init__(self, dag: _Dag, t: _Kernels, sw: _SwitchCosts, h0: float, progress):
        self.dag, self.t, self.sw, self.h0, self.progress = dag, t, sw, h0, progress
        self.kb = len(sw.names).bit_length() if sw.on else 0
        self.start = len(sw.names) if sw.on else 0
        self.full = (1 << dag.n) - 1

    def run(self, mode: str, limit: int | None) -> _Outcome:
        """``mode``: "ready" (every ready kernel: exact with switch costs), "pruned"
        (kernels holding u or ready ancestors of its group: exact for the additive cost),
        "restricted" (kernels holding u only). Gives up after ``limit`` expansions."""
        kb, seq, progress, successors = self.kb, self.sw.on, self.progress, self._successors
        mask, backend, weight, reduced, size = (self.t.mask, self.t.backend, self.t.weight,
                                                self.t.reduced, self.t.size)
        out = _Outcome(None, {self.start: 0.0}, {self.start: None}, 0, (-1, 0))
        self.ready_of = {0: self.dag.roots}  # mask -> unplaced nodes whose producers are placed
        closed: set[int] = set()
        heap = [(self.h0, 0, 0, self.start)]  # (f = g + h, -placed count, tie, state)
        counter = 1
        while heap:
            f, negpop, _, st = heapq.heappop(heap)
            if st in closed:
                continue  # stale heap entry; a cheaper path already closed it
            closed.add(st)
            s = st >> kb
            if s == self.full:
                out.found = st
                return out
            out.expanded += 1
            if limit is not None and out.expanded > limit:
                return out
            if progress is not None and out.expanded % _PROGRESS_EVERY == 0:
                progress(out.expanded)
            free = ~s
            u = (free & -free).bit_length() - 1  # smallest unplaced node; a frontier node
            succ = successors(mode, s, free, u)
            if not succ and -negpop > out.stuck[0]:
                out.stuck = (-negpop, u)
            gs = out.g[st]
            row = self.sw.matrix[st & ((1 << kb) - 1)] if seq else None
            for c in succ:
                s2 = s | mask[c]
                st2 = (s2 << kb) | backend[c] if seq else s2
                if st2 in closed:
                    continue
                sw = row[backend[c]] if seq else 0.0
                g2 = gs + weight[c] + sw
                if g2 < out.g.get(st2, math.inf):
                    out.g[st2] = g2
                    out.parent[st2] = (st, c)
                    if seq and s2 not in self.ready_of:
                        self.ready_of[s2] = self._newly_ready(self.ready_of[s], s2, mask[c])
                    heapq.heappush(heap, (f + reduced[c] + sw, negpop - size[c], counter, st2))
                    counter += 1
        return out

    def _successors(self, mode: str, s: int, free: int, u: int) -> list[int]:
        """The kernels to try at state ``s`` (``u``: its smallest unplaced node); empty when
        ``u`` can no longer be covered (a dead state)."""
        t = self.t
        mask, external = t.mask, t.external
        succ = []
        reach_u = 0  # union of the still-possible groups that could hold u
        for c in t.by_node[u]:
            if mask[c] & s:
                continue
            reach_u |= mask[c]
            if external[c] & free == 0 and mode != "ready":
                succ.append(c)
        if not reach_u:
            return []
        if mode == "ready":
            # Every ready kernel: its smallest node is a ready node.
            ready = self.ready_of[s]
            while ready:
                v = (ready & -ready).bit_length() - 1
                ready &= ready - 1
                succ.extend(c for c in t.by_min[v] if not mask[c] & s and not external[c] & free)
        elif mode == "pruned":
            succ.extend(self._ready_ancestors(s, free, u, reach_u))
        return succ

    def _ready_ancestors(self, s: int, free: int, u: int, x: int) -> list[int]:
        """Exactness-preserving pruning: any execution order of a solution can be rewritten
        to place G_u (the group holding u) as soon as it is ready and otherwise a ready
        group-graph ancestor of G_u, so besides kernels holding u only ready kernels that
        may be such an ancestor are tried. Ancestry can hop between nodes of an intermediate
        group, so take the fixpoint: x = nodes of kernels that hold u or reach x. A kernel
        reaching x has its min node below max(x): scan only min nodes in (u, max(x))."""
        t = self.t
        mask, by_min, descendants, external = t.mask, t.by_min, t.descendants, t.external
        hi = x.bit_length() - 1
        scanned = u + 1
        pool: list[int] = []
        found = []
        grew = True
        while grew:
            for m in range(scanned, hi):
                if not (s >> m) & 1:
                    pool.extend(c for c in by_min[m] if not mask[c] & s)
            scanned = max(scanned, hi)
            grew = False
            rest = []
            for c in pool:
                if descendants[c] & x:
                    x |= mask[c]
                    grew = True
                    if external[c] & free == 0:
                        found.append(c)
                else:
                    rest.append(c)
            pool = rest
            hi = x.bit_length() - 1
        return found

    def _newly_ready(self, ready: int, s2: int, cm: int) -> int:
        """The ready nodes after placing the nodes ``cm`` (state ``s2``)."""
        dag = self.dag
        ready &= ~cm
        m = cm
        while m:
            x = (m & -m).bit_length() - 1
            m &= m - 1
            for y in dag.consumers[x]:
                if not (s2 >> y) & 1 and not dag.producers[y] & ~s2:
                    ready |= 1 << y
        return ready


def _modes(sequence: bool, max_states: int, exact: bool) -> list[tuple[str, int | None]]:
    """The searches to try in turn, each with its state budget. With switch costs the
    exact search tries every ready kernel, which on wide graphs (NASNet-A cells: 814 nodes,
    6650 candidates) passes millions of states: then the additive pruning (still charging
    switches) on a quarter of that budget, then the restricted search (NASNet-A: 12k
    states, 0.3 s; within 0.3-1.4% of the exact cost on the zoo's models where both
    finish). ``exact=False`` goes straight to the restricted one."""
    limit = max(1, max_states // 10) if sequence else max(1, max_states)
    modes = ([("ready", limit), ("pruned", max(1, limit // 4))] if sequence else
             [("pruned", limit)]) + [("restricted", None)]
    return modes if exact else modes[-1:]


def _path(out: _Outcome) -> list[int]:
    """The kernels from the empty state to the full one: an execution order."""
    chosen: list[int] = []
    st = out.found
    while out.parent[st] is not None:
        st, c = out.parent[st]
        chosen.append(c)
    return chosen[::-1]


def place(
    producers: list[list[int]],
    candidates: list[Candidate],
    costs: dict[Candidate, float] | list[float],
    epsilon: dict[str, float],
    progress: Callable[[int], None] | None = None,
    max_states: int = 2_000_000,
    switch: dict[tuple[str, str], float] | None = None,
    exact: bool = True,
) -> Placement:
    """Find the cheapest executable cover of the graph by ``candidates``.

    ``producers[i]``: indices of the nodes node ``i`` reads (all ``< i``).
    ``costs``: dict keyed by candidate (a missing key counts as ``inf``) or a list
    parallel to ``candidates``. Candidates of infinite or NaN cost are ignored.
    ``epsilon``: per-backend call overhead (the paper's epsilon), added once per chosen
    candidate (a backend missing from the dict costs 0).
    ``progress``: called with the number of expanded states every ~10000 states
    and once at the end.
    ``max_states``: if the exact search expands more states than this (with switch
    costs: a tenth of it, then the additive pruning on a fortieth), it is abandoned for a
    restricted search that only tries candidates containing the smallest unplaced node
    (not exact; a warning is logged; ``Placement.exact`` is False).
    ``exact``: False runs the restricted search only (for re-runs on a graph known to be
    too wide for the exact search).
    ``switch``: ``(a, b) -> ms``, the switch cost of a ``b`` kernel right after an ``a`` kernel,
    ``a == b`` allowed (``(b, a)`` is used when ``(a, b)`` is missing; 0 for absent pairs).

    Returns the groups in execution order. Raises ``ValueError`` if some node has no
    finite candidate or if no executable cover exists.
    """
    dag = _dag(producers)
    if dag.n == 0:
        return Placement(groups=[], cost=0.0, chosen_by={})
    weights = _weights(candidates, costs, epsilon)
    sw = _switch_costs(candidates, switch)
    t = _kernels(dag, candidates, _cheapest(candidates, weights, dag.n, sw.on), sw)
    astar = _AStar(dag, t, sw, _heuristic(t, candidates, dag.n), progress)
    modes = _modes(sw.on, max_states, exact)
    expanded = 0
    for i, (mode, limit) in enumerate(modes):
        out = astar.run(mode, limit)
        expanded += out.expanded
        if out.found is not None or limit is None or out.expanded <= limit:
            break
        log.warning(
            "op-level placer: %s search passed %d states (max_states=%d) on %d nodes / %d "
            "candidates; falling back to a %s search (result may be suboptimal)", mode, limit,
            max_states, dag.n, len(t.mask), modes[i + 1][0])
    if progress is not None:
        progress(expanded)
    if out.found is None:
        raise ValueError(f"no valid placement: search got stuck at node {out.stuck[1]} "
                         "(no executable cover of the graph by the finite-cost candidates)")
    groups = [candidates[t.original[c]] for c in _path(out)]
    total = out.g[out.found]
    log.debug("op-level placer: %d nodes, %d candidates, %d states expanded, cost %.6g ms%s",
              dag.n, len(t.mask), expanded, total, " (with switch costs)" if sw.on else "")
    return Placement(groups=groups, cost=total, chosen_by={c: "op-level" for c in groups},
                     exact=exact and i == 0)
