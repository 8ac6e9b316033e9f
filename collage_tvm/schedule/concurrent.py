"""The concurrent build of a schedule (issue #80, part 3): a placement whose stages of
independent groups run at the same time, in one Relax VM executable.

A stage of one group runs as the sequential build runs it (its placed groups inline in
``main``). A stage of several groups becomes one call: each group (a chain of placed groups,
IOS's "operator group") is built alone as a placement of its own nodes, its libraries
lowered for its share of the cores (``target.thread_share``), into a VM of its own; the
stage is a packed function that hands each group's VM to its worker
(``workers.Crew``) and returns every output the rest of the graph reads. In ``main`` the
stage is one more external call (a pseudo-backend ``collage_stage<n>`` through the BYOC
path every library region takes), so the executable is an ordinary Relax VM executable.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from tvm import relax

from ..graph import DataflowGraph
from ..graph.subgraph import extract_function, extracted_nodes
from ..lowering import Lowering
from ..placement import Candidate, order_groups
from ..registry import Backend
from ..target import host_cores, target_device, thread_share
from .workers import Crew, split_cores

STAGE_PREFIX = "collage_stage"
_STAGES = itertools.count()


@dataclass
class Part:
    """One group of a concurrent stage: placed groups run one after another, built alone
    as ``run(*inputs) -> outputs`` (a list), on ``share`` threads."""
    nodes: frozenset
    inputs: list   # what each argument is (``extract_function``'s inputs)
    outputs: list  # the graph nodes its results are, in order
    run: object
    share: int
    func: object = None  # the group's function (its parameters: the inputs)
    vm: object = None  # keeps the executable's VM (and its library callables) alive
    # what ``collage_tvm.save`` writes of it (kept by ``keep``): its executable and the
    # lowered module whose external callables it calls
    executable: object = None
    lowered: object = None


def build_part(graph, groups, backends: dict, target, share: int, keep: bool = False) -> Part:
    """``groups`` (placed groups, connected, in an executable order) built alone into a VM
    whose libraries use ``share`` threads. ``keep``: the part can be saved (its callables'
    recipes kept with its executable)."""
    from ..byoc import compile_placement

    nodes = frozenset(i for g in groups for i in g.nodes)
    func, inputs, outputs, _ = extract_function(graph, nodes)
    sub = DataflowGraph(func)
    kept = extracted_nodes(graph, nodes)
    if len(kept) != len(sub) or any(graph.nodes[i].op_name != sub.nodes[k].op_name
                                    for k, i in enumerate(kept)):
        raise ValueError("a stage group's function does not match its nodes")
    local = {i: k for k, i in enumerate(kept)}
    mapped = []
    for g in groups:
        mine = frozenset(local[i] for i in g.nodes if i in local)
        if mine:
            mapped.append(Candidate(g.backend, mine, g.label))
    with thread_share(share):
        executable, lowered = compile_placement(sub, mapped, backends, target, keep=keep)
    vm = relax.VirtualMachine(executable, target_device(target))
    main = vm["main"]
    if len(outputs) == 1:
        def run(*args):
            return [main(*args)]
    else:
        def run(*args):
            return list(main(*args))
    return Part(nodes, inputs, outputs, run, share, func, vm,
                executable if keep else None, lowered if keep else None)


class _StageLowering(Lowering):
    """The stage's callable, made before ``main`` is partitioned: ``lower`` hands it out."""
    name = "stage"

    def __init__(self, fn):
        self.fn = fn

    def version(self) -> str:
        return "stage"

    def lower(self, func):
        return self.fn


def stage_callable(graph, parts: list[Part]):
    """(the stage's nodes, ``fn(*inputs) -> outputs``): the stage of ``parts`` (its inputs
    and outputs as ``extract_function`` cuts the union of their nodes), running the parts at
    once."""
    nodes = frozenset().union(*(p.nodes for p in parts))
    _, inputs, outputs, _ = extract_function(graph, nodes)
    slot = {_input_key(v): k for k, v in enumerate(inputs)}
    picks = [[slot[_input_key(v)] for v in p.inputs] for p in parts]
    where = {}
    for j, p in enumerate(parts):
        for m, i in enumerate(p.outputs):
            where[i] = (j, m)
    gather = [where[i] for i in outputs]
    fn = run_stage([p.run for p in parts], [p.share for p in parts], picks, gather)
    fn.parts = parts
    return nodes, fn


def run_stage(runs: list, shares: list, picks: list, gather: list):
    """``fn(*inputs) -> outputs`` running ``runs`` at once, run ``j`` on ``shares[j]``
    threads with the stage's inputs ``picks[j]``; its outputs are ``gather``'s (part,
    output) pairs (one: that output alone). What the build and a loaded build
    (``artifact.load``) both call."""
    crew = Crew(list(shares))
    single = len(gather) == 1

    def stage(*args):
        results = crew.run([(run, [args[k] for k in pick]) for run, pick in zip(runs, picks)])
        outs = [results[j][m] for j, m in gather]
        return outs[0] if single else outs

    stage.crew = crew
    stage.shares, stage.picks, stage.gather = list(shares), picks, gather
    return stage


def _input_key(v):
    return (v[0], v[1]) if isinstance(v, tuple) else (v, None)


def chains_of(ordered: list, schedule) -> list:
    """The concurrent stages of ``schedule`` (over ``ordered``'s groups) as
    ``Placement.stages`` holds them: per stage, its chains of placed groups."""
    stages = []
    for stage in schedule.stages:
        if stage.kind != "concurrent":
            raise NotImplementedError(f"{stage.kind} stages are not built yet")
        if len(stage.groups) > 1:
            stages.append([[ordered[k] for k in chain] for chain in stage.groups])
    return stages


def staged_groups(graph, groups: list, stages: list, backends: dict, target,
                  cores: int | None = None, keep: bool = False):
    """(groups, backends) for ``compile_placement``: the placement ``groups`` with each
    concurrent stage of ``stages`` (``Placement.stages``: chains of its groups) made one
    group on a stage pseudo-backend of its own."""
    cores = cores or host_cores()
    staged = {g for stage in stages for chain in stage for g in chain}
    if not staged <= set(groups):
        raise ValueError("a stage names a group the placement does not have")
    out, extra = [g for g in groups if g not in staged], dict(backends)
    for stage in stages:
        shares = split_cores(cores, len(stage))
        parts = [build_part(graph, chain, backends, target, share, keep)
                 for chain, share in zip(stage, shares)]
        nodes, fn = stage_callable(graph, parts)
        name = f"{STAGE_PREFIX}{next(_STAGES)}"
        extra[name] = Backend(name, kind="stage", lowering=_StageLowering(fn))
        out.append(Candidate(name, nodes, "stage:" + " | ".join(
            "+".join(g.backend for g in chain) for chain in stage)))
    return order_groups(graph, out), extra


def compile_scheduled(graph, ordered: list, schedule, backends: dict, target,
                      cores: int | None = None, keep: bool = True):
    """(executable, lowered module) of the placement ``ordered`` run by ``schedule`` (over
    ``ordered``'s groups, ``group_dag``'s order)."""
    return compile_staged(graph, ordered, chains_of(ordered, schedule), backends, target,
                          keep, cores)


def compile_staged(graph, groups: list, stages: list, backends: dict, target,
                   keep: bool = False, cores: int | None = None):
    """(executable, lowered module) of the placement ``groups`` whose ``stages`` run
    concurrently (``Placement.stages``); no stages: the sequential build."""
    from ..byoc import compile_placement

    if not stages:
        return compile_placement(graph, groups, backends, target, keep=keep)
    staged, extra = staged_groups(graph, groups, stages, backends, target, cores, keep)
    return compile_placement(graph, staged, extra, target, keep=keep)


def is_stage(backend: str) -> bool:
    """Whether ``backend`` names a concurrent stage's pseudo-backend."""
    return backend.startswith(STAGE_PREFIX)
