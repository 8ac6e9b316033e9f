"""Graph split for the rewrite search (MetaFlow, Alg. 2).

The search's space grows with every independent site: k sites that each may or may not
fire are 2^k graphs. MetaFlow splits the graph into pieces of at most ``max_ops`` operators
at a minimum vertex cut, each vertex weighted by how many substitution sites it is part of
(so few sites are broken by the cut), searches each piece alone, stitches the results and
searches once more over the sites that span the pieces.

Here a piece is a set of bindings of ``main``'s dataflow block; the split recurses on the
binding graph (an edge from each binding to the bindings that use its var): a cut between
the earliest and the latest quarter of a piece (in binding order, which is topological),
the vertices split in two joined by an edge of capacity ``1000 * sites + 1`` (fewest broken
sites first, then fewest vertices), ``networkx.minimum_cut``; the cut vertices end the
first piece.
"""
from __future__ import annotations

import networkx as nx
from tvm import relax

from .passes import _single_block


_EDGE = 10 ** 12  # capacity of a data edge: above any sum of vertex capacities


def binding_edges(bindings: list) -> list:
    """(j, i) for each binding ``i`` that uses the var of binding ``j``."""
    index = {b.var: k for k, b in enumerate(bindings)}
    edges = set()
    for i, b in enumerate(bindings):
        def visit(e, i=i):
            j = index.get(e) if isinstance(e, relax.Var) else None
            if j is not None and j != i:
                edges.add((j, i))

        relax.analysis.post_order_visit(b.value, visit)
    return sorted(edges)


def split(n: int, edges: list, weights: dict, max_ops: int = 30) -> list:
    """Pieces (sorted lists of vertices ``0..n-1``) of at most ``max_ops`` vertices each:
    recursive minimum vertex cuts weighted by ``weights`` (vertex -> sites through it)."""
    if max_ops < 2:
        raise ValueError(f"max_ops must be at least 2, got {max_ops}")
    pieces, pending = [], [list(range(n))]
    while pending:
        part = pending.pop()
        if len(part) <= max_ops:
            if part:
                pieces.append(part)
            continue
        first, second = _cut(part, edges, weights)
        pending += [second, first]
    return sorted(pieces, key=lambda p: p[0])


def _cut(part: list, edges: list, weights: dict) -> tuple:
    """``part`` in two at a minimum weighted vertex cut between its first and last quarter."""
    inside = set(part)
    quarter = max(1, len(part) // 4)
    g = nx.DiGraph()
    for v in part:
        g.add_edge(("in", v), ("out", v), capacity=1000 * weights.get(v, 0) + 1)
    for j, i in edges:  # an edge is cut only where nothing else can be (head to tail)
        if j in inside and i in inside:
            g.add_edge(("out", j), ("in", i), capacity=_EDGE)
    for v in part[:quarter]:  # the quarters themselves cannot be cut: the cut lies between
        g.add_edge("source", ("out", v))
    for v in part[-quarter:]:
        g.add_edge(("in", v), "sink")
    _, (reach, _) = nx.minimum_cut(g, "source", "sink")
    head, tail = set(part[:quarter]), set(part[-quarter:])
    first = [v for v in part if v in head or (v not in tail and ("in", v) in reach)]
    second = [v for v in part if v not in set(first)]
    if not first or not second:  # cannot happen with both quarters attached; stay safe
        half = len(part) // 2
        return part[:half], part[half:]
    return first, second


def pieces_of(mod, rewrites, max_ops: int = 30) -> list:
    """``main``'s bindings split into pieces for the search: a list of sets of binding vars
    (see the module doc); one piece when ``main`` is not a single dataflow block."""
    bindings = _single_block(mod)
    if bindings is None:
        return []
    weights: dict = {}
    index = {b.var: k for k, b in enumerate(bindings)}
    for rw in rewrites:
        for site in rw.sites(mod):
            for var in rw.site_vars(mod, site) or ():
                k = index.get(var)
                if k is not None:
                    weights[k] = weights.get(k, 0) + 1
    parts = split(len(bindings), binding_edges(bindings), weights, max_ops)
    return [{bindings[k].var for k in p} for p in parts]
