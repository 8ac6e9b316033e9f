"""Graph-library regions cut at their branches, so that a schedule can run them at once
(issue #80).

On a CPU the final check mostly ships one graph library (ONNX Runtime, OpenVINO) running the
whole model: one region, one group, and nothing for IOS's dynamic program to put side by
side. IOS's operators are the model's; here a graph library's region is cut into *pieces*
first, the maximal chains of its operators (an operator joins the piece of its one
predecessor inside the region where it is that predecessor's one consumer there), so each
branch of an Inception block, a NASNet cell or a detection head's towers is a piece of its
own. The plan (``schedule.plan``) then measures each piece as a region of that library on
every core and on its share, and the dynamic program chooses the stages.

What runs in turn is put back together (``remerge``): the pieces of one region that the
schedule runs one after another, without anything between them, become one region again;
so do those of one concurrent group (``Stage.groups``) that came from one region. Only the
cuts the schedule runs at once remain. Each such set of pieces is convex (a path between two
of them runs through nothing that is not among them: what runs between two stages' pieces
is in a stage between them), so every group stays a valid region. Whether the result ships
is the final check's to say: it times the concurrent build beside the placement as it was.
"""
from __future__ import annotations

from ..placement import Candidate

#: Regions are cut only on machines with at least this many cores. On 2 cores (the AMX
#: Xeon, googlenet at batch 1 as one region: 36 of its 46 pieces on branches) each piece
#: ran 1.4-1.9x faster on both cores than on one, no concurrent stage beat its pieces in
#: turn on OpenVINO, the one that did on ONNX Runtime (0.53 against 0.62 ms) built 43%
#: slower than the whole region (the cut region's sessions wake their threads at each
#: operator instead of spinning), and the plan took 1.7-3.2 s: IOS's premise, operators too
#: small for the machine, needs more cores than that.
SPLIT_FROM_CORES = 4


def pieces(graph, nodes) -> list[frozenset]:
    """``nodes`` (one region's) as its maximal chains, in topological order."""
    inside = set(nodes)
    piece_of: dict = {}
    out: list[list[int]] = []
    for i in sorted(inside):
        preds = [p for p in graph.nodes[i].inputs if p in inside]
        if len(preds) == 1 and sum(u in inside for u in graph.nodes[preds[0]].users) == 1:
            piece_of[i] = piece_of[preds[0]]
            out[piece_of[i]].append(i)
        else:
            piece_of[i] = len(out)
            out.append([i])
    return [frozenset(p) for p in out]


def split_for_schedule(graph, groups: list, backends: dict,
                       cores: int | None = None) -> tuple[list, dict]:
    """(``groups`` with each graph library's region of more than one piece cut into its
    pieces, origin: each group of the answer -> the group of ``groups`` it is part of).
    On fewer than ``SPLIT_FROM_CORES`` cores (``cores``, default this machine's) nothing
    is cut."""
    from ..target import host_cores

    out, origin = [], {}
    pinned = getattr(graph, "pinned", set())
    cut_here = (cores or host_cores()) >= SPLIT_FROM_CORES
    for g in groups:
        backend = backends.get(g.backend)
        cut = [g.nodes]
        if (cut_here and backend is not None and backend.kind == "graph" and len(g.nodes) > 1
                and not (g.nodes & pinned)):
            cut = pieces(graph, g.nodes)
        if len(cut) == 1:
            out.append(g)
            origin[g] = g
            continue
        for nodes in cut:
            piece = Candidate(g.backend, nodes, g.label)
            out.append(piece)
            origin[piece] = g
    return out, origin


def _joined(run: list, origin: dict):
    """One group of the pieces ``run`` (all from one region): that region where it is
    all of it."""
    whole = origin[run[0]]
    nodes = frozenset().union(*(p.nodes for p in run))
    return whole if nodes == whole.nodes else Candidate(whole.backend, nodes, whole.label)


def _runs(pieces_in_order: list, origin: dict) -> list:
    """``pieces_in_order`` with each run of consecutive pieces of one region joined."""
    out, run = [], []
    for p in pieces_in_order:
        if run and origin[run[-1]] != origin[p]:
            out.append(_joined(run, origin))
            run = []
        run.append(p)
    if run:
        out.append(_joined(run, origin))
    return out


def remerge(ordered: list, schedule, origin: dict) -> tuple[list, list]:
    """(groups, stages) of the placement ``schedule`` runs, over ``ordered``'s pieces
    (``split_for_schedule``'s, in ``group_dag``'s order): see the module. ``stages`` as
    ``Placement.stages`` holds them (per concurrent stage, its chains of groups)."""
    groups, stages, in_turn = [], [], []
    for stage in schedule.stages:
        if stage.kind != "concurrent":
            raise NotImplementedError(f"{stage.kind} stages are not built yet")
        if len(stage.groups) == 1:
            in_turn.extend(ordered[k] for k in stage.groups[0])
            continue
        groups.extend(_runs(in_turn, origin))
        in_turn = []
        chains = [_runs([ordered[k] for k in chain], origin) for chain in stage.groups]
        for chain in chains:
            groups.extend(chain)
        stages.append(chains)
    groups.extend(_runs(in_turn, origin))
    return groups, stages


def was_split(origin: dict) -> int:
    """How many regions ``split_for_schedule`` cut."""
    return len({id(g) for p, g in origin.items() if p is not g})
