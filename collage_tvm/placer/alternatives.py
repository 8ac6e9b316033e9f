"""The alternative covers of an op-level placement: where a different cover of the same
nodes was within the measurement noise.

The DP picks the cheapest cover under measured costs, and with hundreds of candidates each
timed once on a noisy machine it picks, among near-equal alternatives, the one measured
luckiest (the winner's curse): a fused conv+bias+relu timed during a burst of machine noise
looks dearer than the same conv alone, though the fused ReLU costs nothing, and the DP
splits ReLUs and residual adds off their convolutions onto extra kernels
(``git show 31eb8cd:docs/BENCHMARKS.md``, "A measurement-noise finding").
``alternative_covers`` lists, for each group of a placement, the alternative covers of its
nodes (one candidate merging several chosen groups, or a few candidates splitting one)
whose cost is within ``threshold`` of the chosen cover's; ``refine`` has each such set
re-timed side by side and the DP runs again.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..placement import Placement


def alternative_covers(placement: Placement, candidates: list, costs: dict, epsilon: dict,
                       threshold: float = 0.25, max_parts: int = 3) -> list:
    """``[(chosen, alternative)]``, closest first: two covers (lists of candidates) of the
    same node set, the chosen one from ``placement``, whose costs (``costs[c]`` plus the
    backend's call overhead, ``epsilon[backend]``) differ by at most ``threshold`` of the
    smaller. Alternatives: a candidate not chosen whose nodes are
    exactly the union of two or more chosen groups; a cover of a chosen group's nodes by
    2..``max_parts`` other candidates."""
    def w(group) -> float:
        return sum(costs.get(c, math.inf) + epsilon.get(c.backend, 0.0) for c in group)

    def close(a, b) -> bool:
        wa, wb = w(a), w(b)
        return math.isfinite(wa) and math.isfinite(wb) and max(wa, wb) <= (1 + threshold) * min(wa, wb)

    chosen = list(placement.groups)
    owner = {v: k for k, g in enumerate(chosen) for v in g.nodes}
    taken = {(g.backend, g.nodes) for g in chosen}
    usable = [c for c in candidates if (c.backend, c.nodes) not in taken
              and math.isfinite(costs.get(c, math.inf))]
    by_min: dict = {}
    for c in usable:
        by_min.setdefault(min(c.nodes), []).append(c)
    out: list = []
    seen: set = set()

    def add(a: list, b: list) -> None:
        key = (frozenset((c.backend, c.nodes) for c in a), frozenset((c.backend, c.nodes) for c in b))
        if key not in seen and close(a, b):
            seen.add(key)
            out.append((a, b))

    for c in usable:  # merges: one candidate for several chosen groups
        ks = {owner[v] for v in c.nodes}
        if len(ks) >= 2 and frozenset().union(*(chosen[k].nodes for k in ks)) == c.nodes:
            add([chosen[k] for k in sorted(ks)], [c])
    for g in chosen:  # splits: a few candidates for one chosen group
        if len(g.nodes) < 2:
            continue
        for cover in _covers(g.nodes, by_min, max_parts):
            if len(cover) >= 2:
                add([g], cover)
    out.sort(key=lambda ab: max(w(ab[0]), w(ab[1])) / max(min(w(ab[0]), w(ab[1])), 1e-12))
    return out


def _covers(nodes: frozenset, by_min: dict, max_parts: int, prefix=()):
    """Partitions of ``nodes`` into at most ``max_parts`` candidates (by smallest node)."""
    if not nodes:
        yield list(prefix)
        return
    if len(prefix) == max_parts:
        return
    for c in by_min.get(min(nodes), ()):
        if c.nodes <= nodes:
            yield from _covers(nodes - c.nodes, by_min, max_parts, prefix + (c,))


def functions_of(decisions: list) -> list:
    """The distinct candidates of each decision, both covers together, in a stable order."""
    out = []
    for a, b in decisions:
        members: dict = {}
        for c in list(a) + list(b):
            members.setdefault((c.backend, c.nodes), c)
        out.append(list(members.values()))
    return out



@dataclass
class Refined:
    raw: dict                # candidate -> ms, with the side-by-side estimates
    alternative_covers: int  # alternative covers within the threshold
    stakes: list             # ms at stake per alternative cover re-timed, largest first


def refine(measurer, placement: Placement, candidates: list, raw: dict, epsilon: dict,
           backends: dict, threshold: float = 0.75, max_sets: int = 300,
           budget_s: float | None = None) -> Refined:
    """Re-time the placement's alternative covers side by side
    (``Measurer.retime_side_by_side``).

    ``alternative_covers`` lists the alternative covers whose measured cost is within
    ``threshold`` of the chosen one (wide: one burst of machine noise has made a fused
    kernel look far dearer than the same kernel without its epilogue, see the module doc);
    the candidates of each (both covers) run in alternating rounds in one process. One
    function often sits in several sets, each timed in its own machine state:
    ``fit_side_by_side`` estimates each function's time and each set's drift together, so
    the ratios inside a set are what the DP sees. Candidates the measurer did not measure,
    or whose re-timing fails, keep their first time. The alternative covers are taken by what is
    at stake (the smaller cover's time, weighted by how close the two are), at most
    ``max_sets`` of them, within ``budget_s`` seconds of re-timing: on a small model with
    many overlapping graph-library candidates the alternative covers run to hundreds of sets of
    tiny kernels that can move the end-to-end time little.
    """
    from ..measure.side_by_side import fit_side_by_side

    dp_costs = {c: max(0.0, v - epsilon.get(c.backend, 0.0)) for c, v in raw.items()}
    decisions = alternative_covers(placement, candidates, dp_costs, epsilon, threshold)

    def stake(decision) -> float:
        wa, wb = (sum(dp_costs[c] + epsilon.get(c.backend, 0.0) for c in cover)
                  for cover in decision)
        low = min(wa, wb)
        return low * max(0.0, 1.0 - (max(wa, wb) / max(low, 1e-12) - 1.0) / (threshold * 1.01))

    ranked = sorted(((stake(d), m) for d, m in zip(decisions, functions_of(decisions))),
                    key=lambda sm: -sm[0])[:max_sets]
    ranked = [(st, m) for st, m in ranked if all(measurer.identity(c) for c in m)]
    timed = measurer.retime_side_by_side([m for _, m in ranked], backends, budget_s)
    fitted = fit_side_by_side(timed)
    out = dict(raw)
    for c in raw:
        ident = measurer.identity(c)
        if ident in fitted:
            out[c] = fitted[ident]
    return Refined(out, len(decisions), [st for st, _ in ranked])
