"""The op-level stage of a new placement: the candidates over the graph, their costs
(measured, the cost DB's, or left unmeasured by the lean search where they cannot win), the
DP (``op_level.place``, the paper's Algorithm 1), regions carved around the TVM kernels that
beat a library inside its region (``carve``), rounds of re-timing the alternative covers
side by side (``alternatives.refine``), and the in-context calibration (``calibrate``).

``p`` is the search's ``build.Placing`` (graph, backends, target, options, report): each
function writes its record into ``p.report``. The ``Measurer`` comes from the caller, which
makes it (its TVM candidates' builds use the tuning database) and closes it.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..candidates import generate_candidates
from ..placement import Placement
from .alternatives import refine
from .calibrate import calibrate
from .carve import carved_regions, kernel_cost
from .lean import lean_costs
from .op_level import ensure_cover, place

logger = logging.getLogger("collage_tvm")


@dataclass
class OpLevel:
    """The op-level stage's record: its placement and what the DP placed it from."""

    placement: Placement | None
    candidates: list
    raw: dict      # candidate -> measured ms, one call's overhead included
    eps: dict      # backend -> its call overhead (the paper's epsilon, Eq. 2)
    switch: dict   # (backend, backend) -> switch cost: ms per change of runtime

    @property
    def costs(self) -> dict:
        return dp_costs(self.raw, self.eps)


def dp_costs(raw: dict, eps: dict) -> dict:
    """The DP's costs: the measured times (``raw``) less one call's overhead, which the DP
    adds back per kernel (epsilon, the paper's Eq. 2)."""
    return {c: max(0.0, v - eps[c.backend]) for c, v in raw.items()}


# The share of the search's budget (``SearchOptions.budget``) the side-by-side re-timing of
# alternative covers may take, its rounds together.
REFINE_SHARE = 0.25


def op_level(p, measurer) -> tuple[OpLevel, float]:
    """Candidates, their costs, the op-level DP and its refinement rounds. Returns (the
    record, its placement made; the seconds the DP took)."""
    candidates = generate_candidates(p.graph, p.backends.values())
    p.report.candidates = len(candidates)
    work, measuring_s = _measured(p, measurer, candidates)
    # Re-timing alternative covers may take half as long again as measuring did, and at most
    # REFINE_SHARE of the search's budget, all rounds together; when the DB answered
    # every candidate it times nothing new either.
    refine_s = (min(max(30.0, 0.5 * measuring_s), REFINE_SHARE * p.options.budget)
                if measurer.measured else 0.0)
    return work, _place_refined(p, measurer, work, refine_s)


def record(report, measurer, work: OpLevel, dp_s: float, t0: float) -> None:
    """The stage's figures into ``report``: seconds measuring (since ``t0``, less the DP's
    and the measurer's own stages), counts, call overheads and switch costs, the
    placement's estimate."""
    report.times["measure"] = time.perf_counter() - t0 - dp_s - sum(measurer.seconds.values())
    report.times.update({k: v for k, v in measurer.seconds.items() if v})
    report.times["search"] = dp_s
    report.distinct_measured, report.db_hits = measurer.measured, measurer.hits
    report.side_by_side = measurer.side_by_side
    report.failures, report.call_overhead, report.switch_cost = (measurer.failures, work.eps,
                                                                 work.switch)
    report.crashed = dict(measurer.crashed)
    report.estimated_ms = work.placement.cost


def describe_node(node) -> str:
    """"op -> dtype" of a graph node (a node no backend could run, in errors and reports)."""
    ty = node.var.ty
    dtype = getattr(ty, "dtype", None)
    return f"{node.op_name} -> {dtype}" if dtype else node.op_name


def _measured(p, measurer, candidates) -> tuple[OpLevel, float]:
    """The candidates' costs (measured, or the cost DB's), the nodes no candidate of a
    library covers kept on TVM. Returns (the record, its placement not made yet; the
    seconds measuring took)."""
    eps = measurer.epsilon(p.backends.values())
    switch = measurer.switch_costs(p.backends.values()) if p.options.switching else {}
    t0 = time.perf_counter()
    if p.options.lean:
        # No second pass in reverse order: the alternative covers the DP leaves are re-timed
        # side by side (refine), the rest cannot win.
        measurer.second_pass = False
        measured, lean = lean_costs(measurer, p.graph, candidates, p.backends, eps, switch)
        p.report.lean = lean.as_dict()
    else:
        measured = measurer.costs(p.graph, candidates, p.backends)
    raw, kept = ensure_cover(len(p.graph), candidates, measured)
    if kept:
        nodes = [p.graph.nodes[i] for i in kept]
        p.report.kept_on_tvm = [n.op_name for n in nodes]
        p.report.unrunnable = [describe_node(n) for n in nodes]
        logger.warning("%d node(s) could not be measured alone on any backend and stay on "
                       "TVM: %s", len(kept), ", ".join(sorted(set(p.report.kept_on_tvm))))
    return OpLevel(None, candidates, raw, eps, switch), time.perf_counter() - t0


def _place_refined(p, measurer, work: OpLevel, refine_s: float) -> float:
    """The DP (``place``, the paper's Algorithm 1) over ``work``'s costs; after the first,
    regions carved around winning TVM kernels (``_carve``); then rounds of re-timing the
    alternative covers side by side (``refine``, within ``refine_s`` seconds in all) and placing
    again, until no cost changes or ``options.refine_rounds`` ran. Sets ``work.placement``;
    returns the seconds the DP took."""
    dp_s = 0.0
    for rnd in range(p.options.refine_rounds + 1):
        t0 = time.perf_counter()
        # Measured times include one call's overhead; the DP adds it back as epsilon (Eq. 2).
        work.placement = place(p.graph.producers, work.candidates, work.costs, work.eps,
                               switch=work.switch, exact=rnd == 0 or work.placement.exact)
        dp_s += time.perf_counter() - t0
        if rnd == 0:
            _carve(p, work, measurer)
        if rnd == p.options.refine_rounds:
            break
        t0 = time.perf_counter()
        refined = refine(measurer, work.placement, work.candidates, work.raw, work.eps,
                         p.backends, budget_s=refine_s)
        refine_s = max(0.0, refine_s - (time.perf_counter() - t0))
        p.report.alternative_covers = refined.alternative_covers
        if refined.raw == work.raw:
            break  # no cost changed: the DP would answer the same
        work.raw = refined.raw
    return dp_s


def _carve(p, work: OpLevel, measurer) -> None:
    """Regions cut around the TVM kernels that beat the library inside a chosen region
    (``placer.carve.carved_regions``): measured, added to ``work``'s candidates and costs,
    and placed again (``work.placement`` when that is cheaper)."""
    cuts: list = []
    graph, placement = p.graph, work.placement
    new = carved_regions(graph, placement.groups, work.candidates, work.costs, work.eps,
                         p.backends, cuts=cuts)
    if not new:
        return
    work.raw = {**work.raw, **measurer.costs(graph, new, p.backends)}
    work.candidates += new
    costs, eps = work.costs, work.eps
    again = place(graph.producers, work.candidates, costs, eps, switch=work.switch,
                  exact=placement.exact)
    cut_ms = {id(cut): cut.cost(work.candidates, costs, eps) for cut in cuts}
    best = min(cuts, key=lambda cut: cut_ms[id(cut)] - kernel_cost(cut.region, costs, eps))
    found = {"around": ["+".join(graph.nodes[i].op_name.removeprefix("relax.")
                                 for i in sorted(c.nodes)) for c in best.winners],
             "region_ms": kernel_cost(best.region, costs, eps), "cut_ms": cut_ms[id(best)],
             "tvm_ms": sum(kernel_cost(c, costs, eps) for c in best.winners)}
    p.report.carved = {"pieces": len(new), "cuts": len(cuts),
                       "estimated_ms": [placement.cost, again.cost], "best_cut": found}
    logger.info("carved %d region(s) around winning TVM kernels: estimated %.3f -> %.3f ms; "
                "best cut: %.3f ms for a region of %.3f ms (TVM kernels %.3f ms of it)",
                len(new), placement.cost, again.cost, found["cut_ms"], found["region_ms"],
                found["tvm_ms"])
    if again.cost <= placement.cost:
        work.placement = again


def calibrated(p, work: OpLevel, runner) -> Placement:
    """The op-level placement after ``options.calibrate_rounds`` rounds of in-context
    calibration (``placer.calibrate``: run it whole, fit the library regions' costs to what
    they take in place), when it has a library group to calibrate and a context: one group,
    the whole model on one library, runs in place as it was measured alone (what a round
    would read there is the machine's noise, and it moved the DP off a whole-model
    placement onto another library's). ``runner()``: the callable that runs a placement
    whole (``byoc.placement_runner``), made only when a round runs."""
    groups = work.placement.groups
    if p.options.calibrate_rounds <= 0 or len(groups) < 2 \
            or not any(p.backends[g.backend].is_external for g in groups):
        return work.placement
    t0 = time.perf_counter()
    cal = calibrate(p.graph, work.candidates, work.costs, work.eps, work.switch,
                    work.placement, runner(),
                    rounds=p.options.calibrate_rounds, on_round=p.options.on_calibration)
    p.report.calibration = cal.history
    p.report.estimated_ms = cal.placement.cost
    p.report.times["calibrate"] = time.perf_counter() - t0
    return cal.placement
