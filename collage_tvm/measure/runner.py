"""Build one candidate on its backend and time it (in whatever process calls this)."""
from __future__ import annotations

import statistics
import time

import tvm
from tvm import relax

from ..candidate import Candidate
from ..graph import DataflowGraph
from ..graph.subgraph import random_inputs
from ..lower import lower_placement
from ..target import target_device


def build_candidate(func: relax.Function, backend, target):
    """A VM running ``func`` exactly as the final build would run that group."""
    graph = DataflowGraph(func)
    group = Candidate(backend.name, frozenset(range(len(graph))), "measure")
    ex = tvm.compile(lower_placement(graph, [group], {backend.name: backend}), target)
    return relax.VirtualMachine(ex, target_device(target))


def time_main(vm, args, dev, cutoff_ms: float | None = None, target_ms: float = 20.0,
              repeat: int = 5, max_batches: int = 4) -> tuple[float, str | None, dict]:
    """Median ms of ``vm["main"](*args)``: warm-up, then batches until two medians agree (3%).

    A first run slower than ``cutoff_ms`` is hopeless: its time is returned at once.
    """
    fn = vm["main"]
    t0 = time.perf_counter()
    fn(*args)
    first_ms = (time.perf_counter() - t0) * 1e3
    if cutoff_ms is not None and first_ms > cutoff_ms:
        return first_ms, f"cut short: first run {first_ms:.3f} ms > cutoff {cutoff_ms:.3f} ms", {
            "repeats": 1}
    fn(*args)  # second warm-up: caches, lazy init in libraries
    number = max(1, int(target_ms / max(first_ms, 1e-3)))
    evaluator = vm.time_evaluator("main", dev, number=number, repeat=repeat)
    samples: list = []
    medians: list = []
    for _ in range(max_batches):
        res = evaluator(*args)
        samples += [r * 1e3 for r in res.results]
        medians.append(statistics.median(samples))
        if len(medians) >= 2 and abs(medians[-1] - medians[-2]) <= 0.03 * medians[-2]:
            break
    return statistics.median(samples), None, {"repeats": len(samples) * number}


def measure_function(func: relax.Function, backend, target, cutoff_ms=None) -> tuple:
    """(cost_ms, reason, extra) of ``func`` on ``backend``; raises on build/run failure."""
    dev = target_device(target)
    vm = build_candidate(func, backend, target)
    args = [tvm.runtime.tensor(a, dev) for a in random_inputs(func.params)]
    return time_main(vm, args, dev, cutoff_ms=cutoff_ms)
