"""``collage_tvm.tune`` (this module: ``collage_tvm.tuning.plan``): tune the TVM kernels a
model's placement could use (issue #16).

Which kernels to tune is Collage's decision, made from the costs the search measures:

1. The model's candidates on every backend are measured (or found in the cost DB) exactly
   as ``optimize`` measures them, TVM's untuned.
2. Each TVM candidate that compiles to one kernel puts a stake on that kernel: what the
   placement spends on those operators today, ``min(its untuned time, the best library
   candidate for the same operators)``. Tuning cannot save more than that; a convolution a
   library runs in 1 ms stakes 1 ms, not the 100 ms naive loop, and an elementwise chain
   only TVM fuses stakes all of its time. A kernel's stake is summed over the places the
   model uses it.
3. Kernels are tuned largest stake first, as long as the budget lasts (``tuning.tuner``);
   the records go to the tuning database next to the cost DB, which every later build
   applies.
4. The TVM candidates whose kernels were tuned are measured again with the records
   applied, so the next ``optimize`` places tuned TVM without measuring.
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field

from ..stages import example_arrays, import_model, rewrite_graph, start
from ..stores import open_db
from ..frontend import ModelError
from ..options import SearchOptions
from ..graph.subgraph import extract_function, function_key, given_inputs
from ..byoc import candidate_vm, candidate_vm_for
from ..measure.measurer import Measurer
from ..candidates import generate_candidates
from . import (KernelResult, KernelToTune, TuningDB, default_dir, kernel_key, kernels,
               tune_kernels, use_tuning_db)
from .tuner import MIN_TRIALS

logger = logging.getLogger("collage_tvm")


@dataclass
class TuneReport:
    tuning_db: str
    planned: int = 0                # distinct TVM kernels with a stake
    results: list = field(default_factory=list)  # KernelResult, in tuning order
    measured: int = 0               # candidates measured (not found in the cost DB)
    remeasured: int = 0             # TVM candidates measured again with the new records
    records_before: int = 0
    records_after: int = 0
    budget: float = 0.0
    spent_before: float = 0.0       # seconds earlier tunes of this model took
    times: dict = field(default_factory=dict)

    @property
    def tuned(self) -> list:
        return [r for r in self.results if r.status == "tuned"]

    def summary(self) -> str:
        counts: dict = {}
        for r in self.results:
            counts[r.status] = counts.get(r.status, 0) + 1
        what = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
        if not self.tuned and self.measured == 0 and self.remeasured == 0:
            spent = (f"this model has had {self.spent_before:.0f} s of tuning (budget "
                     f"{self.budget:.0f} s; a larger budget tunes more); "
                     if self.spent_before else "")
            return (f"measured nothing new: {spent}{self.planned} kernel(s) planned ({what}); "
                    f"the tuning database {self.tuning_db} holds {self.records_after} records")
        return (f"{self.planned} kernel(s) planned ({what}); {self.measured} candidate(s) "
                f"measured, {self.remeasured} TVM candidate(s) re-measured tuned; "
                f"records {self.records_before} -> {self.records_after} in {self.tuning_db}")

    def markdown(self) -> str:
        """Per kernel (``key``: its structure; names repeat across shapes): uses in the
        model, stake (what the placement spends on it untuned),
        untuned, tuned and best library time (ms, one use), trials run now, status."""
        lines = ["| kernel | key | uses | stake ms | untuned ms | tuned ms | best library ms "
                 "| trials | status |", "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        for r in self.results:
            lines.append(f"| {r.name} | {r.key[:8]} | {r.info.get('count', '')} | "
                         f"{r.info.get('stake_ms', math.nan):.3f} | {r.untuned_ms:.3f} | "
                         f"{r.tuned_ms:.3f} | {r.best_library_ms:.3f} | {r.trials} | "
                         f"{r.status}{': ' + r.reason if r.reason else ''} |")
        return "\n".join(lines) + "\n"


def plan(graph, candidates, costs: dict, backends: dict, target) -> list:
    """``KernelToTune`` per distinct TVM kernel with a stake: first the kernels of TVM's own
    fusion of the whole model (tier 0: what a TVM build of it, or of any TVM group the
    placement keeps whole, runs), then the other fusion variants the candidates make
    (tier 1: a convolution alone, a partial chain); largest stake first within a tier."""
    best_lib: dict = {}
    for c in candidates:
        if backends[c.backend].is_external and math.isfinite(costs.get(c, math.inf)):
            best_lib[c.nodes] = min(costs[c], best_lib.get(c.nodes, math.inf))
    found: dict = {}
    places: dict = {}
    for c in candidates:
        cost = costs.get(c, math.inf)
        if backends[c.backend].is_external or not math.isfinite(cost) or cost <= 0:
            continue
        ks = kernels(extract_function(graph, c.nodes)[0], target)
        if len(ks) != 1:
            continue  # several kernels (or none): their single-kernel candidates stake them
        name, kernel = ks[0]
        key = kernel_key(kernel)
        lib = best_lib.get(c.nodes, math.inf)
        item = found.setdefault(key, KernelToTune(name, kernel, count=0,
                                                  best_library_ms=math.inf))
        if c.nodes not in places.setdefault(key, set()):
            places[key].add(c.nodes)
            item.stake_ms += min(cost, lib)
            item.count += 1
        item.best_library_ms = min(item.best_library_ms, lib)
    own = {kernel_key(k) for _, k in kernels(graph.func, target)}
    for key, item in found.items():
        item.tier = 0 if key in own else 1
    return sorted(found.values(), key=lambda k: (k.tier, -k.stake_ms))


def _budget_spent(tdb: TuningDB, item: KernelToTune, trials: int) -> KernelResult:
    """What a tune with no budget left says of ``item``: cached, or not tuned."""
    done = tdb.trials(item.kernel) >= trials
    return KernelResult(item.name, item.key, "cached" if done else "skipped",
                        best_library_ms=item.best_library_ms,
                        reason="" if done else "budget spent by earlier tunes")


def _imported(model, target, options, db, example_inputs, input_shapes) -> tuple:
    """(graph, target, backends, cost DB): the search's import and rewrite stages."""
    state = start(model, target, options, example_inputs, input_shapes, db=db)
    try:
        with given_inputs(example_arrays(example_inputs)):
            for stage in (import_model, rewrite_graph):
                stage(state)
                if state.done is not None:
                    raise ModelError("nothing to tune: "
                                     + "; ".join(state.report.kept_on_tvm or
                                                 [f"the model runs whole on "
                                                  f"{state.report.whole_model.get('backend')}"]))
    finally:
        state.user_file.close()
    return state.graph, state.target, state.backends, open_db(db)


def tune(model, target="llvm", backends=None, db=None, tuning_db=None, budget: float = 600.0,
         trials: int = 64, example_inputs=None, input_shapes=None, progress: bool = True,
         isolate: bool = True, on_kernel=None, rewrite: bool = False) -> TuneReport:
    """Tune the TVM kernels ``model``'s placement could use until the model has had about
    ``budget`` seconds of tuning, earlier tunes of it included (the same call twice tunes
    once; a larger budget tunes more; measuring the candidates is not counted), at most
    ``trials`` schedules per kernel. ``db``: the cost DB (path or ``CostDB``; default as ``optimize``).
    ``tuning_db``: where the records go (default: next to the cost DB, one directory per
    target). ``backends``: as ``optimize`` (default ``tvm,dnnl``): the libraries whose
    costs decide what is worth tuning. ``rewrite``: tune the graph the verified rewrites
    give, as ``optimize(..., rewrite=True)`` places it. The model is imported (and
    rewritten) by the search's own first stages (``stages.stages()``), with the user's
    ``example_inputs``. Returns a ``TuneReport``."""
    t_start = time.perf_counter()
    if budget <= 0:
        raise ValueError(f"budget must be > 0 seconds, got {budget}")
    options = SearchOptions(backends=list(backends or ("tvm", "dnnl")), rewrite=rewrite,
                            isolate=isolate, progress=progress)
    graph, target, backends, cost_db = _imported(model, target, options, db, example_inputs,
                                                 input_shapes)
    path = tuning_db or default_dir(getattr(cost_db, "path", None), target)
    if path is None:
        raise ValueError("an in-memory cost DB has no place for a tuning database: "
                         "give tuning_db= (a directory)")
    tdb = tuning_db if isinstance(tuning_db, TuningDB) else TuningDB(os.fspath(path), target)
    report = TuneReport(tdb.path, records_before=len(tdb))

    candidates = generate_candidates(graph, backends.values())
    measurer = Measurer(target, cost_db, candidate_vm, isolate=isolate, progress=progress)
    try:
        # Also what optimize measures besides candidates: it then starts warm.
        measurer.epsilon(backends.values())
        measurer.switch_costs(backends.values())
        costs = measurer.costs(graph, candidates, backends)
    finally:
        measurer.close()
    report.measured = measurer.measured
    report.times["measure"] = time.perf_counter() - t_start

    items = plan(graph, candidates, costs, backends, target)
    report.planned = len(items)
    t0 = time.perf_counter()
    model_key = function_key(graph.func)
    report.budget, report.spent_before = budget, tdb.spent(model_key)
    left = budget - report.spent_before
    if report.spent_before > 0 and left < MIN_TRIALS:  # the budget went on earlier tunes
        report.results = [_budget_spent(tdb, i, trials) for i in items]
    else:
        report.results = tune_kernels(tdb, items, left, trials, progress, on_kernel)
        tdb.add_spent(model_key, time.perf_counter() - t0)
    for item, res in zip(items, report.results):
        res.info = {"stake_ms": item.stake_ms, "count": item.count}
    report.times["tune"] = time.perf_counter() - t0
    report.records_after = len(tdb)

    if report.tuned:
        t0 = time.perf_counter()
        tdb.reload()
        tvm_cands = [c for c in candidates if not backends[c.backend].is_external]
        with use_tuning_db(tdb):
            again = Measurer(target, cost_db, candidate_vm_for(tdb), isolate=isolate,
                             progress=progress, tuning=tdb)
            try:
                again.costs(graph, tvm_cands, backends)
            finally:
                again.close()
        report.remeasured = again.measured
        report.times["remeasure"] = time.perf_counter() - t0
    report.times["total"] = time.perf_counter() - t_start
    logger.info("collage tune: %s", report.summary())
    return report
