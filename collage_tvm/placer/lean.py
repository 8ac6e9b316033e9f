"""Measure only what can win (issue #35): the op-level DP on floors, measuring as it goes.

The paper measures every candidate, then runs the DP. Most of them cannot win: a TVM kernel
where a library runs the same operators several times faster, a small library region inside
a larger one that runs whole. Here each candidate not yet known (from the cost DB) gets a
*floor*, the least it could cost on its backend (``measure.estimate.Roofline``: the
backend's best observed rates on this machine, halved); the DP runs on the known costs and
the floors, and the candidates of its answer that are not measured yet are measured; then
again, until the DP's answer is made of measured candidates only.

That answer is the full-measure answer whenever every floor is at most its candidate's
measured cost: a skipped candidate's floor already lost to a cover of measured costs, so
its true cost would lose too. ``LeanReport.skipped`` names how many were never measured.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from ..measure.estimate import SLACK, Roofline, work
from .op_level import ensure_cover, place

logger = logging.getLogger("collage_tvm")


@dataclass
class LeanReport:
    candidates: int = 0     # every candidate of the graph
    known: int = 0          # answered by the cost DB (or free: no kernel) before any measuring
    measured: int = 0       # measured by this search
    skipped: int = 0        # never measured: their floors could not win
    rounds: int = 0         # DP runs on floors
    dp_s: float = 0.0       # seconds in those DP runs
    floors_broken: int = 0  # measured below their floor (the floors were not floors there)
    per_backend: dict = field(default_factory=dict)  # backend -> [measured or known, skipped]

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def lean_costs(measurer, graph, candidates: list, backends: dict, eps: dict, switch: dict,
               slack: float = SLACK, max_rounds: int = 200) -> tuple:
    """(raw cost of every candidate: measured, from the DB, or ``inf`` where skipped,
    ``LeanReport``). ``measurer``: the search's ``Measurer``; ``eps``/``switch``: as the
    DP takes them (the measured per-call overheads and switching costs)."""
    rep = LeanReport(candidates=len(candidates))
    features = {c: work(graph, c.nodes) for c in candidates}
    roof = Roofline(slack)
    raw = measurer.known(graph, candidates, backends)
    rep.known = len(raw)

    def observe(c, cost):
        roof.observe(c.backend, *features[c], cost - eps.get(c.backend, 0.0))

    for c, cost in raw.items():
        observe(c, cost)
    floors_at_measure: dict = {}
    while True:
        est = {c: (max(0.0, raw[c] - eps.get(c.backend, 0.0)) if c in raw
                   else roof.floor(c.backend, *features[c])) for c in candidates}
        est, _ = ensure_cover(len(graph), candidates, est)
        t0 = time.perf_counter()
        placement = place(graph.producers, candidates, est, eps, switch=switch)
        rep.dp_s += time.perf_counter() - t0
        rep.rounds += 1
        todo = [g for g in placement.groups if g not in raw]
        if not todo:
            break
        if rep.rounds > max_rounds:  # never seen; bounded all the same: measure the rest
            logger.warning("lean measuring: %d DP rounds; measuring every candidate left",
                           max_rounds)
            todo = [c for c in candidates if c not in raw]
        floors_at_measure.update({c: est[c] for c in todo})
        new = measurer.costs(graph, todo, backends)
        for c in todo:
            raw[c] = new.get(c, math.inf)
            observe(c, raw[c])
        rep.measured += len(todo)
    rep.floors_broken = sum(1 for c, f in floors_at_measure.items()
                            if math.isfinite(raw[c]) and raw[c] - eps.get(c.backend, 0.0) < f)
    for c in candidates:
        seen = rep.per_backend.setdefault(c.backend, [0, 0])
        seen[0 if c in raw else 1] += 1
    rep.skipped = sum(1 for c in candidates if c not in raw)
    logger.info("lean measuring: %d of %d candidates measured, %d known, %d skipped (their "
                "floors could not win), %d DP rounds in %.1f s", rep.measured, len(candidates),
                rep.known, rep.skipped, rep.rounds, rep.dp_s)
    return {c: raw.get(c, math.inf) for c in candidates}, rep
