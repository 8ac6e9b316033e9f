"""The candidate generator: every backend's patterns turned into candidates over one
dataflow graph (paper §3, Fig. 4).

Explicit patterns (``tvm.relax.dpl``) are matched rooted at each node; the match's
root is the group's only output. Pattern rules are expanded by the generator of the
Collage paper (Fig. 4): from each valid node, grow the group along its post-dominator
chain while the backend's fusion rule accepts it, emitting every legal group.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from tvm import relax

from .graph import DataflowGraph
from .graph.subgraph import constant_bytes
from .placement import Candidate

logger = logging.getLogger("collage_tvm")


@dataclass
class CheckContext:
    """What a pattern's ``check`` sees: every field of TVM's
    ``tvm.relax.transform.PatternCheckContext`` (so TVM's own checks run on it), plus the
    group's graph nodes. The maps are plain mappings (``in``, ``[]``, ``.get``, iteration).
    """

    matched_expr: object        # the root call of the match
    annotated_expr: dict        # annotation name -> matched expression
    matched_bindings: dict      # var -> value of every binding in the group
    var_usages: Mapping         # var -> [vars whose bindings use it], over the whole function
    value_to_bound_var: Mapping  # value -> bound var, bindings up to the matched one only
    nodes: list                 # the graph nodes of the group, topological order
    graph: DataflowGraph


class _BoundVarsUpTo(Mapping):
    """``value -> bound var`` of the bindings up to node ``limit`` (TVM's
    ``value_to_bound_var``: built while walking the block, so later bindings are absent).
    A view over one per-graph index; no copy per match."""

    __slots__ = ("_index", "_nodes", "_limit")

    def __init__(self, index: dict, nodes: list, limit: int):
        self._index, self._nodes, self._limit = index, nodes, limit

    def __getitem__(self, value):
        where = self._index[value]  # node indices bound to this value, ascending
        k = bisect.bisect_right(where, self._limit)
        if k == 0:
            raise KeyError(value)
        return self._nodes[where[k - 1]].var

    def __iter__(self):
        for value, where in self._index.items():
            if where[0] <= self._limit:
                yield value

    def __len__(self) -> int:
        return sum(1 for where in self._index.values() if where[0] <= self._limit)


class _GraphMaps:
    """The per-graph maps a check context needs, computed once (on the first check)."""

    def __init__(self, graph: DataflowGraph):
        self.graph = graph
        self._usages = None
        self._value_index = None

    @property
    def var_usages(self) -> dict:
        if self._usages is None:
            usages = {v: [] for v in self.graph.params}
            for node in self.graph.nodes:
                usages.setdefault(node.var, [])
            for node in self.graph.nodes:
                for v in relax.analysis.free_vars(node.value):
                    users = usages.setdefault(v, [])
                    if not users or not users[-1].same_as(node.var):
                        users.append(node.var)
            self._usages = usages
        return self._usages

    def value_to_bound_var(self, limit: int) -> _BoundVarsUpTo:
        if self._value_index is None:
            index: dict = {}
            for node in self.graph.nodes:
                index.setdefault(node.value, []).append(node.index)
            self._value_index = index
        return _BoundVarsUpTo(self._value_index, self.graph.nodes, limit)


def _inner_pattern_types():
    from tvm.relax import dpl

    return (dpl.CallPattern, dpl.TuplePattern, dpl.TupleGetItemPattern)


_INNER = _inner_pattern_types()


def _match_explicit(graph: DataflowGraph, backend, var2val, node_of, maps: _GraphMaps) -> list:
    out = []
    for entry in backend.patterns:
        for node in graph.nodes:
            if node.call is None:
                continue
            try:
                matched = entry.pattern.extract_matched_expr(node.value, var2val)
            except Exception as err:  # a broken pattern must not stop the search
                logger.warning("pattern %s failed on node %d: %s", entry.name, node.index, err)
                break
            if not matched:
                continue
            group = {node.index}
            for pat, expr in matched.items():
                # Only call/tuple sub-patterns are inside the group; wildcards are its inputs.
                if not isinstance(pat, _INNER):
                    continue
                idx = node_of.get(expr)
                if idx is not None:
                    group.add(idx)
            # A fused primitive exposes only its root: intermediates may not escape.
            if any(i != node.index for i in graph.escapes(group)):
                continue
            if entry.check is not None:
                nodes = [graph.nodes[i] for i in sorted(group)]
                ctx = CheckContext(
                    matched_expr=node.value,
                    annotated_expr={k: matched[p] for k, p in entry.annotations.items()
                                    if p in matched},
                    matched_bindings={n.var: n.value for n in nodes},
                    var_usages=maps.var_usages,
                    value_to_bound_var=maps.value_to_bound_var(node.index),
                    nodes=nodes, graph=graph)
                try:
                    ok = entry.check(ctx)
                except Exception as err:
                    logger.debug("check of %s raised on node %d: %s", entry.name, node.index, err)
                    ok = False
                if not ok:
                    continue
            out.append(Candidate(backend.name, frozenset(group), entry.name))
    return out


def _between(graph: DataflowGraph, start: int, end: int) -> list | None:
    """All nodes on paths from ``start`` to its post-dominator ``end`` (inclusive)."""
    seen, stack = {start}, [start]
    while stack:
        i = stack.pop()
        if i == end:
            continue
        for u in graph.nodes[i].users:
            if u > end:  # cannot happen below a post-dominator; guard anyway
                return None
            if u not in seen:
                seen.add(u)
                stack.append(u)
    return sorted(seen)


def _expand_rule(graph: DataflowGraph, backend, rule, ipdom, regions: bool = True) -> list:
    out = []
    valid = [False] * len(graph)
    for node in graph.nodes:
        try:
            valid[node.index] = bool(rule.valid_op(node))
        except Exception as err:
            logger.debug("%s valid_op raised on %s: %s", backend.name, node, err)
    for node in graph.nodes:
        if not valid[node.index] or rule.regions_only:
            continue
        out.append(Candidate(backend.name, frozenset([node.index]), f"{backend.name}.op"))
        if rule.fusion_rule is None:
            continue
        end = ipdom[node.index]
        while end is not None:
            group = _between(graph, node.index, end)
            if group is None or len(group) > rule.max_size or not all(valid[i] for i in group):
                break
            if rule.fusion_rule([graph.nodes[i] for i in group]):
                out.append(Candidate(backend.name, frozenset(group), f"{backend.name}.fused"))
            end = ipdom[end]
    if rule.regions and regions:
        out += _regions(graph, backend, rule.regions, valid)
    return out


# A region holding more weights than this is not offered: measuring it makes the measuring
# process hold them (random stand-ins: ``graph.subgraph.without_weights``) and the library
# its own copy, beside the model in the search process; the smaller regions and groups
# cover the same nodes, and the never-slower check still times the whole model on each
# library.
REGION_MAX_BYTES = 1 << 30


def _regions(graph: DataflowGraph, backend, levels: int, valid: list) -> list:
    """Region candidates (``PatternRule.regions``): the nodes in topological order cut into
    ``2 ** k`` equal ranges for k = 0..``levels``; in each range, every maximal run of valid
    nodes holding at least two computing nodes (and at most ``REGION_MAX_BYTES`` of weights)
    is one candidate. A run of consecutive nodes in topological order is convex: a path
    between two of its nodes passes only through nodes ordered between them."""
    n, out = len(graph), []
    weights = [constant_bytes(node.value) for node in graph.nodes]
    for k in range(levels + 1):
        parts = 2 ** k
        if n // parts < 2:
            break
        for p in range(parts):
            lo, hi = p * n // parts, (p + 1) * n // parts
            run: list = []
            for i in list(range(lo, hi)) + [None]:
                if i is not None and valid[i]:
                    run.append(i)
                    continue
                if sum(1 for j in run if graph.nodes[j].call is not None) >= 2 and \
                        sum(weights[j] for j in run) <= REGION_MAX_BYTES:
                    out.append(Candidate(backend.name, frozenset(run), f"{backend.name}.region"))
                run = []
    return out


def generate_candidates(graph: DataflowGraph, backends, regions: bool = True) -> list:
    """Every candidate of every backend over ``graph``, deduplicated; ``regions=False``
    leaves out the graph libraries' region candidates (``PatternRule.regions``). A node of
    ``graph.pinned`` (symbolic shape vars made in the body) gets its single TVM op only."""
    var2val = graph.var2val()
    node_of = {}
    for node in graph.nodes:
        node_of[node.var] = node.index
        node_of[node.value] = node.index
    ipdom = graph.post_dominators()
    maps = _GraphMaps(graph)
    seen, out = set(), []
    for backend in backends:
        found = _match_explicit(graph, backend, var2val, node_of, maps)
        for rule in backend.rules:
            found += _expand_rule(graph, backend, rule, ipdom, regions)
        for cand in found:
            if graph.pinned & cand.nodes and (backend.is_external or len(cand.nodes) > 1):
                continue  # a node defining or reading body-made shape vars stays inline
            if cand not in seen:
                seen.add(cand)
                out.append(cand)
    return out
