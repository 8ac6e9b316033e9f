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
from ..placement import Candidate
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


def build_part(graph, groups, backends: dict, target, share: int) -> Part:
    """``groups`` (placed groups, connected, in an executable order) built alone into a VM
    whose libraries use ``share`` threads."""
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
        executable, _ = compile_placement(sub, mapped, backends, target, keep=True)
    vm = relax.VirtualMachine(executable, target_device(target))
    main = vm["main"]
    if len(outputs) == 1:
        def run(*args):
            return [main(*args)]
    else:
        def run(*args):
            return list(main(*args))
    return Part(nodes, inputs, outputs, run, share, func, vm)


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
    """``fn(*inputs) -> outputs`` of the stage of ``parts`` (its inputs and outputs as
    ``extract_function`` cuts the union of their nodes), running the parts at once."""
    nodes = frozenset().union(*(p.nodes for p in parts))
    _, inputs, outputs, _ = extract_function(graph, nodes)
    slot = {_input_key(v): k for k, v in enumerate(inputs)}
    picks = [[slot[_input_key(v)] for v in p.inputs] for p in parts]
    where = {}
    for j, p in enumerate(parts):
        for m, i in enumerate(p.outputs):
            where[i] = (j, m)
    gather = [where[i] for i in outputs]
    crew = Crew([p.share for p in parts])
    runs = [p.run for p in parts]
    single = len(outputs) == 1

    def stage(*args):
        results = crew.run([(run, [args[k] for k in pick]) for run, pick in zip(runs, picks)])
        outs = [results[j][m] for j, m in gather]
        return outs[0] if single else outs

    stage.crew = crew
    stage.parts = parts
    return nodes, stage


def _input_key(v):
    return (v[0], v[1]) if isinstance(v, tuple) else (v, None)


def scheduled_groups(graph, ordered: list, schedule, backends: dict, target,
                     cores: int | None = None):
    """(groups, backends) for ``compile_placement``: ``ordered``'s placed groups (the DAG
    nodes of ``schedule``, ``group_dag``'s order) with each concurrent stage of ``schedule``
    made one group on a stage pseudo-backend of its own."""
    cores = cores or host_cores()
    groups, extra = [], dict(backends)
    for stage in schedule.stages:
        if stage.kind != "concurrent":
            raise NotImplementedError(f"{stage.kind} stages are not built yet")
        if len(stage.groups) == 1:
            groups.extend(ordered[k] for k in stage.groups[0])
            continue
        shares = split_cores(cores, len(stage.groups))
        parts = [build_part(graph, [ordered[k] for k in chain], backends, target, share)
                 for chain, share in zip(stage.groups, shares)]
        nodes, fn = stage_callable(graph, parts)
        name = f"{STAGE_PREFIX}{next(_STAGES)}"
        extra[name] = Backend(name, kind="graph", lowering=_StageLowering(fn))
        groups.append(Candidate(name, nodes, "stage:" + stage.key))
    return groups, extra


def compile_scheduled(graph, ordered: list, schedule, backends: dict, target,
                      cores: int | None = None):
    """(executable, lowered module) of the placement ``ordered`` run by ``schedule``."""
    from ..byoc import compile_placement

    groups, extra = scheduled_groups(graph, ordered, schedule, backends, target, cores)
    return compile_placement(graph, groups, extra, target, keep=True)
