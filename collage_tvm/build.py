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
from .lower import lower_placement
from .measure.db import CostDB
from .measure.measurer import Measurer
from .patterns import generate_candidates
from .placement_log import PlacementLog
from .placer.op_level import place
from .registry import get_backend

logger = logging.getLogger("collage_tvm")

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
    placement_from_log: bool = False
    estimated_ms: float = math.nan
    ops_per_backend: dict = field(default_factory=dict)
    times: dict = field(default_factory=dict)        # stage -> seconds
    comparison: dict = field(default_factory=dict)   # build name -> {"ms", "match", "max_err"}
    shipped: str = "collage"                         # which build was shipped

    def summary(self) -> str:
        if self.placement_from_log:
            return "placement found in the placement log: measured nothing"
        if self.distinct_measured == 0:
            return f"all {self.db_hits} costs found in the cost DB: measured nothing"
        return f"measured {self.distinct_measured} candidates ({self.db_hits} from the cost DB)"


@dataclass
class CollageResult:
    executable: object          # tvm.relax.VMExecutable
    module: tvm.IRModule        # partitioned, external groups lowered
    placement: Placement
    graph: DataflowGraph
    report: BuildReport


def resolve_backends(names, target) -> tuple[dict, dict]:
    """(available backends by name, skipped name -> reason). ``tvm`` is always included."""
    names = list(dict.fromkeys(["tvm", *names]))
    backends, skipped = {}, {}
    for name in names:
        try:
            b = get_backend(name)
        except KeyError as err:
            raise ValueError(str(err).strip("'\"")) from None
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
           compare: bool = False):
    """Import, generate candidates, measure (or reuse) costs, place. Returns
    (graph, placement, backend_map, report, target)."""
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

    logged = log.get(key)
    placement = _placement_from_log(logged, graph, backend_map)
    if placement is not None:
        report.placement_from_log = True
        report.estimated_ms = placement.cost
        report.comparison = logged.get("comparison", {})
        report.shipped = logged.get("shipped", "collage")
    else:
        t0 = time.perf_counter()
        candidates = generate_candidates(graph, backend_map.values())
        report.candidates = len(candidates)
        measurer = Measurer(target, cost_db, isolate=isolate, progress=progress)
        try:
            eps = measurer.epsilon(backend_map.values())
            raw = measurer.costs(graph, candidates, backend_map)
        finally:
            measurer.close()
        report.times["measure"] = time.perf_counter() - t0
        report.distinct_measured, report.db_hits = measurer.measured, measurer.hits
        report.failures, report.epsilon = measurer.failures, eps
        # Measured times include one call's overhead; the DP adds it back as epsilon (Eq. 2).
        costs = {c: max(0.0, v - eps[c.backend]) for c, v in raw.items()}
        t0 = time.perf_counter()
        placement = place(graph.producers, candidates, costs, eps)
        report.times["search"] = time.perf_counter() - t0
        report.estimated_ms = placement.cost
        if compare:
            placement = never_slower(graph, placement, backend_map, target, report)
        log.put(key, placement_record(placement, graph, target, report.comparison,
                                      report.shipped))
    for g in placement.groups:
        report.ops_per_backend[g.backend] = report.ops_per_backend.get(g.backend, 0) + len(g.nodes)
    logger.info("collage: %s", report.summary())
    return graph, placement, backend_map, report, target


def optimize(model, target="llvm", backends=("tvm", "dnnl"), db=None, placement_log=None,
             example_inputs=None, isolate: bool = True, progress: bool = True,
             compare: bool = False) -> CollageResult:
    """Search a placement for ``model`` and build it; see ``build`` for the arguments."""
    graph, placement, backend_map, report, target = search(
        model, target, backends, db, placement_log, example_inputs, isolate, progress, compare)
    t0 = time.perf_counter()
    executable, lowered = compile_placement(graph, placement.groups, backend_map, target)
    report.times["compile"] = time.perf_counter() - t0
    return CollageResult(executable, lowered, placement, graph, report)


def optimize_module(mod, target, backends, db, placement_log, progress, isolate):
    """The partitioned module with external groups lowered (for ``collage_tvm.pipeline``)."""
    graph, placement, backend_map, _, _ = search(mod, target, backends, db, placement_log,
                                                 None, isolate, progress)
    return lower_placement(graph, placement.groups, backend_map)


def compile_placement(graph, groups, backend_map, target):
    mod = lower_placement(graph, groups, backend_map)
    return tvm.compile(mod, target), mod


def build(model, target="llvm", backends=("tvm", "dnnl"), db=None, **kwargs):
    """Build ``model`` with Collage: the returned executable runs in ``relax.VirtualMachine``.

    ``model``: ONNX path/ModelProto, torch.nn.Module (with ``example_inputs``) or IRModule.
    ``db``: cost DB path (default ``~/.cache/collage-tvm/costs.db``) or a ``CostDB``.
    """
    return optimize(model, target, backends, db, **kwargs).executable


def never_slower(graph, placement, backend_map, target, report) -> Placement:
    """Time the placement end to end beside every single-backend build; ship the fastest.

    Builds: "tvm-only" (TVM's own fusion), "<lib>+tvm" for each external op library (its
    patterns offloaded greedily, TVM for the rest). Outputs are checked against tvm-only.
    """
    from .baselines import byoc_groups, evaluate

    t0 = time.perf_counter()
    builds = {"collage": placement.groups,
              "tvm-only": [Candidate("tvm", frozenset([i]), "tvm.op") for i in range(len(graph))]}
    for name, b in backend_map.items():
        if b.is_external and b.kind == "op":
            builds[f"{name}+tvm"] = byoc_groups(graph, b)
    results, ref = {}, None
    for name in ["tvm-only"] + [n for n in builds if n != "tvm-only"]:
        executable, _ = compile_placement(graph, builds[name], backend_map, target)
        r = evaluate(executable, graph, target, None if ref is None else ref["outputs"])
        if ref is None:
            ref, r["match"], r["max_err"] = r, True, 0.0
        results[name] = {"ms": r["ms"], "match": bool(r["match"]), "max_err": r["max_err"]}
        logger.info("end to end: %s %.3f ms (matches tvm-only: %s)", name, r["ms"], r["match"])
    report.comparison = results
    report.times["compare"] = time.perf_counter() - t0
    ok = {n: r for n, r in results.items() if r["match"]}
    best = min(ok, key=lambda n: ok[n]["ms"])
    if best == "collage" or ok[best]["ms"] >= ok.get("collage", {"ms": math.inf})["ms"]:
        return placement
    report.shipped = best
    logger.warning("%s (%.3f ms) beat the collage placement (%.3f ms): shipping %s", best,
                   ok[best]["ms"], results["collage"]["ms"], best)
    groups = builds[best]
    return Placement(groups, math.nan, {g: f"baseline:{best}" for g in groups})


def placement_record(placement: Placement, graph: DataflowGraph, target,
                     comparison: dict | None = None, shipped: str = "collage") -> dict:
    return {
        "target": str(target),
        "shipped": shipped,
        "comparison": comparison or {},
        "estimated_ms": placement.cost,
        "groups": [{"backend": g.backend, "nodes": sorted(g.nodes), "label": g.label,
                    "ops": [graph.nodes[i].op_name for i in sorted(g.nodes)],
                    "level": placement.chosen_by.get(g, "op-level")}
                   for g in placement.groups],
    }


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
