"""The final check (docs/DESIGN.md, "The final check"): the placement timed end to end
beside every single-backend build made in the same run and the user's model file run whole
by each graph library; the fastest correct one is shipped.

Its steps, top to bottom (``never_slower``, ``judge_builds``):

1. the contenders (``_builds``): the placement, its op-level placement, the single-backend
   builds, the floors (``check.floors``);
2. each built and timed once, outputs kept (``_time_builds``), in an order that builds the
   reference early (``check.reference``), short of memory narrowed (``check.memory``);
3. outputs checked against the reference (``_check_outputs``);
4. the close calls timed again side by side, a runoff, the open ones settled
   (``check.runoff``), once more on a busy machine;
5. the fastest correct one shipped (``_ship``), with advice and at-load alternates.

Each contender is a ``check.contender.Contender``; the thresholds an
``options.FinalCheck`` passed in.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from .._memory import release_memory
from ..byoc import compile_placement
from ..measure.estimate import node_flops
from ..measure.other_load import BUSY_SHARE, OtherLoad
from ..options import final_check_settings
from ..placement import Placement
from ..precision import CHECK_SEEDS, INT8_MODEL, parse_accuracy
from . import memory, runoff
from .baselines import single_backend_builds
from .contender import Contender, Fate, from_records
from .evaluate import evaluate, first_line, outputs_on
from .floors import alternates, same_file_runs
from .reference import build_order, reference

logger = logging.getLogger("collage_tvm")

#: The contender that runs the placement's concurrent stages at once (``collage_tvm.schedule``).
CONCURRENT = "collage-concurrent"


@dataclass
class Verdict:
    placement: Placement   # what to ship
    shipped: str = "collage"
    comparison: dict = field(default_factory=dict)  # build name -> ``Contender``
    seconds: float = 0.0
    graph: object = None   # the dataflow graph the shipped placement's groups refer to
    floor: str | None = None  # a floor won: its backend runs the user's model file whole
    # The share of the machine's CPU other processes took while the builds were timed
    # (``measure.other_load.OtherLoad``); above ``BUSY_SHARE`` the verdict is unsure.
    other_load: float = math.nan
    # The shipped build runs one file whole on a graph library (the user's model file, or
    # the model as one exported region): its at-load alternates (``floors.alternates``),
    # (backend, ms, source) each, fastest first. The saved build's first calls race them
    # where it is served (``check.race``).
    alternates: list = field(default_factory=list)

    @property
    def unsure(self) -> bool:
        return self.other_load > BUSY_SHARE


def never_slower(graph, placement: Placement, backends: dict, target,
                 op_level: Placement | None = None, accuracy=None,
                 others: dict | None = None, floors: dict | None = None,
                 alone_ms: dict | None = None, judge=None, settings=None,
                 scheduled: Placement | None = None, force_schedule: bool = False,
                 crashed: dict | None = None) -> Verdict:
    """Time the placement end to end beside every single-backend build; ship the fastest.

    Builds: "tvm-only" (TVM's own fusion); "<lib>+tvm" for each external op library (its
    patterns offloaded greedily, TVM for the rest); "<lib>" for each graph library that
    can run the whole model ("<lib>+tvm" when some operators stay on TVM); and the
    op-level placement when the graph-level search changed it; and ``others``: name ->
    (graph, placement) on another graph of the same model (the unrewritten one when the
    rewrites changed it: ``Verdict.graph`` says which graph the shipped one is on); and
    ``floors``: name -> ``floors.Floor``, the user's model file run whole by a graph
    library (one that wins ships as ``Verdict.floor``). ``alone_ms``: single-backend build
    name -> the least it can take by the search's measurements (``placer.lean``); one past
    ``alone_factor`` times collage's first time is not built. Outputs are checked against
    tvm-only (f32): per element (rtol 1e-3) under the strict budget; under another
    ``accuracy`` (``precision.Accuracy``) on the random inputs of ``CHECK_SEEDS``, each
    build within the budget, its error against f32 reported (``rel_err``: of the scale).
    ``judge``: ``(builds, floors) -> (results, other_load)`` where the builds are judged
    elsewhere (``remote_judge``: on the RPC servers of a search for another device), else
    ``judge_builds`` here. ``settings``: the thresholds (``options.FinalCheck``).
    ``scheduled``: the placement with concurrent stages (``Placement.stages``), timed as
    ``CONCURRENT`` (here only, not by a ``judge`` elsewhere); ``force_schedule``: it ships
    whenever its outputs match (the others timed beside it for the report).
    ``crashed``: backend -> why, libraries that crashed a measuring process on this model:
    no single-backend build of theirs is run here (reported as not built).
    """
    s = final_check_settings(settings)
    accuracy = parse_accuracy(accuracy)
    t0 = time.perf_counter()
    floors, others = floors or {}, others or {}
    builds, graph_of = _builds(graph, placement, backends, op_level, others, floors)
    shown, failed = {}, {}
    for name, why in _unsafe(builds, crashed or {}).items():
        del builds[name], graph_of[name]
        failed[name] = Contender(error=f"not built: {why}", fate=Fate.NOT_BUILT, detail=why)
    if scheduled is not None and judge is None:
        backends, unbuilt = _add_scheduled(builds, graph_of, shown, graph, scheduled,
                                           backends, target)
        failed.update(unbuilt)
    if judge is None:
        results, share = judge_builds(builds, graph_of, floors, backends, target, accuracy,
                                      alone_ms, s, shown)
        # The builds timed are garbage now: their pages go back before what ships is built
        # (ViT-L/32 under bf16 held 22 GB of them, and the next step added 2 GB more).
        release_memory()
    else:
        results, share = judge(builds, floors)
        results = from_records(results)
    results.update(failed)
    verdict = Verdict(placement, "collage", results, time.perf_counter() - t0, graph,
                      other_load=share)
    if verdict.unsure:
        logger.warning("end to end: other processes took %.0f%% of this machine's CPU while "
                       "the builds were timed: the verdict is unsure (the next build checks "
                       "it again)", 100 * share)
    outside = {n for n, f in floors.items() if f.budget is not None}
    for name in outside & set(results):
        results[name].outside_budget = str(floors[name].budget)
    ok = {n: r.ms for n, r in results.items() if r.can_ship}
    if not ok:  # nothing agrees with the reference, not even itself: nothing to choose
        ref = next((n for n, r in results.items() if r.reference), "the reference")
        logger.warning("end to end: no build's outputs match %s's; keeping the placement", ref)
        return verdict
    best = min(ok, key=ok.get)
    forced = results.get(CONCURRENT) if force_schedule else None
    if forced is not None and forced.match and forced.fate not in (Fate.FAILED, Fate.NOT_BUILT):
        best = CONCURRENT  # asked for: timed for the report, not judged (outrun or not)
        ok[best] = forced.ms
    _advise(results, outside, ok[best])
    if best != "collage" and (ok[best] < ok.get("collage", math.inf) or best == CONCURRENT):
        how = ("beat" if ok[best] < ok.get("collage", math.inf)
               else "was asked for (--schedule concurrent); it ran beside")
        logger.warning("%s (%.3f ms) %s the collage placement (%.3f ms): shipping %s", best,
                       ok[best], how, results["collage"].ms, best)
        _ship(verdict, best, builds, op_level, others, floors, scheduled)
    elif "collage" not in ok:
        return verdict
    verdict.alternates = alternates(verdict.shipped, ok, same_file_runs(
        builds, graph_of, floors, backends), s.at_load_share)
    return verdict


def _unsafe(builds: dict, crashed: dict) -> dict:
    """name -> why, of the single-backend builds of a library in ``crashed`` (the placement
    and its variants keep the regions of it that were measured without a crash)."""
    out = {}
    for name in builds:
        lib = name[:-len("+tvm")] if name.endswith("+tvm") else name
        if lib in crashed:
            out[name] = crashed[lib]
    return out


def _add_scheduled(builds, graph_of, shown, graph, scheduled, backends, target):
    """The concurrent build of ``scheduled`` among the contenders (``CONCURRENT``): its stages
    built (each a pseudo-backend, ``schedule.concurrent.staged_groups``). Returns (the
    backends with the stages', {CONCURRENT: a failed contender} when its stages could not be
    built)."""
    from ..schedule.concurrent import staged_groups

    try:
        staged, with_stages = staged_groups(graph, scheduled.groups, scheduled.stages,
                                            backends, target)
    except Exception as err:  # noqa: BLE001 - the sequential build is still a contender
        reason = first_line(err)
        logger.warning("end to end: %s could not be built: %s", CONCURRENT, reason)
        return backends, {CONCURRENT: Contender(error=reason, fate=Fate.FAILED)}
    builds[CONCURRENT], graph_of[CONCURRENT] = staged, graph
    shown[CONCURRENT] = scheduled.groups
    return with_stages, {}


def judge_builds(builds: dict, graph_of: dict, floors: dict, backends: dict, target,
                 accuracy, alone_ms: dict | None = None, settings=None,
                 shown: dict | None = None) -> tuple[dict, float]:
    """Build, check and time the contenders (``builds``: name -> groups on ``graph_of[name]``,
    None for a ``floors`` entry) on this machine: (name -> ``Contender``, the share of the
    CPU other processes took meanwhile). The final check's measuring half
    (``never_slower``); an RPC server runs it for a search on another kind of device
    (``check.remote``). ``accuracy``: the search's budget, a ``precision.Accuracy``."""
    s = final_check_settings(settings)
    weights = max(memory.weight_bytes(g) for g in {id(g): g for g in graph_of.values()}.values())
    outside = {n for n, f in floors.items() if f.budget is not None}
    with OtherLoad() as load:
        results, outputs, runs = _time_builds(builds, graph_of, floors, backends, target,
                                              accuracy, weights, alone_ms, s, shown or {})
        _check_outputs(results, outputs, builds, floors, accuracy)
        runoff.retime(results, runs, outside, target, s)
    share = load.share
    if share > s.retry_share and len(runoff.correct_ms(results, runs, outside)) > 1:
        share = runoff.retime_when_busy(results, runs, outside, target, s, share)
    results = {n: (results[results[n].same_as].copy(same_as=results[n].same_as)
                   if results[n].same_as else results[n])
               for n in ["tvm-only", *builds] if n in results}
    return results, share


def _check_outputs(results, outputs, builds, floors, accuracy) -> None:
    """Each build's outputs checked against the reference's (``reference.reference``),
    within its budget (a floor's own where it has one)."""
    ref = reference(results, builds, floors, quantized=accuracy.name == INT8_MODEL)
    for name, out in outputs.items():
        results[name].judged(_budget_of(name, floors, accuracy).check_seeds(out, outputs[ref]))
    results[ref].reference = True  # what the others' outputs were checked against


def _builds(graph, placement, backends, op_level, others, floors) -> tuple[dict, dict]:
    """The contenders: name -> groups (None: a floor, run whole from the user's file), and
    name -> the graph each is on."""
    builds = {"collage": placement.groups}
    if op_level is not None:
        builds["collage-op-level"] = op_level.groups
    builds.update(single_backend_builds(graph, backends))
    graph_of = {name: graph for name in builds}
    for name, (other_graph, other) in others.items():
        builds[name], graph_of[name] = other.groups, other_graph
    for name in floors:
        builds[name], graph_of[name] = None, graph
    return builds, graph_of


def _time_builds(builds, graph_of, floors, backends, target, accuracy, weights,
                 alone_ms, s, shown):
    """Build and time each contender once, keep its outputs (on the check's seeds too) and
    its run. Collage first: its time sets the cutoff beyond which a build is timed once
    only (an untuned TVM build of a big model can take minutes per run). A build that is
    the same placement as an earlier one is recorded as ``same_as`` it. Returns (results,
    outputs, runs)."""
    seeds = CHECK_SEEDS[1:] if not accuracy.strict else ()
    alone_ms = alone_ms or {}
    results, outputs, runs, seen = {}, {}, {}, {}
    cutoff = None
    for name in build_order(builds, floors):
        same = seen.setdefault(name if name in floors else (
            id(graph_of[name]), frozenset((g.backend, g.nodes) for g in builds[name])), name)
        if same != name:  # e.g. the two-level search chose the whole model on one library
            results[name] = Contender(same_as=same)
            logger.info("end to end: %s is the same placement as %s", name, same)
            continue
        if runs and memory.memory_short(weights, s):
            memory.make_room(runs, results, outputs, builds, accuracy, target, floors,
                             weights, s)
        why = (_hopeless_by_estimate(alone_ms.get(name), cutoff, s)
               or _hopeless_like_tvm_only(graph_of[name], builds[name], results, cutoff, s))
        if why:
            logger.info("end to end: %s not built: %s", name, why)
            results[name] = Contender(error=f"not built: {why}", fate=Fate.NOT_BUILT,
                                      detail=why, estimate_ms=alone_ms.get(name))
            continue
        t_build = time.perf_counter()
        try:
            if name in floors:
                executable = floors[name].build()
            else:
                executable, _ = compile_placement(graph_of[name], builds[name], backends, target)
            r = evaluate(executable, graph_of[name], target, cutoff_ms=cutoff,
                         first_run_counts=builds[name] is not None
                         and all(g.backend == "tvm" for g in builds[name]))
        except Exception as err:  # noqa: BLE001 - a failing baseline is reported, not fatal
            if name == "collage":
                raise  # (TVM alone failing: another build is the reference, ``reference``)
            reason = first_line(err)
            logger.warning("end to end: %s failed to build or run: %s", name, reason)
            results[name] = Contender(error=reason, fate=Fate.FAILED)
            continue
        if cutoff is None:
            cutoff = s.slow_build_factor * r["ms"]
        outputs[name] = [r["outputs"]] + outputs_on(executable, graph_of[name], target, seeds)
        results[name] = _timed(r, shown.get(name, builds[name]))
        runs[name] = r["run"]
        logger.info("end to end: %s %.3f ms%s (built, checked and timed in %.1f s)", name,
                    r["ms"], " (timed once: hopeless)" if r["timed_once"] else "",
                    time.perf_counter() - t_build)
        del executable, r  # held by its run alone: ``memory.narrow`` can free it
    return results, outputs, runs


def _hopeless_by_estimate(estimate, cutoff, s) -> str | None:
    """Why a single-backend build need not be built, or None: the least the search found it
    can take (``estimate``) is past ``s.alone_factor`` times collage's first time
    (``cutoff`` is ``s.slow_build_factor`` times that; None: collage failed, build
    everything) and past ``s.alone_min_ms``."""
    if estimate is None or cutoff is None or not math.isfinite(estimate):
        return None
    first = cutoff / s.slow_build_factor
    if not estimate > max(s.alone_factor * first, s.alone_min_ms):
        return None
    return (f"it takes at least {estimate:.1f} ms by the search's measurements, "
            f"over {s.alone_factor:g}x the placement's {first:.1f} ms")


def _hopeless_like_tvm_only(graph, groups, results: dict, cutoff, s) -> str | None:
    """Why a "<lib>+tvm" build cannot win without building it, or None: tvm-only was
    hopeless (timed once past ``cutoff``, or not built: its estimate was past it), and the
    build's TVM kernels do most of its work (``s.hopeless_share`` of the FLOPs), enough to
    take longer than ``cutoff`` at tvm-only's rate (an untuned TVM build of a big model takes
    seconds to build and run once; a library's few matrix products do not change that)."""
    tvm_only = results.get("tvm-only")
    tvm_ms = None if tvm_only is None else (
        tvm_only.ms if tvm_only.timed_once else tvm_only.estimate_ms)
    if groups is None or cutoff is None or tvm_ms is None \
            or not any(g.backend == "tvm" for g in groups) \
            or all(g.backend == "tvm" for g in groups):
        return None
    flops = [node_flops(n) for n in graph.nodes]
    total = sum(flops)
    on_tvm = sum(flops[i] for g in groups if g.backend == "tvm" for i in g.nodes)
    estimate = tvm_ms * on_tvm / max(total, 1)
    if on_tvm < s.hopeless_share * total or estimate <= cutoff:
        return None
    return (f"its TVM kernels do {on_tvm / max(total, 1):.1%} of the model's FLOPs: about "
            f"{estimate:.0f} ms at tvm-only's rate, past the {cutoff:.0f} ms a build must beat "
            f"to be timed")


def _timed(r: dict, groups) -> Contender:
    """One build timed once (``evaluate``'s result): its time, its ops per backend, how it
    ran."""
    return Contender(ms=r["ms"], ops=None if groups is None else ops_per_backend(groups),
                     cuda_graph=r["cuda_graph"], timed_once=bool(r["timed_once"]))


def _ship(verdict, best, builds, op_level, others, floors, scheduled=None) -> None:
    """``best`` beat the placement: the verdict ships it."""
    verdict.shipped = best
    if best == CONCURRENT:
        verdict.placement = scheduled
    elif best in floors:
        verdict.floor = floors[best].backend
        verdict.placement = Placement([], math.nan)
    elif best == "collage-op-level":
        verdict.placement = op_level
    elif best in others:
        verdict.graph, verdict.placement = others[best]
    else:
        groups = builds[best]
        verdict.placement = Placement(groups, math.nan, {g: f"baseline:{best}" for g in groups})


def ops_per_backend(groups) -> dict:
    """backend -> how many of the graph's operators ``groups`` place on it."""
    out: dict = {}
    for g in groups:
        out[g.backend] = out.get(g.backend, 0) + len(g.nodes)
    return out


def _budget_of(name: str, floors: dict, accuracy):
    """The budget ``name``'s outputs are judged by: a floor's own when it has one."""
    floor = floors.get(name)
    return floor.budget if floor is not None and floor.budget is not None else accuracy


def _advise(results: dict, outside: set, shipped_ms: float) -> None:
    """A build outside the budget that is faster than the shipped one and within its own
    budget: ``advice`` says how much faster, and the flag (strict f32 is the default)."""
    for name in outside & set(results):
        r = results[name]
        if r.match and r.ms < shipped_ms:
            r.advice = (f"{shipped_ms / r.ms:.2f}x faster than the shipped build, error "
                        f"{r.rel_err:.1e} of the output scale: --accuracy "
                        f"{r.outside_budget} (accuracy={r.outside_budget!r} in Python)")


__all__ = ["Verdict", "never_slower", "judge_builds", "ops_per_backend"]
