"""Op-level placer: exact DP over frontiers (Collage paper, Algorithm 1, Eq. 2-4).

Given a DAG of ``n`` nodes in topological order, a list of candidates (a backend
plus a set of nodes), a compute cost per candidate and a per-backend switching
cost ``epsilon`` (ms per kernel), choose candidates that cover every node exactly
once, can be executed in some order, and minimise

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

Context-aware switching (``switch``): a kernel of backend ``b`` that runs right after
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
    ``epsilon``: per-backend switching cost added once per chosen candidate
    (a backend missing from the dict costs 0).
    ``progress``: called with the number of expanded states every ~10000 states
    and once at the end.
    ``max_states``: if the exact search expands more states than this (with switching
    costs: a tenth of it, then the additive pruning on a fortieth), it is abandoned for a
    restricted search that only tries candidates containing the smallest unplaced node
    (not exact; a warning is logged; ``Placement.exact`` is False).
    ``exact``: False runs the restricted search only (for re-runs on a graph known to be
    too wide for the exact search).
    ``switch``: ``(a, b) -> ms`` extra cost of a ``b`` kernel right after an ``a`` kernel,
    ``a == b`` allowed (``(b, a)`` is used when ``(a, b)`` is missing; 0 for absent pairs).

    Returns the groups in execution order. Raises ``ValueError`` if some node has no
    finite candidate or if no executable cover exists.
    """
    n = len(producers)
    if n == 0:
        return Placement(groups=[], cost=0.0, chosen_by={})

    # Producer bitmask per node; topological order is what makes "smallest
    # unplaced node" a frontier node, so enforce it.
    prod_mask = [0] * n
    consumers: list[list[int]] = [[] for _ in range(n)]
    for i, ps in enumerate(producers):
        m = 0
        for p in ps:
            if not 0 <= p < i:
                raise ValueError(
                    f"node {i}: producer {p} is not an earlier node "
                    "(nodes must be in topological order)")
            m |= 1 << p
            consumers[p].append(i)
        prod_mask[i] = m

    if isinstance(costs, dict):
        cost_list = [costs.get(c, math.inf) for c in candidates]
    else:
        cost_list = list(costs)
        if len(cost_list) != len(candidates):
            raise ValueError(
                f"costs has {len(cost_list)} entries for {len(candidates)} candidates")

    # Backends as small ints; with switching costs, the matrix (row = previous kernel's
    # backend, the extra last row = "no kernel yet", free).
    bnames = sorted({c.backend for c in candidates})
    bid = {b: i for i, b in enumerate(bnames)}
    swm = [[0.0] * len(bnames) for _ in range(len(bnames) + 1)]
    for a in bnames:
        for b in bnames:
            swm[bid[a]][bid[b]] = pair_cost(switch, a, b)
    sequence = any(v > 0 for row in swm for v in row)

    # Keep the cheapest finite candidate per node set (per node set and backend when
    # switching costs exist): a dearer one can always be swapped for it.
    best_by_mask: dict = {}
    for k, c in enumerate(candidates):
        w = float(cost_list[k]) + float(epsilon.get(c.backend, 0.0))
        if math.isnan(w) or math.isinf(w) or not c.nodes:
            continue
        mask = 0
        for v in c.nodes:
            if not 0 <= v < n:
                raise ValueError(f"candidate {c!r} names node {v}, graph has {n} nodes")
            mask |= 1 << v
        key = (mask, c.backend) if sequence else mask
        if key not in best_by_mask or w < best_by_mask[key][0]:
            best_by_mask[key] = (w, k)

    # Transitive descendants per node (reverse topological sweep).
    desc = [0] * n
    for i in range(n - 1, -1, -1):
        d = 0
        for j in consumers[i]:
            d |= (1 << j) | desc[j]
        desc[i] = d

    # Flat per-candidate arrays: mask, external producers, weight, descendants.
    cmask: list[int] = []
    cext: list[int] = []
    cw: list[float] = []
    cdesc: list[int] = []
    csize: list[int] = []
    corig: list[int] = []
    by_node: list[list[int]] = [[] for _ in range(n)]
    by_min: list[list[int]] = [[] for _ in range(n)]
    cb: list[int] = []
    for w, k in best_by_mask.values():
        mask = sum(1 << v for v in candidates[k].nodes)
        nodes = sorted(candidates[k].nodes)
        ext = 0
        dsc = 0
        for v in nodes:
            ext |= prod_mask[v]
            dsc |= desc[v]
        cid = len(cmask)
        cmask.append(mask)
        cext.append(ext & ~mask)     # ready at S  <=>  (ext & ~S) == 0
        cdesc.append(dsc & ~mask)    # nodes outside c reachable from c
        cw.append(w)
        csize.append(len(nodes))
        corig.append(k)
        cb.append(bid[candidates[k].backend])
        for v in nodes:
            by_node[v].append(cid)
        by_min[nodes[0]].append(cid)

    uncovered = [v for v in range(n) if not by_node[v]]
    if uncovered:
        raise ValueError(
            f"no finite-cost candidate covers node(s) {uncovered}; "
            "no valid placement exists")

    # A* heuristic: per-node lower bound on the share of a group's weight.
    lb = [min(cw[c] / csize[c] for c in by_node[v]) for v in range(n)]
    h0 = math.fsum(lb)
    # Reduced edge cost w(c) - (h(S) - h(S|c)) >= 0 by consistency; clamp rounding.
    cred = [max(0.0, cw[c] - math.fsum(lb[v] for v in candidates[corig[c]].nodes))
            for c in range(len(cmask))]

    full = (1 << n) - 1
    # A search state is one int: placed-node mask, shifted left by ``kb`` bits that hold
    # the backend of the last kernel (``kb == 0`` without switching costs).
    kb = len(bnames).bit_length() if sequence else 0
    low = (1 << kb) - 1
    start = len(bnames) if sequence else 0
    roots = sum(1 << v for v in range(n) if not prod_mask[v])

    def search(mode: str, limit: int | None):
        """``mode``: "ready" (every ready candidate: exact for switching costs), "pruned"
        (candidates holding u or ready ancestors of its group: exact for the additive
        cost), "restricted" (candidates holding u only)."""
        s0 = start
        g: dict[int, float] = {s0: 0.0}
        parent: dict[int, tuple[int, int] | None] = {s0: None}
        ready_of: dict[int, int] = {0: roots}  # mask -> unplaced nodes whose producers are placed
        closed: set[int] = set()
        heap = [(h0, 0, 0, s0)]  # (f = g + h, -placed count, tie counter, state)
        counter = 1
        expanded = 0
        stuck = (-1, 0)  # (placed count, smallest unplaced node) of deepest dead end
        while heap:
            f, negpop, _, st = heapq.heappop(heap)
            if st in closed:
                continue  # stale heap entry; a cheaper path already closed it
            closed.add(st)
            s = st >> kb
            if s == full:
                return st, g, parent, expanded, stuck
            expanded += 1
            if limit is not None and expanded > limit:
                return None, g, parent, expanded, stuck
            if progress is not None and expanded % _PROGRESS_EVERY == 0:
                progress(expanded)
            free = ~s
            u = (free & -free).bit_length() - 1  # smallest unplaced node; a frontier node
            succ = []
            reach_u = 0  # union of the still-possible groups that could hold u
            for c in by_node[u]:
                if cmask[c] & s:
                    continue
                reach_u |= cmask[c]
                if cext[c] & free == 0 and mode != "ready":
                    succ.append(c)
            if not reach_u:
                if -negpop > stuck[0]:
                    stuck = (-negpop, u)
                continue  # u can no longer be covered: dead state
            if mode == "ready":
                # Every ready candidate: its smallest node is a ready node.
                ready = ready_of[s]
                while ready:
                    v = (ready & -ready).bit_length() - 1
                    ready &= ready - 1
                    succ.extend(c for c in by_min[v] if not cmask[c] & s and not cext[c] & free)
            elif mode == "pruned":
                # Exactness-preserving pruning: any execution order of a solution can be
                # rewritten to place G_u (the group holding u) as soon as it is ready and
                # otherwise a ready group-graph ancestor of G_u, so besides candidates
                # holding u we only try ready candidates that may be such an ancestor.
                # Ancestry can hop between nodes of an intermediate group, so take the
                # fixpoint: x = nodes of candidates that hold u or reach x via edges.
                # A candidate reaching x has its min node below max(x), so scan only
                # min nodes in (u, max(x)).
                x = reach_u
                hi = x.bit_length() - 1
                scanned = u + 1
                pool: list[int] = []
                grew = True
                while grew:
                    for m in range(scanned, hi):
                        if not (s >> m) & 1:
                            pool.extend(c for c in by_min[m] if not cmask[c] & s)
                    scanned = max(scanned, hi)
                    grew = False
                    rest = []
                    for c in pool:
                        if cdesc[c] & x:
                            x |= cmask[c]
                            grew = True
                            if cext[c] & free == 0:
                                succ.append(c)
                        else:
                            rest.append(c)
                    pool = rest
                    hi = x.bit_length() - 1
            if not succ and -negpop > stuck[0]:
                stuck = (-negpop, u)
            gs = g[st]
            row = swm[st & low] if sequence else None
            for c in succ:
                s2 = s | cmask[c]
                st2 = (s2 << kb) | cb[c] if sequence else s2
                if st2 in closed:
                    continue
                sw = row[cb[c]] if sequence else 0.0
                g2 = gs + cw[c] + sw
                if g2 < g.get(st2, math.inf):
                    g[st2] = g2
                    parent[st2] = (st, c)
                    if sequence and s2 not in ready_of:
                        ready_of[s2] = _newly_ready(ready_of[s], s2, cmask[c])
                    heapq.heappush(heap, (f + cred[c] + sw, negpop - csize[c], counter, st2))
                    counter += 1
        return None, g, parent, expanded, stuck

    def _newly_ready(ready: int, s2: int, cm: int) -> int:
        ready &= ~cm
        m = cm
        while m:
            x = (m & -m).bit_length() - 1
            m &= m - 1
            for y in consumers[x]:
                if not (s2 >> y) & 1 and not prod_mask[y] & ~s2:
                    ready |= 1 << y
        return ready

    # With switching costs the exact search tries every ready candidate, which on wide
    # graphs (NASNet-A cells: 814 nodes, 6650 candidates) passes millions of states: then
    # the additive pruning (still charging switches) on a quarter of that budget, then the
    # restricted search (NASNet-A: 12k states, 0.3 s; within 0.3-1.4% of the exact cost on
    # the zoo's models where both finish). ``exact=False`` goes straight to it.
    limit = max(1, max_states // 10) if sequence else max(1, max_states)
    modes = ([("ready", limit), ("pruned", max(1, limit // 4))] if sequence else
             [("pruned", limit)]) + [("restricted", None)]
    if not exact:
        modes = modes[-1:]
    expanded = 0
    for i, (mode, limit) in enumerate(modes):
        found, g, parent, more, stuck = search(mode, limit)
        expanded += more
        if found is not None or limit is None or more <= limit:
            break
        log.warning(
            "op-level placer: %s search passed %d states (max_states=%d) on %d nodes / %d "
            "candidates; falling back to a %s search (result may be suboptimal)", mode, limit,
            max_states, n, len(cmask), modes[i + 1][0])
    if progress is not None:
        progress(expanded)
    if found is None:
        raise ValueError(
            f"no valid placement: search got stuck at node {stuck[1]} "
            f"(no executable cover of the graph by the finite-cost candidates)")

    # Walk parents back from the full state; the path order is an execution order.
    chosen: list[int] = []
    st = found
    while parent[st] is not None:
        prev, c = parent[st]
        chosen.append(c)
        st = prev
    chosen.reverse()
    groups = [candidates[corig[c]] for c in chosen]
    total = g[found]
    log.debug("op-level placer: %d nodes, %d candidates, %d states expanded, cost %.6g ms%s",
              n, len(cmask), expanded, total, " (with switching costs)" if sequence else "")
    return Placement(groups=groups, cost=total, chosen_by={c: "op-level" for c in groups},
                     exact=exact and i == 0)
