"""Turn every backend's patterns into candidates over one dataflow graph.

Explicit patterns (``tvm.relax.dpl``) are matched rooted at each node; the match's
root is the group's only output. Pattern rules are expanded by the generator of the
Collage paper (Fig. 4): from each valid node, grow the group along its post-dominator
chain while the backend's fusion rule accepts it, emitting every legal group.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ..placement import Candidate
from ..graph import DataflowGraph

logger = logging.getLogger("collage_tvm")


@dataclass
class CheckContext:
    """What a pattern's ``check`` sees (mirrors ``tvm.relax.transform.PatternCheckContext``)."""

    matched_expr: object        # the root call of the match
    annotated_expr: dict        # annotation name -> matched expression
    nodes: list                 # the graph nodes of the group, topological order
    graph: DataflowGraph


def _inner_pattern_types():
    from tvm.relax import dpl

    return (dpl.CallPattern, dpl.TuplePattern, dpl.TupleGetItemPattern)


_INNER = _inner_pattern_types()


def _match_explicit(graph: DataflowGraph, backend, var2val, node_of) -> list:
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
                ctx = CheckContext(
                    matched_expr=node.value,
                    annotated_expr={k: matched[p] for k, p in entry.annotations.items()
                                    if p in matched},
                    nodes=[graph.nodes[i] for i in sorted(group)], graph=graph)
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


def _expand_rule(graph: DataflowGraph, backend, rule, ipdom) -> list:
    out = []
    valid = [False] * len(graph)
    for node in graph.nodes:
        try:
            valid[node.index] = bool(rule.valid_op(node))
        except Exception as err:
            logger.debug("%s valid_op raised on %s: %s", backend.name, node, err)
    for node in graph.nodes:
        if not valid[node.index]:
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
    return out


def generate_candidates(graph: DataflowGraph, backends) -> list:
    """Every candidate of every backend over ``graph``, deduplicated."""
    var2val = graph.var2val()
    node_of = {}
    for node in graph.nodes:
        node_of[node.var] = node.index
        node_of[node.value] = node.index
    ipdom = graph.post_dominators()
    seen, out = set(), []
    for backend in backends:
        found = _match_explicit(graph, backend, var2val, node_of)
        for rule in backend.rules:
            found += _expand_rule(graph, backend, rule, ipdom)
        for cand in found:
            if cand not in seen:
                seen.add(cand)
                out.append(cand)
    return out
