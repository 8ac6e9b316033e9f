"""A placement as the schedule's graph (issue #80, part 1): its groups (a library region or a
TVM kernel each) are the nodes IOS's dynamic program (``ios.schedule``) orders into stages,
with an edge where one group reads a value another writes. A merge key: operators of one kind
and one set of attributes on the same input (an inception block's 1x1 convolutions)."""
from __future__ import annotations

from ..placement import order_groups


def group_dag(graph, groups) -> tuple[list, list[set[int]]]:
    """(the groups in an executable order, their successors: k -> the groups reading a value
    group k writes), ``groups`` being a placement's groups on ``graph`` (``DataflowGraph``).
    Raises ``ValueError`` when the groups form a cycle (as ``placement.order_groups``)."""
    ordered = order_groups(graph, groups)
    owner = {i: k for k, g in enumerate(ordered) for i in g.nodes}
    succ: list[set[int]] = [set() for _ in ordered]
    for k, g in enumerate(ordered):
        for i in g.nodes:
            for p in graph.nodes[i].inputs:
                if owner[p] != k:
                    succ[owner[p]].add(k)
    return ordered, succ


def merge_keys(graph, groups) -> list:
    """Per group (in ``groups``' order), what it may merge with, else None: a group of one
    operator, keyed by its backend, its operator and its attributes (``ios.same_kind_siblings``
    then pairs those that read one input). Whether a merged operator can be built is the
    stage cost's to answer (inf where it cannot)."""
    keys = []
    for g in groups:
        if len(g.nodes) != 1:
            keys.append(None)
            continue
        (i,) = g.nodes
        node = graph.nodes[i]
        keys.append((g.backend, node.op_name, str(node.attrs)))
    return keys
