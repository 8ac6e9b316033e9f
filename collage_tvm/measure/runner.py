"""Build one candidate on its backend and time it (in whatever process calls this)."""
from __future__ import annotations

import statistics
import time

import tvm
from tvm import relax

from ..candidate import Candidate
from ..graph import DataflowGraph
from ..graph.subgraph import random_inputs
from ..lower import lower_placement, release_with
from ..target import target_device


def build_candidate(func: relax.Function, backend, target):
    """A VM running ``func`` exactly as the final build would run that group."""
    graph = DataflowGraph(func)
    group = Candidate(backend.name, frozenset(range(len(graph))), "measure")
    lowered = lower_placement(graph, [group], {backend.name: backend})
    ex = tvm.compile(lowered, target)
    release_with(ex, lowered)
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


def time_switch(fn_a, args_a, fn_b, args_b, rounds: int = 9, target_ms: float = 8.0) -> tuple:
    """(switch_ms, extra): what one change of runtime costs between two kernels.

    Each round times ``a`` alone, ``b`` alone and ``a, b`` alternating (the same number of
    calls each, interleaved so drift hits all three); the switch cost is half the median
    excess of an alternating pair over one ``a`` plus one ``b`` (a pair holds two switches).
    """
    def loop(seq, n):
        t0 = time.perf_counter()
        for _ in range(n):
            for fn, args in seq:
                fn(*args)
        return (time.perf_counter() - t0) * 1e3 / n

    a, b = (fn_a, args_a), (fn_b, args_b)
    for _ in range(3):  # warm-up: lazy init, caches, thread pools
        loop([a, b], 5)
    pair_ms = loop([a, b], 10)
    n = max(5, int(target_ms / max(pair_ms, 1e-3)))
    excess, ta, tb, tab = [], [], [], []
    for _ in range(rounds):
        ta.append(loop([a], n))
        tb.append(loop([b], n))
        tab.append(loop([a, b], n))
        excess.append(tab[-1] - ta[-1] - tb[-1])
    med = statistics.median
    return max(0.0, med(excess) / 2), {"a_ms": med(ta), "b_ms": med(tb), "pair_ms": med(tab),
                                       "repeats": rounds * n}


def measure_switch(func_a, backend_a, func_b, backend_b, target) -> tuple:
    """(switch_ms, reason, extra) between two backends, each running its own probe kernel."""
    dev = target_device(target)
    fns = []
    for func, backend in ((func_a, backend_a), (func_b, backend_b)):
        vm = build_candidate(func, backend, target)
        fns += [vm["main"], [tvm.runtime.tensor(x, dev) for x in random_inputs(func.params)], vm]
    cost, extra = time_switch(fns[0], fns[1], fns[3], fns[4])
    return cost, None, extra


def time_side_by_side(runs: list, rounds: int = 9, target_ms: float = 10.0) -> list:
    """Median ms per call of each ``(fn, args)``, timed in alternating rounds (the same
    drift hits each), after two warm-up calls each."""
    def loop(fn, args, n):
        t0 = time.perf_counter()
        for _ in range(n):
            fn(*args)
        return (time.perf_counter() - t0) * 1e3 / n

    for fn, args in runs:
        fn(*args)
        fn(*args)
    number = [max(1, int(target_ms / max(loop(fn, args, 1), 1e-3))) for fn, args in runs]
    samples: list = [[] for _ in runs]
    for _ in range(rounds):
        for k, (fn, args) in enumerate(runs):
            samples[k].append(loop(fn, args, number[k]))
    return [statistics.median(s) for s in samples]


def measure_side_by_side(funcs: list, target) -> tuple:
    """(list of ms, None, extra) of ``[(func, backend), ...]`` timed side by side."""
    dev = target_device(target)
    runs, vms = [], []
    for func, backend in funcs:
        vm = build_candidate(func, backend, target)
        vms.append(vm)
        runs.append((vm["main"], [tvm.runtime.tensor(x, dev) for x in random_inputs(func.params)]))
    return time_side_by_side(runs), None, {}
