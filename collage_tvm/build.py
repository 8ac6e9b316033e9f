"""``collage_tvm.build``: the whole data flow of DESIGN.md for one model."""
from __future__ import annotations

import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, field

import tvm
from tvm import relax

from .candidate import Candidate, Placement
from .frontend import load_model, normalize_for_collage
from .graph import DataflowGraph
from .graph.subgraph import function_key
from .lower import lower_placement, release_with
from .measure.db import CostDB
from .measure.measurer import Measurer
from .patterns import generate_candidates
from .placement_log import PlacementLog
from .placer.calibrate import calibrate
from .placer.op_level import place
from .registry import get_backend

logger = logging.getLogger("collage_tvm")

# never_slower times a build once when its first run is this many times slower than the
# Collage placement's (it cannot win; an untuned TVM build of a big model takes minutes).
SLOW_BUILD_FACTOR = 10.0
DEFAULT_DB = os.path.join(os.path.expanduser("~"), ".cache", "collage-tvm", "costs.db")


@dataclass
class BuildReport:
    backends: list
    skipped: dict = field(default_factory=dict)      # backend -> reason it was left out
    candidates: int = 0
    distinct_measured: int = 0
    db_hits: int = 0
    failures: list = field(default_factory=list)
    epsilon: dict = field(default_factory=dict)
    switch: dict = field(default_factory=dict)  # (a, b) -> ms per change of runtime
    close_calls: int = 0   # alternative covers within 75% of the chosen one (Measurer.refine)
    side_by_side: int = 0  # sets of candidates re-timed side by side in this build
    calibration: list = field(default_factory=list)  # in-context rounds (placer.calibrate)
    placement_from_log: bool = False
    estimated_ms: float = math.nan
    ops_per_backend: dict = field(default_factory=dict)
    times: dict = field(default_factory=dict)        # stage -> seconds
    comparison: dict = field(default_factory=dict)   # build name -> {"ms", "match", "max_err"}
    shipped: str = "collage"                         # which build was shipped
    graph_level: dict = field(default_factory=dict)  # the evolutionary search: history, counts

    def summary(self) -> str:
        if self.placement_from_log:
            return "placement found in the placement log: measured nothing"
        if self.distinct_measured == 0 and self.side_by_side == 0:
            return f"all {self.db_hits} costs found in the cost DB: measured nothing"
        side = (f"; re-timed {self.side_by_side} close calls side by side"
                if self.side_by_side else "")
        return (f"measured {self.distinct_measured} candidates ({self.db_hits} from the cost "
                f"DB){side}")


@dataclass
class CollageResult:
    executable: object          # tvm.relax.VMExecutable
    module: tvm.IRModule        # partitioned, external groups lowered
    placement: Placement
    graph: DataflowGraph
    report: BuildReport


def resolve_backends(names, target) -> tuple[dict, dict]:
    """(available backends by name, skipped name -> reason). ``tvm`` is always included.

    A backend for another device than ``target``'s (a CUDA library on an ``llvm`` target)
    is skipped with that reason.
    """
    names = list(dict.fromkeys(["tvm", *names]))
    device = "cuda" if target.kind.name == "cuda" else "cpu"
    backends, skipped = {}, {}
    for name in names:
        try:
            b = get_backend(name)
        except KeyError as err:
            raise ValueError(str(err).strip("'\"")) from None
        if name != "tvm" and b.device != device:
            ok, why = False, f"runs on {b.device}, the target is {device}"
        else:
            ok, why = b.available()
        if not ok:
            skipped[name] = why
            logger.warning("backend %s skipped: %s", name, why)
            continue
        backends[name] = b
    return backends, skipped


def placement_key(main: relax.Function, target, backends: dict) -> str:
    parts = [function_key(main), str(target)] + sorted(f"{n}={b.version()}" for n, b in backends.items())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def _db(db) -> CostDB:
    if isinstance(db, CostDB):
        return db
    path = DEFAULT_DB if db is None else db
    cost_db = CostDB(path)
    if cost_db.recovered_from:
        logger.warning("cost DB %s was damaged; moved aside to %s and rebuilt",
                       path, cost_db.recovered_from)
    return cost_db


def _placement_log(log, db) -> PlacementLog:
    if isinstance(log, PlacementLog):
        return log
    if log is None:
        path = getattr(db, "path", None)
        log = None if path in (None, ":memory:") else f"{os.fspath(path)}.placements.json"
    return PlacementLog(log)


def search(model, target="llvm", backends=("tvm", "dnnl"), db=None, placement_log=None,
           example_inputs=None, isolate: bool = True, progress: bool = True,
           compare: bool = False, graph_level: bool = False, budget: float = 300.0,
           on_generation=None, switching: bool = True, calibrate_rounds: int = 4,
           on_calibration=None, refine_rounds: int = 2):
    """Import, generate candidates, measure (or reuse) costs, place. Returns
    (graph, placement, backend_map, report, target).

    ``switching``: the op-level DP charges the measured cost of changing runtime between
    consecutive kernels (``Measurer.switch_costs``); False gives the paper's additive model.
    ``refine_rounds``: times the placement's close calls (alternative covers within 75%
    of the chosen one's measured cost) are re-timed side by side and the DP re-run
    (``Measurer.refine``; each round re-times for at most half the measuring time, 30 s at
    least, the largest stakes first, and nothing new when the DB answered every candidate);
    0 turns it off.
    ``calibrate_rounds``: rounds of in-context calibration of the op-level placement
    (``placer.calibrate``: run it, re-cost its external groups as timed in place, re-run
    the DP); 0 turns it off. ``on_calibration(entry)`` sees each round.

    ``graph_level``: after the op-level DP, run the evolutionary graph-level placer
    (``placer.graph_level``) for at most ``budget`` seconds over the registered graph
    libraries; ``on_generation(entry)`` sees its progress.
    """
    from .target import make_target

    t_start = time.perf_counter()
    target = make_target(target)
    mod = normalize_for_collage(load_model(model, example_inputs))
    graph = DataflowGraph(mod["main"])
    backend_map, skipped = resolve_backends(backends, target)
    report = BuildReport(backends=list(backend_map), skipped=skipped)
    cost_db = _db(db)
    log = _placement_log(placement_log, cost_db)
    key = placement_key(graph.func, target, backend_map)
    report.times["import"] = time.perf_counter() - t_start

    variant = (("|switching" if switching else "") + ("|graph-level" if graph_level else "")
               + (f"|refined{refine_rounds}" if refine_rounds else "")
               + (f"|calibrated{calibrate_rounds}" if calibrate_rounds else ""))
    if variant:
        key = hashlib.sha256(f"{key}{variant}".encode()).hexdigest()[:32]
    logged = log.get(key)
    placement = _placement_from_log(logged, graph, backend_map)
    if placement is not None:
        report.placement_from_log = True
        report.estimated_ms = placement.cost
        report.comparison = logged.get("comparison", {})
        report.shipped = logged.get("shipped", "collage")
        report.graph_level = logged.get("graph_level", {})
    else:
        t0 = time.perf_counter()
        candidates = generate_candidates(graph, backend_map.values())
        report.candidates = len(candidates)
        measurer = Measurer(target, cost_db, isolate=isolate, progress=progress)
        t_search = 0.0
        try:
            eps = measurer.epsilon(backend_map.values())
            switch = measurer.switch_costs(backend_map.values()) if switching else {}
            t1 = time.perf_counter()
            raw = measurer.costs(graph, candidates, backend_map)
            # Re-timing close calls may take half as long again as measuring did, each round;
            # when the DB answered every candidate it times nothing new either.
            refine_budget = (max(30.0, 0.5 * (time.perf_counter() - t1))
                             if measurer.measured else 0.0)
            for rnd in range(refine_rounds + 1):
                # Measured times include one call's overhead; the DP adds it back as
                # epsilon (Eq. 2).
                costs = {c: max(0.0, v - eps[c.backend]) for c, v in raw.items()}
                t1 = time.perf_counter()
                placement = place(graph.producers, candidates, costs, eps, switch=switch,
                                  exact=rnd == 0 or placement.exact)
                t_search += time.perf_counter() - t1
                if rnd == refine_rounds:
                    break
                refined, report.close_calls = measurer.refine(placement, candidates, raw, eps,
                                                              backend_map, budget_s=refine_budget)
                if refined == raw:
                    break  # no cost changed: the DP would answer the same
                raw = refined
        finally:
            measurer.close()
        report.times["measure"] = time.perf_counter() - t0 - t_search
        report.times["search"] = t_search
        report.distinct_measured, report.db_hits = measurer.measured, measurer.hits
        report.side_by_side = measurer.side_by_side
        report.failures, report.epsilon, report.switch = measurer.failures, eps, switch
        report.estimated_ms = placement.cost
        if calibrate_rounds > 0 and any(backend_map[g.backend].is_external
                                        for g in placement.groups):
            t0 = time.perf_counter()
            cal = calibrate(graph, candidates, costs, eps, switch, placement, backend_map,
                            target, rounds=calibrate_rounds, on_round=on_calibration)
            placement, report.calibration = cal.placement, cal.history
            report.estimated_ms = placement.cost
            report.times["calibrate"] = time.perf_counter() - t0
        op_level = placement
        if graph_level:
            placement = _graph_level(graph, placement, backend_map, target, report, budget,
                                     on_generation)
        if compare:
            placement = never_slower(graph, placement, backend_map, target, report,
                                     op_level if placement is not op_level else None)
        log.put(key, placement_record(placement, graph, target, report.comparison,
                                      report.shipped, report.graph_level))
    for g in placement.groups:
        report.ops_per_backend[g.backend] = report.ops_per_backend.get(g.backend, 0) + len(g.nodes)
    logger.info("collage: %s", report.summary())
    return graph, placement, backend_map, report, target


def optimize(model, target="llvm", backends=("tvm", "dnnl"), db=None, placement_log=None,
             example_inputs=None, isolate: bool = True, progress: bool = True,
             compare: bool = False, graph_level: bool = False, budget: float = 300.0,
             on_generation=None, switching: bool = True, calibrate_rounds: int = 4,
             on_calibration=None, refine_rounds: int = 2) -> CollageResult:
    """Search a placement for ``model`` and build it; see ``search`` for the arguments."""
    graph, placement, backend_map, report, target = search(
        model, target, backends, db, placement_log, example_inputs, isolate, progress, compare,
        graph_level, budget, on_generation, switching, calibrate_rounds, on_calibration,
        refine_rounds)
    t0 = time.perf_counter()
    executable, lowered = compile_placement(graph, placement.groups, backend_map, target,
                                            keep=True)
    report.times["compile"] = time.perf_counter() - t0
    return CollageResult(executable, lowered, placement, graph, report)


def optimize_module(mod, target, backends, db, placement_log, progress, isolate):
    """The partitioned module with external groups lowered (for ``collage_tvm.pipeline``)."""
    graph, placement, backend_map, _, _ = search(mod, target, backends, db, placement_log,
                                                 None, isolate, progress)
    return lower_placement(graph, placement.groups, backend_map)


def compile_placement(graph, groups, backend_map, target, timings: dict | None = None,
                      keep: bool = False):
    """(executable, lowered module) of a placement; ``timings``: see ``lower_external``.

    The external callables (and the weights they hold) are freed with the executable unless
    ``keep`` (the build handed to the user, who may make VMs from a jitted module later)."""
    mod = lower_placement(graph, groups, backend_map, timings)
    executable = tvm.compile(mod, target)
    if not keep:
        release_with(executable, mod)
    return executable, mod


def build(model, target="llvm", backends=("tvm", "dnnl"), db=None, **kwargs):
    """Build ``model`` with Collage: the returned executable runs in ``relax.VirtualMachine``.

    ``model``: ONNX path/ModelProto, torch.nn.Module (with ``example_inputs``) or IRModule.
    ``db``: cost DB path (default ``~/.cache/collage-tvm/costs.db``) or a ``CostDB``.
    """
    return optimize(model, target, backends, db, **kwargs).executable


def _latency_evaluator(graph, backend_map, target):
    """``evaluate(groups) -> (ms, reason)`` for the graph-level search: build, run, time.

    The first placement evaluated (the op-level one, the search's seed) gives the reference
    outputs; a later placement whose outputs differ, or whose build fails (a graph library
    that cannot load its subgraph), is invalid: infinite latency and the reason.
    """
    from .baselines import evaluate

    reference: list = []

    def evaluate_groups(groups):
        try:
            executable, _ = compile_placement(graph, groups, backend_map, target)
            r = evaluate(executable, graph, target, reference[0] if reference else None)
        except Exception as err:  # noqa: BLE001 - an invalid individual, not a failed search
            return math.inf, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if not reference:
            reference.append(r["outputs"])
        elif not r["match"]:
            return math.inf, f"outputs differ from the op-level placement's (max err {r['max_err']:.3g})"
        return r["ms"], None

    return evaluate_groups


def _graph_level(graph, placement, backend_map, target, report, budget, on_generation):
    from .placer.graph_level import GraphLevelSearch

    libs = {n: b for n, b in backend_map.items() if b.kind == "graph"}
    if not libs:
        logger.warning("--graph-level: no graph library among the backends (%s); skipped",
                       ", ".join(backend_map))
        report.graph_level = {"skipped": "no graph library among the backends"}
        return placement
    t0 = time.perf_counter()
    gl = GraphLevelSearch(graph, placement, libs, _latency_evaluator(graph, backend_map, target))
    res = gl.run(budget_s=budget, on_generation=on_generation)
    report.times["graph-level"] = time.perf_counter() - t0
    report.graph_level = {"libraries": sorted(libs), "genes": gl.n_genes,
                          "eligible_groups": len(gl.eligible), "seed_ms": res.seed_ms,
                          "best_ms": res.best_ms, "evaluated": res.evaluated,
                          "invalid": len(res.invalid), "stopped": res.stopped,
                          "history": res.history,
                          "invalid_reasons": sorted(set(res.invalid.values()))[:10]}
    if not res.best_ms < res.seed_ms:
        return placement
    return res.placement


def never_slower(graph, placement, backend_map, target, report, op_level=None) -> Placement:
    """Time the placement end to end beside every single-backend build; ship the fastest.

    Builds: "tvm-only" (TVM's own fusion); "<lib>+tvm" for each external op library (its
    patterns offloaded greedily, TVM for the rest); "<lib>" for each graph library that
    can run the whole model ("<lib>+tvm" when some operators stay on TVM); and the
    op-level placement when the graph-level search changed it. Outputs are checked
    against tvm-only.
    """
    from .baselines import byoc_groups, compare_outputs, evaluate, graph_lib_groups, interleaved

    t0 = time.perf_counter()
    builds = {"collage": placement.groups,
              "tvm-only": [Candidate("tvm", frozenset([i]), "tvm.op") for i in range(len(graph))]}
    if op_level is not None:
        builds["collage-op-level"] = op_level.groups
    for name, b in backend_map.items():
        if b.is_external and b.kind == "op":
            builds[f"{name}+tvm"] = byoc_groups(graph, b)
        elif b.kind == "graph":
            groups = graph_lib_groups(graph, b)
            builds[name if all(g.backend == name for g in groups) else f"{name}+tvm"] = groups
    # Collage first: its time sets the cutoff beyond which a build is timed once only (an
    # untuned TVM build of a big model can take minutes per run). Outputs are compared with
    # tvm-only's at the end.
    results, outputs, runs, seen = {}, {}, {}, {}
    cutoff = None
    for name in ["collage", "tvm-only"] + [n for n in builds if n not in ("collage", "tvm-only")]:
        same = seen.setdefault(frozenset((g.backend, g.nodes) for g in builds[name]), name)
        if same != name:  # e.g. the two-level search chose the whole model on one library
            results[name] = {"same_as": same}
            logger.info("end to end: %s is the same placement as %s", name, same)
            continue
        try:
            executable, _ = compile_placement(graph, builds[name], backend_map, target)
            r = evaluate(executable, graph, target, cutoff_ms=cutoff)
        except Exception as err:  # noqa: BLE001 - a failing baseline is reported, not fatal
            if name in ("tvm-only", "collage"):
                raise
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            logger.warning("end to end: %s failed to build or run: %s", name, reason)
            results[name] = {"ms": math.inf, "match": False, "max_err": math.nan, "error": reason}
            continue
        if cutoff is None:
            cutoff = SLOW_BUILD_FACTOR * r["ms"]
        outputs[name] = r["outputs"]
        results[name] = {"ms": r["ms"]}
        if r["timed_once"]:
            results[name]["timed_once"] = True
        runs[name] = r["run"]
        logger.info("end to end: %s %.3f ms%s", name, r["ms"],
                    " (timed once: hopeless)" if r["timed_once"] else "")
    for name, out in outputs.items():
        match, max_err = compare_outputs(out, outputs["tvm-only"])
        results[name].update(match=match, max_err=0.0 if name == "tvm-only" else max_err)
    # The contenders (correct, within 2x of the fastest) are timed again in alternating
    # rounds, so the machine's drifting load hits them alike: on a shared 2-core machine
    # one build timed after another differed by up to 40% from the same build re-timed.
    # (Builds that are the same placement as another have no run of their own.)
    fastest = min((results[n]["ms"] for n in runs if results[n]["match"]), default=math.inf)
    contenders = {n: runs[n] for n in runs
                  if results[n]["match"] and results[n]["ms"] <= 2 * fastest}
    if len(contenders) > 1:
        for name, ms in interleaved(contenders).items():
            results[name]["first_ms"], results[name]["ms"] = results[name]["ms"], ms
    results = {n: (dict(results[results[n]["same_as"]], same_as=results[n]["same_as"])
                   if "same_as" in results[n] else results[n])
               for n in ["tvm-only", *builds] if n in results}
    report.comparison = results
    report.times["compare"] = time.perf_counter() - t0
    ok = {n: r for n, r in results.items() if r["match"]}
    best = min(ok, key=lambda n: ok[n]["ms"])
    if best == "collage" or ok[best]["ms"] >= ok.get("collage", {"ms": math.inf})["ms"]:
        return placement
    report.shipped = best
    logger.warning("%s (%.3f ms) beat the collage placement (%.3f ms): shipping %s", best,
                   ok[best]["ms"], results["collage"]["ms"], best)
    if best == "collage-op-level":
        return op_level
    groups = builds[best]
    return Placement(groups, math.nan, {g: f"baseline:{best}" for g in groups})


def placement_record(placement: Placement, graph: DataflowGraph, target,
                     comparison: dict | None = None, shipped: str = "collage",
                     graph_level: dict | None = None) -> dict:
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
        # The dataflow graph itself, so `collage-tvm show` can draw the placement.
        "graph": {"nodes": [{"op": n.op_name, "inputs": list(n.inputs), "shape": _shape_of(n)}
                            for n in graph.nodes],
                  "outputs": list(graph.outputs)},
    }


def _shape_of(node) -> list | None:
    """The static output shape of ``node`` (None for tuples or symbolic shapes)."""
    ty = getattr(node.var, "ty", None)
    shape = getattr(ty, "shape", None)
    try:
        return [int(d) for d in shape.values]
    except (AttributeError, TypeError):
        return None


def _placement_from_log(record, graph, backend_map):
    if not record:
        return None
    try:
        groups = [Candidate(g["backend"], frozenset(g["nodes"]), g.get("label", ""))
                  for g in record["groups"]]
    except (KeyError, TypeError):
        logger.warning("placement log entry is malformed; searching again")
        return None
    if any(g.backend not in backend_map for g in groups) or \
            sorted(i for g in groups for i in g.nodes) != list(range(len(graph))):
        logger.warning("placement log entry does not fit this model; searching again")
        return None
    return Placement(groups, record.get("estimated_ms", math.nan),
                     {g: rg.get("level", "op-level") for g, rg in zip(groups, record["groups"])})
