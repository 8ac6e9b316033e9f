"""The single-backend builds a placement is judged against (docs/DESIGN.md, "The final check").

"tvm-only": TVM alone (its own fusion). "<lib>+tvm" for an op library: the BYOC habit,
every group the library's patterns match (largest first) goes to it, TVM runs the rest.
"<lib>" for a graph library: all it can run, merged into convex clusters (the whole model
as one call when it runs every operator; "<lib>+tvm" when some stay on TVM).
"""
from __future__ import annotations

from ..candidates import generate_candidates
from ..placement import Candidate, merge_offloaded, order_groups, single_ops, valid_nodes


def byoc_groups(graph, backend) -> list:
    """Greedy offload: at each node, the largest candidate of ``backend`` starting there."""
    cands = generate_candidates(graph, [backend])
    best: dict = {}
    for c in cands:
        start = min(c.nodes)
        if start not in best or len(c.nodes) > len(best[start].nodes):
            best[start] = c
    placed: set = set()
    groups = []
    for i in range(len(graph)):
        if i in placed:
            continue
        c = best.get(i)
        if c is not None and not (c.nodes & placed):
            groups.append(c)
            placed |= c.nodes
    groups += [g for g in single_ops(graph) if not g.nodes & placed]
    return order_groups(graph, groups)


def graph_lib_groups(graph, backend) -> list:
    """A graph library running all it can: its valid nodes merged into convex clusters
    (the whole model as one call when it can run every operator), TVM for the rest."""
    valid = valid_nodes(graph, backend)
    singles = [Candidate(backend.name if i in valid else "tvm", frozenset([i]),
                         f"{backend.name}.graph" if i in valid else "tvm.op")
               for i in range(len(graph))]
    merged = merge_offloaded(graph, singles, {i for i in range(len(graph)) if i in valid})
    return order_groups(graph, merged)


def single_backend_builds(graph, backends: dict) -> dict:
    """name -> groups of every single-backend build of ``backends`` (module doc)."""
    builds = {"tvm-only": single_ops(graph)}
    for name, b in backends.items():
        if b.is_external and b.kind == "op":
            builds[f"{name}+tvm"] = byoc_groups(graph, b)
        elif b.kind == "graph":
            groups = graph_lib_groups(graph, b)
            builds[name if all(g.backend == name for g in groups) else f"{name}+tvm"] = groups
    return builds
