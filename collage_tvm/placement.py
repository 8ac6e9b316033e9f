"""Candidate and placement, the nouns of the Collage search (paper §3-4), and what is done
with a placement: ordering its groups, merging groups of one graph library, checking
convexity, and the placement record (JSON) the placement log and ``collage-tvm show`` read.

Every stage that handles a placement (the placers, the final check, the build, the
placement log) uses these; none of them owns them.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

logger = logging.getLogger("collage_tvm")


@dataclass(frozen=True)
class Candidate:
    """A group of dataflow-graph nodes that one backend could run as one kernel.

    ``nodes`` are indices into ``DataflowGraph.nodes`` (topological order).
    ``label`` names the pattern that produced it (``"dnnl.conv2d_bias_relu"``,
    ``"tvm.fused"``); it is informational and not part of the identity used for costs.
    """

    backend: str
    nodes: frozenset
    label: str = field(default="", compare=False)

    def __repr__(self) -> str:
        return f"Candidate({self.backend}, {sorted(self.nodes)}, {self.label!r})"


@dataclass
class Placement:
    """The search's answer: candidates that cover every node exactly once."""

    groups: list  # list[Candidate], in an order where producers come first
    cost: float   # estimated cost (ms) under the additive model, Eq. 2-4
    chosen_by: dict = field(default_factory=dict)  # Candidate -> "op-level" | "graph-level"
    exact: bool = True  # False: the op-level DP fell back to its restricted search (too wide)
    # The stages that run concurrently (``collage_tvm.schedule``): per stage, its chains of
    # groups (each chain run in turn, the chains at once); empty: one group after another.
    stages: list = field(default_factory=list)


def single_ops(graph, backend: str = "tvm") -> list:
    """Every node a group of its own on ``backend`` (TVM alone: "tvm-only")."""
    return [Candidate(backend, frozenset([i]), f"{backend}.op") for i in range(len(graph))]


# --------------------------------------------------------------------------- order

def order_groups(graph, groups) -> list:
    """Groups in an executable order (producers first); raises if they form a cycle."""
    owner = {i: k for k, g in enumerate(groups) for i in g.nodes}
    deps = [{owner[p] for i in g.nodes for p in graph.nodes[i].inputs} - {k}
            for k, g in enumerate(groups)]
    done, order = set(), []
    while len(order) < len(groups):
        ready = [k for k in range(len(groups)) if k not in done and deps[k] <= done]
        if not ready:
            raise ValueError("groups form a cycle; no executable order")
        k = min(ready, key=lambda k: min(groups[k].nodes))
        done.add(k)
        order.append(groups[k])
    return order


# --------------------------------------------------------------------------- convexity

def is_convex(graph, nodes: set) -> bool:
    """No path leaves ``nodes`` and re-enters it (the group can run as one call)."""
    if not nodes:
        return True
    last = max(nodes)
    frontier = [u for i in nodes for u in graph.nodes[i].users if u not in nodes and u < last]
    seen = set(frontier)
    while frontier:
        i = frontier.pop()
        for u in graph.nodes[i].users:
            if u in nodes:
                return False
            if u not in seen and u < last:
                seen.add(u)
                frontier.append(u)
    return True


def _no_cycle_through(graph, nodes: set, part_of: dict, parts: dict) -> bool:
    """No path leaves ``nodes`` and re-enters it when every other part runs as one call
    (a part needs all of its inputs before any of its outputs exist)."""
    todo = [part_of[u] for i in nodes for u in graph.nodes[i].users if u not in nodes]
    seen = set(todo)
    while todo:
        for i in parts[todo.pop()]:
            for u in graph.nodes[i].users:
                if u in nodes:
                    return False
                p = part_of[u]
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
    return True


# --------------------------------------------------------------------------- merge

def valid_nodes(graph, backend) -> set:
    """Nodes some pattern rule of ``backend`` accepts (graph libraries declare rules)."""
    out = set()
    for rule in backend.rules:
        for node in graph.nodes:
            if node.index in graph.pinned:
                continue  # stays a TVM op inline (``DataflowGraph.pinned``)
            try:
                if rule.valid_op(node):
                    out.add(node.index)
            except Exception as err:  # a broken rule must not stop the search
                logger.debug("%s valid_op raised on %s: %s", backend.name, node, err)
    return out


def merge_offloaded(graph, groups: list, offloaded: set) -> list:
    """Merge touching groups of the same graph library (indices in ``offloaded``) while the
    merged group is convex and the groups still have an executable order.

    Returns the new list of candidates (unordered); merged groups are labelled
    ``<lib>.graph``. Convexity of each merged group alone is not enough: two groups can each
    be convex and still need each other's outputs; the cheap per-group check runs first and
    the whole-partition check only when its result cannot be ordered.
    """
    out = _merge(graph, groups, offloaded, strict=False)
    try:
        order_groups(graph, out)
        return out
    except ValueError:
        return _merge(graph, groups, offloaded, strict=True)


def _merge(graph, groups, offloaded, strict: bool) -> list:
    parts = {k: set(g.nodes) for k, g in enumerate(groups)}
    part_of = {i: k for k, g in enumerate(groups) for i in g.nodes}
    lib_of = {k: groups[k].backend for k in offloaded}
    done: set = set()
    for k in sorted(offloaded, key=lambda k: min(groups[k].nodes)):
        lib = lib_of[k]
        neighbours = {part_of[j] for i in parts[k]
                      for j in list(graph.nodes[i].inputs) + list(graph.nodes[i].users)
                      if j in part_of and part_of[j] in done and lib_of[part_of[j]] == lib}
        for c in sorted(neighbours, key=lambda c: -len(parts[c])):
            union = parts[k] | parts[c]
            if not is_convex(graph, union):
                continue
            if strict:
                trial = dict(part_of)
                for i in parts[c]:
                    trial[i] = k
                if not _no_cycle_through(graph, union, trial,
                                         {**{p: n for p, n in parts.items() if p != c}, k: union}):
                    continue
            for i in parts.pop(c):
                part_of[i] = k
            parts[k] = union
            done.discard(c)
        done.add(k)
    out = [g for k, g in enumerate(groups) if k not in offloaded]
    for k in sorted(done, key=lambda k: min(parts[k])):
        out.append(Candidate(lib_of[k], frozenset(parts[k]), f"{lib_of[k]}.graph"))
    return out


# --------------------------------------------------------------------------- record

def placement_record(placement: Placement, graph, target, comparison: dict | None = None,
                     shipped: str = "collage", graph_level: dict | None = None) -> dict:
    """The placement as JSON data: its groups, how it was chosen and judged, and the
    dataflow graph itself (so ``collage-tvm show`` can draw it)."""
    return {
        "target": str(target),
        "shipped": shipped,
        "comparison": comparison or {},
        "graph_level": graph_level or {},
        "estimated_ms": placement.cost,
        "groups": [{"backend": g.backend, "nodes": sorted(g.nodes), "label": g.label,
                    "ops": [graph.nodes[i].op_name for i in sorted(g.nodes)],
                    "level": placement.chosen_by.get(g, "op-level")}
                   for g in placement.groups],
        "graph": {"nodes": [{"op": n.op_name, "inputs": list(n.inputs), "shape": _shape_of(n)}
                            for n in graph.nodes],
                  "outputs": list(graph.outputs)},
        **({"stages": stage_indices(placement)} if placement.stages else {}),
    }


def stage_indices(placement: Placement) -> list:
    """``placement.stages`` as indices into its groups (per stage, per chain)."""
    index = {g: k for k, g in enumerate(placement.groups)}
    return [[[index[g] for g in chain] for chain in stage] for stage in placement.stages]


def _shape_of(node) -> list | None:
    """The static output shape of ``node`` (None for tuples or symbolic shapes)."""
    ty = getattr(node.var, "ty", None)
    shape = getattr(ty, "shape", None)
    try:
        return [int(d) for d in shape.values]
    except (AttributeError, TypeError):
        return None


def placement_from_record(record, graph, backends) -> Placement | None:
    """The placement a record holds, or None (with a warning) when it is malformed or does
    not fit ``graph`` and the backends at hand."""
    if not record:
        return None
    try:
        groups = [Candidate(g["backend"], frozenset(g["nodes"]), g.get("label", ""))
                  for g in record["groups"]]
    except (KeyError, TypeError):
        logger.warning("placement log entry is malformed; searching again")
        return None
    if any(g.backend not in backends for g in groups) or \
            sorted(i for g in groups for i in g.nodes) != list(range(len(graph))):
        logger.warning("placement log entry does not fit this model; searching again")
        return None
    try:
        stages = [[[groups[k] for k in chain] for chain in stage]
                  for stage in record.get("stages") or []]
    except (IndexError, TypeError):
        logger.warning("placement log entry's stages do not fit its groups; searching again")
        return None
    return Placement(groups, record.get("estimated_ms", math.nan),
                     {g: rg.get("level", "op-level") for g, rg in zip(groups, record["groups"])},
                     stages=stages)
