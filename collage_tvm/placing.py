"""A new placement, step by step (``search_new``): the op level (measured candidates, the
DP, refined and calibrated), the graph level, and the final check; on RPC servers of
another kind of device, the graph level and the final check run there."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import logging
import math
import time

import tvm

from .byoc import candidate_vm_for, compile_placement, placement_runner
from .check import (first_line, graph_lib_groups, latency_evaluator, never_slower,
                    outputs_on, single_backend_builds, tvm_reference)
from .check.contender import Contender, Fate
from .measure.measurer import Measurer
from .graph import DataflowGraph
from .measure.db import CostDB
from .measure.remote import RemoteDevices, RemoteError
from .options import SearchOptions
from .placer import op_stage
from .placer.graph_level import GraphLevelSearch
from .placer.op_stage import OpLevel
from .precision import CHECK_SEEDS
from .report import BuildReport
from .target import device_fingerprint
from .tuning import active_database

logger = logging.getLogger("collage_tvm")


@dataclass
class Placing:
    """What the stages of a new placement (``placing.search_new``) share: the graph they place, the
    backends it may run on, the target, the cost DB, the search's options, and the report
    each stage writes its record into. ``on(...)``: the same with some of them changed (the
    unrewritten graph, the f32 backends, a report of its own)."""

    graph: DataflowGraph
    backends: dict
    target: tvm.target.Target
    cost_db: CostDB
    options: SearchOptions
    report: BuildReport
    devices: RemoteDevices | None = None  # the search's RPC servers (``SearchState.remote``)

    def on(self, **changed) -> Placing:
        return dataclasses.replace(self, **changed)


def search_new(p: Placing, unrewritten=None, floors: dict | None = None) -> tuple:
    """Both levels of the search and the final check, for a placement not in the log.
    Returns (placement, the graph its groups refer to). ``unrewritten``: the model's graph
    before the rewrites; the final check times its op-level placement too (costs from the
    rewrite search's measurements), and ships it if it is faster. ``floors``: the user's
    model file whole on each graph library (``check.floors.floors_for``); one that wins is
    named in ``report.shipped_floor``."""
    work = _op_level(p)
    if p.report.measured_elsewhere:
        return _judged_there(p, work.placement, floors or {})
    op_level = _calibrated(p, work)
    placement = _graph_level(p, op_level) if p.options.graph_level else op_level
    if p.options.compare:
        others = {}
        if unrewritten is not None:
            t0 = time.perf_counter()
            others["collage-unrewritten"] = (unrewritten, _op_level(
                p.on(graph=unrewritten, report=BuildReport(backends=[]))).placement)
            p.report.times["unrewritten"] = time.perf_counter() - t0
        return final_check(p, placement, floors or {},
                            op_level if placement is not op_level else None, others,
                            scheduled=_scheduled(p, placement))
    if _reduced(placement, p.backends):
        return _within_budget(p, placement, floors)
    return placement, p.graph


def _probe_libraries(p: Placing) -> None:
    """Each graph library's single-backend build runs its regions in the final check's own
    process, and the lean search leaves most of them unmeasured. Those regions are measured
    first, in a child process as every candidate is (the cost DB's record where it has
    one): a library that crashes on one (OpenVINO 2026.4.1 segfaults compiling densenet121
    quantized, where its bf16 variant had crashed on a smaller region) is marked in
    ``report.crashed`` and runs nothing in this process, instead of taking the search down.
    Nothing is probed where candidates are measured in this process anyway
    (``SearchOptions.isolate`` off) or on RPC servers."""
    if not p.options.isolate or p.options.rpc_tracker:
        return
    regions = [g for name, b in p.backends.items()
               if b.kind == "graph" and name not in p.report.crashed
               for g in graph_lib_groups(p.graph, b) if g.backend == name]
    if not regions:
        return
    measurer = Measurer.from_options(p.target, p.cost_db, candidate_vm_for(None), p.options,
                                     progress=False)
    measurer.second_pass = False
    try:  # (timed in full: the DB keeps a cost a later search may use)
        measurer.costs(p.graph, regions, p.backends)
    finally:
        measurer.close()
    for name, why in measurer.crashed.items():
        p.report.crashed.setdefault(name, why)


def _unjudged(p: Placing, placement):
    """``placement`` as the search placed it, for a search whose candidates were measured
    on RPC servers of another kind than this machine (``report.measured_elsewhere``) and
    whose final check is off or could not run on them (``_judged_there``): shipped
    unjudged end to end, with the reason in the report (the graph level's too, where it
    could not run there either)."""
    report = p.report
    why = (f"the candidates were measured on the RPC servers' device "
           f"({report.measured_elsewhere}), not on this machine ({device_fingerprint(p.target)})"
           f", and whole builds are not run there "
           f"({'the servers could not judge them' if p.options.compare else 'compare is off'})")
    logger.warning("%s: shipping the placement by their measurements, unjudged end to end",
                   why)
    if p.options.graph_level and not report.graph_level:
        report.graph_level = {"skipped": why}
    if p.options.compare:
        report.no_floor = f"the final check is off: {why}"
    if _reduced(placement, p.backends):
        logger.warning("reduced-precision groups in the placement: their outputs were not "
                       "checked against f32 (that runs whole builds too)")
    return placement


def _judged_there(p: Placing, placement, floors: dict) -> tuple:
    """The graph level and the final check of a search measured on RPC servers of another
    kind than this machine, run on them (``check.remote``): each placement the graph level
    tries is built and timed on a server; the final check times the placement beside the
    single-backend builds and the user's model file on each graph library on one. (The
    calibration is not run there yet: the op-level placement is not calibrated.) Where no
    server can judge, ``_unjudged``."""
    from .check.remote import remote_evaluator

    op_level = placement
    if p.options.graph_level:
        try:
            placement = _graph_level(p, placement, remote_evaluator(
                p.devices, p.graph, p.backends, p.target, p.options.accuracy, placement.groups))
        except RemoteError as err:  # the final check may still run
            logger.warning("the graph level cannot run on the RPC servers: %s", first_line(err))
            p.report.graph_level = {"skipped": f"no RPC server to run it: {first_line(err)}"}
            placement = op_level
    if not p.options.compare:
        return _unjudged(p, placement), p.graph
    judge = judge_remotely(p)
    try:
        return final_check(p, placement, floors,
                            op_level if placement is not op_level else None, judge=judge)
    except Exception as err:  # noqa: BLE001 - the search's placement ships, unjudged
        logger.warning("the final check on the RPC servers failed: %s", first_line(err))
        return _unjudged(p, placement), p.graph


def judge_remotely(p: Placing):
    """The final check's ``judge`` on the search's RPC servers (``check.remote``)."""
    from .check.remote import remote_judge

    return remote_judge(p.devices, p.graph, p.backends, p.target, p.options.accuracy,
                        (p.report.lean or {}).get("alone_ms"), p.options.final_check)


def _scheduled(p: Placing, placement):
    """``placement`` with the concurrent stages of its measured schedule
    (``schedule.plan``), or None: ``options.schedule`` is "sequential", the plan found no
    concurrent stage, or (under "auto") none measured faster than its groups in turn. The
    plan's figures go into the report."""
    from .placement import order_groups
    from .schedule.plan import plan
    from .schedule.split import remerge, split_for_schedule, was_split
    from .target import host_cores

    mode, report = p.options.schedule, p.report
    if mode == "sequential":
        return None
    if host_cores() < 2:
        report.schedule = {"mode": mode, "why_not": "one core: nothing runs at the same time"}
        return None
    t0 = time.perf_counter()
    # a graph library's region cut at its branches (``schedule.split``): put back together
    # where the schedule runs its pieces in turn
    groups, origin = split_for_schedule(p.graph, placement.groups, p.backends)
    try:
        found = plan(p.graph, groups, p.backends, p.target)
    except Exception as err:  # noqa: BLE001 - the sequential build still ships
        why = first_line(err)
        logger.warning("schedule: the plan failed (%s); the build runs in turn", why)
        report.schedule = {"mode": mode, "why_not": f"the plan failed: {why}"}
        return None
    finally:
        report.times["schedule"] = time.perf_counter() - t0
    report.schedule = {"mode": mode, **found.summary()}
    if len(groups) > len(placement.groups):
        report.schedule["split"] = {"regions": was_split(origin), "pieces": len(groups)}
    if not found.concurrent_stages:
        report.schedule["why_not"] = found.skipped or ("no concurrent stage: " + (
            "no group is on a branch" if not found.branches
            else "none measured faster than its groups in turn"))
        return None
    if mode == "auto" and not found.worth_building:
        report.schedule["why_not"] = (
            f"its stages measured {found.scheduled_ms:.3f} ms against {found.sequential_ms:.3f}"
            " ms in turn: not enough to try")
        return None
    staged, stages = remerge(found.ordered, found.schedule, origin)
    owner = {i: g for g in placement.groups for i in g.nodes}  # (a piece: its region's level)
    chosen = {g: placement.chosen_by.get(owner[min(g.nodes)], "op-level") for g in staged}
    return dataclasses.replace(placement, groups=order_groups(p.graph, staged), stages=stages,
                               chosen_by=chosen)


def final_check(p: Placing, placement, floors: dict, op_level=None, others=None,
                 judge=None, scheduled=None) -> tuple:
    """``never_slower``'s verdict on ``placement``, written into the report (``judge``:
    where the builds are judged, ``_judged_there``; ``scheduled``: the placement with
    concurrent stages, ``_scheduled``). Returns (the placement to ship, the graph its groups
    refer to)."""
    report = p.report
    _probe_libraries(p)
    unsafe = {n: f for n, f in floors.items() if f.backend in report.crashed}
    floors = {n: f for n, f in floors.items() if n not in unsafe}
    verdict = never_slower(p.graph, placement, p.backends, p.target, op_level,
                           accuracy=p.options.accuracy, others=others, floors=floors,
                           alone_ms=(report.lean or {}).get("alone_ms"), judge=judge,
                           settings=p.options.final_check, scheduled=scheduled,
                           force_schedule=p.options.schedule == "concurrent",
                           crashed=report.crashed)
    for name, f in unsafe.items():  # reported, not run
        verdict.comparison[name] = Contender(
            error=f"not built: {report.crashed[f.backend]}", fate=Fate.NOT_BUILT,
            detail=report.crashed[f.backend])
    if scheduled is not None:
        report.schedule["shipped"] = bool(verdict.placement.stages)
    report.shipped, report.comparison = verdict.shipped, verdict.comparison
    report.alternates = [{"backend": b, "ms": ms, **({"source": src} if src else {})}
                         for b, ms, src in verdict.alternates]
    report.shipped_floor = verdict.floor or ""
    report.times["compare"] = verdict.seconds
    report.other_load = verdict.other_load
    # A model file that won ships whole; the log keeps the placement it beat (checked
    # against it again when the verdict is unsure).
    return (placement if verdict.floor else verdict.placement), verdict.graph


OUTSIDE_BUDGET = "collage, reduced precision (outside the accuracy budget)"


def _reduced(placement, backends) -> bool:
    return any(backends[g.backend].precision != "f32" for g in placement.groups)


def _within_budget(p: Placing, placement, floors: dict | None = None) -> tuple:
    """A placement with reduced-precision groups, checked against TVM alone in f32 on the
    random inputs of ``CHECK_SEEDS`` (``compare=True`` does this beside its timings). One
    outside the accuracy budget is not shipped: the search runs again on f32 backends.
    Returns (placement, graph) as ``search_new`` does."""
    t0 = time.perf_counter()
    report = p.report
    reference = tvm_reference(p.graph, p.backends, p.target, CHECK_SEEDS)
    exe, _ = compile_placement(p.graph, placement.groups, p.backends, p.target)
    result = Contender(ms=math.nan)  # checked, not timed
    result.judged(p.options.accuracy.check_seeds(outputs_on(exe, p.graph, p.target, CHECK_SEEDS),
                                                 reference))
    report.times["accuracy"] = time.perf_counter() - t0
    if result.match:
        report.comparison = {"collage": result}
        return placement, p.graph
    logger.warning("the placement's error (%.3g of the output scale) breaks the accuracy "
                   "budget %s: searching again with f32 backends only", result.rel_err,
                   p.options.accuracy)
    report.comparison = {OUTSIDE_BUDGET: result}
    report.shipped = "collage on the f32 backends (the reduced-precision placement broke the budget)"
    f32 = {n: b for n, b in p.backends.items() if b.precision == "f32"}
    return search_new(p.on(backends=f32),
                   floors={n: f for n, f in (floors or {}).items() if f.backend in f32})


def _op_level(p: Placing) -> OpLevel:
    """The op-level stage (``placer.op_stage``) with a ``Measurer`` whose TVM candidates use
    the active tuning database; a search whose RPC servers are of another kind than this
    machine is marked ``measured_elsewhere``."""
    t0 = time.perf_counter()
    tuning = active_database()
    measurer = Measurer.from_options(p.target, p.cost_db, candidate_vm_for(tuning), p.options,
                                     tuning=tuning, remote=p.devices)
    if measurer.remote is not None and measurer.device != device_fingerprint(p.target):
        p.report.measured_elsewhere = measurer.device
    try:
        work, dp_s = op_stage.op_level(p, measurer)
    finally:
        measurer.close()
    op_stage.record(p.report, measurer, work, dp_s, t0)
    return work


def _calibrated(p: Placing, work: OpLevel) -> Placement:
    """``placer.op_stage.calibrated``, its runs of the whole placement through BYOC."""
    return op_stage.calibrated(p, work, lambda: placement_runner(p.graph, p.backends, p.target))


def _graph_level(p: Placing, placement, evaluate=None):
    """The graph-level evolutionary search (``placer.graph_level``) from ``placement``: its
    best placement when that beat the seed end to end, else ``placement``. ``evaluate``:
    how a placement is judged (``check.remote.remote_evaluator``), else built and timed
    here (``latency_evaluator``)."""
    report = p.report
    libs = {n: b for n, b in p.backends.items() if b.kind == "graph" and n not in report.crashed}
    if not libs:
        logger.warning("--graph-level: no graph library among the backends (%s); skipped",
                       ", ".join(p.backends))
        report.graph_level = {"skipped": "no graph library among the backends"}
        return placement
    t0 = time.perf_counter()
    gl = GraphLevelSearch(p.graph, placement, libs, evaluate or latency_evaluator(
        p.graph, p.backends, p.target, p.options.accuracy), call_ms=report.call_overhead)
    timed = _timed_anyway(p, gl, placement)
    if timed:
        logger.info("graph-level: skipped: %s", timed)
        report.graph_level = {"libraries": sorted(libs), "genes": gl.n_genes,
                              "eligible_groups": len(gl.eligible), "skipped": timed}
        return placement
    res = gl.run(budget_s=p.options.budget, on_generation=p.options.on_generation,
                 **dataclasses.asdict(p.options.evolution))
    report.times["graph-level"] = time.perf_counter() - t0
    report.graph_level = {"libraries": sorted(libs), "genes": gl.n_genes,
                          "eligible_groups": len(gl.eligible), "seed_ms": res.seed_ms,
                          "best_ms": res.best_ms, "evaluated": res.evaluated,
                          "bounded": res.bounded,
                          "invalid": len(res.invalid), "stopped": res.stopped,
                          "history": res.history,
                          "invalid_reasons": sorted(set(res.invalid.values()))[:10]}
    if not res.best_ms < res.seed_ms:
        return placement
    return res.placement


def _timed_anyway(p: Placing, gl: GraphLevelSearch, placement) -> str:
    """Why the graph level can be left out: every placement its genes reach (a few
    groups' worth) is one the final check builds and times anyway (the op-level placement
    and the single-backend builds: a one-operator model's graph level only ever builds
    those); "" when it cannot (no final check, more to reach, or a placement of its own)."""
    if not p.options.compare or gl.n_genes == 0:
        return ""
    reach = gl.reachable()
    if reach is None:
        return ""
    timed = {gl.key(groups) for groups in single_backend_builds(p.graph, p.backends).values()}
    if not reach <= timed | {gl.key(placement.groups)}:
        return ""
    return (f"each of the {len(reach)} placements it can reach is a build the final check "
            "times anyway")
