"""In-context calibration of the op-level placement: measured costs of groups in a whole run.

The op-level DP adds costs measured one kernel at a time, each repeated in isolation with
its weights and its runtime's threads warm. In a whole run a kernel follows kernels of
other runtimes (and other sessions of its own library), and some pay far more than their
isolated time: a GEMM right after a graph library whose thread pool is still spinning, a
library session per group each with its own pool (the measurements: ``git show
31eb8cd:docs/BENCHMARKS.md``, "Op-level placement in context"). Pairwise switch costs
(``Measurer.switch_costs``) catch part of this; the rest depends on what ran before, which a
probe cannot know.

So: build the placement, run it, and time every external call in place. What a backend's
calls cost beyond their isolated time (less the switch cost the DP already charges) is
its in-context call overhead: the median over its calls of all rounds so far is added to
its call overhead (epsilon). TVM's calls run inside the VM and are not timed one by one:
TVM gets the part of the whole run no external call accounts for, spread over its
kernels. Run the DP again on the calibrated epsilons, and repeat until the placement
stops changing or ``rounds`` runs out. A per-backend term, not a per-group cost: a group
measured in place says little about the next group of that library, and re-costing only
the measured groups left the DP chasing the optimistic isolated costs of the others (the
end-to-end time grew round after round). Each round's placement is timed end to end; the
fastest, re-timed side by side, is kept, so the result is never slower, as measured, than
the plain op-level placement.
"""
from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass, field

from ..measure.timing import interleaved
from ..placement import Placement
from .op_level import pair_cost, place

logger = logging.getLogger("collage_tvm")


@dataclass
class Calibration:
    placement: Placement
    history: list = field(default_factory=list)  # one dict per round
    extra_epsilon: dict = field(default_factory=dict)  # backend -> in-context ms per call


def calibrate(graph, candidates, costs: dict, epsilon: dict, switch: dict, placement: Placement,
              make_run, rounds: int = 4, min_ms: float = 300.0, on_round=None) -> Calibration:
    """Re-run the op-level DP with in-context epsilons, at most ``rounds`` times (module doc).

    ``costs``: candidate -> ms the DP uses (isolated time less epsilon).
    ``make_run(groups, timings) -> run``: builds a placement (a later stage's work, so it
    comes in as a callback: ``lower.placement_runner``); ``run()`` runs the model once on
    fixed inputs, each external call appending its wall time (s) to ``timings[group index]``.
    ``on_round(entry)`` sees each round: {"round", "estimate_ms", "measured_ms", "kernels",
    "extra_epsilon"}.
    """
    samples: dict = {}  # backend -> [in-context ms beyond the DP's charge, per call]
    extra: dict = {}
    tried: dict = {}  # placement signature -> (placement, run)
    history: list = []
    current = placement
    for rnd in range(rounds):
        sig = tuple((g.backend, g.nodes) for g in current.groups)
        if sig in tried:
            break  # the DP came back to a placement already run: no new information
        timings: dict = {}
        run = make_run(current.groups, timings)
        total = _run(run, timings, min_ms)
        tried[sig] = (current, run)
        accounted, internal = 0.0, []
        prev = None
        for k, g in enumerate(current.groups):
            charged = (costs.get(g, 0.0) + epsilon.get(g.backend, 0.0)
                       + (pair_cost(switch, prev, g.backend) if prev is not None else 0.0))
            if timings.get(k):
                ctx = statistics.median(timings[k]) * 1e3
                samples.setdefault(g.backend, []).append(ctx - charged)
                accounted += ctx
            else:
                internal.append(charged)
                accounted += charged
            prev = g.backend
        if internal:  # what no external call accounts for, spread over the VM's own kernels
            tvm_name = _internal_backend(current, timings)
            samples.setdefault(tvm_name, []).append((total - accounted) / len(internal))
        extra = {b: max(0.0, statistics.median(v)) for b, v in samples.items()}
        entry = {"round": rnd, "estimate_ms": current.cost, "measured_ms": total,
                 "kernels": len(current.groups),
                 "extra_epsilon": {b: round(v, 4) for b, v in extra.items()}}
        history.append(entry)
        logger.info("calibration round %d: estimate %.3f ms, measured %.3f ms, in-context "
                    "epsilon additions %s", rnd, current.cost, total, entry["extra_epsilon"])
        if on_round is not None:
            on_round(entry)
        eps = {b: epsilon.get(b, 0.0) + extra.get(b, 0.0) for b in set(epsilon) | set(extra)}
        # A graph too wide for the exact search (NASNet-A) stays on the restricted one.
        current = place(graph.producers, candidates, costs, eps, switch=switch,
                        exact=placement.exact)
    if len(tried) > 1:  # side by side: the machine's drift hits every round's placement alike
        ms = interleaved({i: run for i, (_, run) in enumerate(tried.values())})
        best = min(ms, key=ms.get)
        for i, entry in enumerate(history):
            entry["retimed_ms"] = ms.get(i, math.nan)
        chosen = list(tried.values())[best][0]
    else:
        chosen = list(tried.values())[0][0]
    return Calibration(chosen, history, extra)


def _internal_backend(placement: Placement, timings: dict) -> str:
    """The backend of the groups the VM runs itself (no timed external call)."""
    return next(g.backend for k, g in enumerate(placement.groups) if not timings.get(k))


def _run(run, timings: dict, min_ms: float) -> float:
    """Median ms of whole runs (>= 5 runs and ``min_ms`` of running, after 2 warm-ups);
    ``timings`` ends up holding the external calls of the timed runs only."""
    for _ in range(2):
        run()
    for log in timings.values():
        log.clear()
    samples: list = []
    t_end = time.perf_counter() + min_ms / 1e3
    while len(samples) < 5 or (time.perf_counter() < t_end and len(samples) < 200):
        t0 = time.perf_counter()
        run()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)
