"""A measured schedule for a placement (issue #80, parts 1 and 2): which of its groups run at
the same time, from their measured costs.

The graph's nodes are the placement's groups (``group_dag``). A group comparable to every
other one (on the path every run takes: a ResNet's trunk) can only ever run in a stage of
its own, so its cost is the same in every schedule and it is not measured. Each other group
(a branch) is built alone and timed on every core and on each share a concurrent stage
would give it (``workers.split_cores``; on 2 cores: 1 thread), in a worker set up as the
stage's would be. The dynamic program (``ios.schedule``) then runs on estimates: a stage of
one group costs the sum of its groups on every core; a concurrent stage the longest of its
groups on their shares plus the measured hand-off to the workers. Each concurrent stage the
program picks is then built and timed as it will run (its groups at once, on their workers),
its measured cost replaces the estimate, and the program runs again, until every concurrent
stage of its answer is measured (as ``placer.lean`` refines a placement). What it returns is
the schedule and both costs; whether the concurrent build ships is the final check's to say
(it times the whole build beside the sequential one).
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field

from ..graph.subgraph import extract_function, random_inputs
from ..target import host_cores
from .concurrent import build_part, stage_callable
from .ios import MAX_GROUP_OPS, Schedule, Stage, schedule, sequential, topological_order
from .placed import group_dag
from .workers import Crew, split_cores

log = logging.getLogger("collage_tvm")

#: IOS's max_part_size: the DP runs on parts of this many groups of the topological order.
MAX_PART = 48
#: Rounds of "schedule on estimates, measure its concurrent stages" at most.
MAX_REFINE = 6
#: Groups on branches the plan times at most (each is built and timed alone on every share):
#: a placement with more is run in turn, the plan saying why.
MAX_BRANCHES = 64
#: A concurrent schedule is worth building when its measured cost is this much under the
#: sequential one's (what the estimate cannot see, the final check's timing does).
WORTH = 0.03


@dataclass
class Plan:
    """The schedule chosen for a placement and what it was chosen from."""
    ordered: list                 # the placement's groups, the DAG's nodes
    succ: list                    # their successors
    schedule: Schedule            # the chosen one (its cost: measured where concurrent)
    sequential_ms: float          # the branches one after another, measured alone
    scheduled_ms: float           # the same branches under ``schedule``
    branches: list = field(default_factory=list)   # the groups that may run concurrently
    group_ms: dict = field(default_factory=dict)   # group -> {threads: ms}
    stage_ms: dict = field(default_factory=dict)   # Stage.key -> measured ms
    handoff_ms: dict = field(default_factory=dict)  # groups in a stage -> ms to hand off
    rounds: int = 0
    seconds: float = 0.0
    skipped: str = ""  # why nothing was timed, where the plan gave up before measuring

    @property
    def concurrent_stages(self) -> list:
        return [s for s in self.schedule.stages if len(s.groups) > 1]

    @property
    def worth_building(self) -> bool:
        return bool(self.concurrent_stages) and \
            self.scheduled_ms < (1 - WORTH) * self.sequential_ms

    def summary(self) -> dict:
        return {"groups": len(self.ordered), "branches": len(self.branches),
                "stages": len(self.schedule.stages),
                "concurrent_stages": [s.key for s in self.concurrent_stages],
                "sequential_ms": round(self.sequential_ms, 4),
                "scheduled_ms": round(self.scheduled_ms, 4),
                "rounds": self.rounds, "seconds": round(self.seconds, 2),
                **({"skipped": self.skipped} if self.skipped else {})}


def branch_groups(succ) -> list[int]:
    """The nodes of the DAG ``succ`` with at least one node neither before nor after them."""
    n = len(succ)
    order = topological_order(succ)
    after = [0] * n   # bitset of the nodes reachable from each
    before = [0] * n  # bitset of the nodes each is reachable from
    for k in reversed(order):
        for j in succ[k]:
            after[k] |= after[j] | (1 << j)
    for k in order:
        for j in succ[k]:
            before[j] |= before[k] | (1 << k)
    everyone = (1 << n) - 1
    return [k for k in range(n) if (after[k] | before[k] | (1 << k)) != everyone]


def _batch_ms(fn, args, target_ms: float = 2.0, batches: int = 5) -> float:
    """Median ms per call of ``fn(*args)`` over ``batches`` batches of about ``target_ms``."""
    fn(*args)
    fn(*args)
    t0 = time.perf_counter()
    fn(*args)
    once = max((time.perf_counter() - t0) * 1e3, 1e-3)
    number = max(1, int(target_ms / once))
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(number):
            fn(*args)
        samples.append((time.perf_counter() - t0) * 1e3 / number)
    return statistics.median(samples)


def _time_on(threads: int, cores: int, fn, args) -> float:
    """ms per call of ``fn(*args)`` on a worker limited to ``threads`` (on this thread,
    as the VM runs a stage of one group, when it is every core)."""
    if threads >= cores:
        return _batch_ms(fn, args)
    crew = Crew([threads])
    try:
        (ms,) = crew.run([(_batch_ms, (fn, args))])
    finally:
        crew.close()
    return ms


def _handoff_ms(parts: int) -> float:
    """ms to hand ``parts`` empty calls to a stage's workers and collect them."""
    crew = Crew([1] * parts)
    calls = [(_noop, ())] * parts
    try:
        return _batch_ms(lambda: crew.run(calls), (), target_ms=1.0)
    finally:
        crew.close()


def _noop():
    return None


def plan(graph, groups, backends: dict, target, cores: int | None = None,
         max_groups: int | None = None, max_group_ops: int = MAX_GROUP_OPS,
         max_part: int = MAX_PART, progress=None) -> Plan:
    """The measured schedule of the placement ``groups`` on ``graph``: see the module."""
    start = time.perf_counter()
    cores = cores or host_cores()
    ordered, succ = group_dag(graph, groups)
    branches = branch_groups(succ)
    width = max(2, min(cores, max_groups or cores))
    if not branches or cores < 2 or len(branches) > MAX_BRANCHES:
        seq = sequential(succ)
        why = (f"{len(branches)} groups on branches, more than the {MAX_BRANCHES} the plan "
               "times" if len(branches) > MAX_BRANCHES else "")
        return Plan(ordered, succ, seq, 0.0, 0.0, branches, seconds=time.perf_counter() - start,
                    skipped=why)
    shares = sorted({s for m in range(2, width + 1) for s in split_cores(cores, m)} | {cores})
    group_ms: dict = {}
    for n, k in enumerate(branches):
        part = build_part(graph, [ordered[k]], backends, target, cores)
        args = _random_tensors(part.func)
        group_ms[k] = {cores: _time_on(cores, cores, part.run, args)}
        # a TVM kernel is the same build on any share (its worker sets its threads); a
        # library's is made for its share
        external = backends[ordered[k].backend].is_external
        for s in shares:
            if s < cores:
                low = build_part(graph, [ordered[k]], backends, target, s) if external else part
                group_ms[k][s] = _time_on(s, cores, low.run, args)
        if progress is not None:
            progress(n + 1, len(branches))
    handoff = {m: _handoff_ms(m) for m in range(2, width + 1)}
    measured: dict = {}
    branch_set = set(branches)

    guessed: dict = {}  # Stage.key -> the estimate a measured stage had
    only_measured = False

    def alone(stage: Stage) -> float:
        split = split_cores(cores, len(stage.groups))
        return handoff[len(stage.groups)] + max(
            sum(group_ms[k][s] for k in chain) for chain, s in zip(stage.groups, split))

    def estimate(stage: Stage) -> float:
        if stage.key in measured:
            return measured[stage.key]
        if len(stage.groups) == 1:
            return sum(group_ms[k][cores] for k in stage.groups[0] if k in branch_set)
        if only_measured:
            return math.inf
        # the groups slow each other down (memory, caches): by what the stages measured
        # so far showed, never less than their times alone
        ratios = [measured[key] / guessed[key] for key in measured if guessed[key] > 0]
        return alone(stage) * max(1.0, statistics.median(ratios) if ratios else 1.0)

    best, rounds = None, 0
    for rounds in range(1, MAX_REFINE + 2):
        only_measured = rounds > MAX_REFINE  # the last word: measured stages only
        best = schedule(succ, estimate, max_groups=width, max_group_ops=max_group_ops,
                        max_part=max_part)
        fresh = [s for s in best.stages if len(s.groups) > 1 and s.key not in measured]
        if not fresh:
            break
        for stage in fresh:
            guessed[stage.key] = alone(stage)
            measured[stage.key] = _measure_stage(graph, ordered, stage, backends, target, cores)
    seq_ms = sum(group_ms[k][cores] for k in branches)
    scheduled_ms = sum(estimate(s) for s in best.stages)
    result = Plan(ordered, succ, best, seq_ms, scheduled_ms, branches, group_ms, measured,
                  handoff, rounds, time.perf_counter() - start)
    log.info("schedule: %d of %d groups on branches; sequential %.3f ms, concurrent %.3f ms "
             "(%d concurrent stages, %d rounds, %.1f s)", len(branches), len(ordered), seq_ms,
             scheduled_ms, len(result.concurrent_stages), rounds, result.seconds)
    return result


def _random_tensors(func) -> list:
    """TVM tensors of random values for the parameters of ``func``."""
    import tvm

    return [tvm.runtime.tensor(a) for a in random_inputs(func, seed=1)]


def _measure_stage(graph, ordered, stage: Stage, backends, target, cores: int) -> float:
    """ms per call of ``stage`` built as the concurrent build runs it."""
    split = split_cores(cores, len(stage.groups))
    parts = [build_part(graph, [ordered[k] for k in chain], backends, target, s)
             for chain, s in zip(stage.groups, split)]
    nodes, fn = stage_callable(graph, parts)
    args = _random_tensors(extract_function(graph, nodes)[0])
    try:
        return _batch_ms(fn, args)
    finally:
        fn.crew.close()
