"""Regions cut around the TVM kernels that beat the library inside a chosen region.

The op-level DP places library regions cut at even ranges of the topological order only;
after it has chosen, ``carved_regions`` offers the pieces of each chosen region around the
TVM kernels that win inside it, to be measured and placed again (``build._carve``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..graph import DataflowGraph
from ..placement import Candidate


def kernel_cost(c, costs: dict, epsilon: dict) -> float:
    """What the DP charges for candidate ``c``: its cost plus its backend's call overhead
    ``epsilon`` (infinite when unmeasured)."""
    return costs.get(c, math.inf) + epsilon.get(c.backend, 0.0)


def carved_regions(graph: DataflowGraph, groups, candidates, costs: dict, epsilon: dict,
                   backends: dict, max_per_region: int = 8, cuts: list | None = None) -> list:
    """Region candidates cut around the TVM kernels that win inside a chosen region.

    Regions are cut at even ranges of the topological order only (``_regions``), so once
    the DP runs a stretch of the model as one library region, a TVM kernel that beats the
    library on a few of its operators (a tuned convolution, an elementwise chain TVM fuses)
    can take them only by breaking the region into pieces nobody offered. For each chosen
    region (``<lib>.region``) of ``groups``, the TVM candidates inside it that cost less
    (``kernel_cost``) than the libraries' best candidate of exactly their nodes (or, with
    none, their best single-node candidates summed) are the winners (disjoint, largest
    saving first). Offered: the region's runs without all winners, and for each of the
    ``max_per_region`` largest, the region's runs around that one alone (each run of
    consecutive nodes is convex, as in ``_regions``), where the cut can win by estimate: its
    pieces charged the region's time in proportion to the libraries' single-op times of their
    nodes, plus the winners' own times, plus a call per extra piece, below the region's time.
    A library's single-op time never measured (a lean search skips what cannot win: its
    cost is infinite) counts as nothing, in a winner's saving and in the region's shares: a
    TVM kernel wins only against what the libraries were measured to take, and a region with
    no measured single-op time is not cut.
    Returns the candidates not in ``candidates``, to be measured and placed again; each cut
    offered is appended to ``cuts`` (``Cut``)."""
    def w(c) -> float:
        return kernel_cost(c, costs, epsilon)

    best_ext: dict = {}
    for c in candidates:
        if backends[c.backend].is_external:
            best_ext[c.nodes] = min(best_ext.get(c.nodes, math.inf), w(c))

    def single(i) -> float:  # unknown (a lean search skipped it) counts as nothing
        t = best_ext.get(frozenset([i]), math.inf)
        return t if math.isfinite(t) else 0.0

    def lib_cost(nodes) -> float:  # the libraries' own candidate, else their single ops
        if math.isfinite(best_ext.get(nodes, math.inf)):
            return best_ext[nodes]
        return sum(single(i) for i in nodes)

    seen = set(candidates)
    out: list = []
    for g in groups:
        if not g.label.endswith(".region") or len(g.nodes) < 3:
            continue
        winners = []
        for c in candidates:
            if backends[c.backend].is_external or not c.nodes < g.nodes:
                continue
            saving = lib_cost(c.nodes) - w(c)
            if math.isfinite(w(c)) and saving > 0 and any(graph.nodes[i].call is not None
                                                          for i in c.nodes):
                winners.append((saving, c))
        # Disjoint winners, largest saving first (a fused kernel and its conv alone overlap).
        picked, taken = [], set()
        for saving, c in sorted(winners, key=lambda sc: -sc[0]):
            if not c.nodes & taken:
                picked.append(c)
                taken |= c.nodes
        share = sum(single(i) for i in g.nodes)
        if not share > 0:
            continue  # no single-op time to share the region's out by: no estimate
        ways = ([picked] if len(picked) > 1 else []) + [[c] for c in picked[:max_per_region]]
        for cut in ways:
            nodes = frozenset().union(*(c.nodes for c in cut))
            runs = _runs(graph, sorted(g.nodes - nodes))
            # Worth measuring only if it can win by estimate: the pieces charged the region's
            # time in proportion to the libraries' single-op times of their nodes.
            kept = sum(single(i) for r in runs for i in r)
            est = (w(g) * kept / share + sum(w(c) for c in cut)
                   + epsilon.get(g.backend, 0.0) * (len(runs) - 1))
            if not est < w(g):
                continue
            pieces = [Candidate(g.backend, frozenset(run), g.label) for run in runs]
            if cuts is not None:
                cuts.append(Cut(g, list(cut), pieces))
            for cand in pieces:
                if cand not in seen:
                    seen.add(cand)
                    out.append(cand)
    return out


@dataclass
class Cut:
    """One way ``carved_regions`` cut a chosen region: its TVM ``winners`` and the library
    ``pieces`` around them (nodes in neither go to their cheapest single candidate)."""
    region: Candidate
    winners: list
    pieces: list

    def cost(self, candidates, costs: dict, epsilon: dict) -> float:
        """The cut's measured cost (``costs`` + ``epsilon`` per kernel), to set against the
        region's."""
        def w(c) -> float:
            return kernel_cost(c, costs, epsilon)

        covered = frozenset().union(*(c.nodes for c in self.winners + self.pieces))
        total = sum(w(c) for c in self.winners + self.pieces)
        for i in self.region.nodes - covered:
            total += min((w(c) for c in candidates if c.nodes == {i}), default=math.inf)
        return total


def _runs(graph: DataflowGraph, nodes: list) -> list:
    """Maximal runs of consecutive indices in ``nodes`` holding two or more computing nodes."""
    runs, run = [], []
    for i in nodes + [None]:
        if i is not None and (not run or i == run[-1] + 1):
            run.append(i)
            continue
        if sum(1 for j in run if graph.nodes[j].call is not None) >= 2:
            runs.append(run)
        run = [i] if i is not None else []
    return runs
