"""Single-backend builds and end-to-end timing: the final check against the placement.

"tvm": TVM alone (``tvm.compile`` with its own fusion). "<lib>": the BYOC habit — every
group the library's patterns match (largest first) goes to it, TVM runs the rest.
"""
from __future__ import annotations

import logging
import math
import statistics
import time

import numpy as np
import tvm
from tvm import relax

from .candidate import Candidate
from .graph.subgraph import random_inputs
from .measure.runner import time_main
from .patterns import generate_candidates
from .target import target_device

logger = logging.getLogger("collage_tvm")


def byoc_groups(graph, backend) -> list:
    """Greedy offload: at each node, the largest candidate of ``backend`` starting there."""
    cands = generate_candidates(graph, [backend])
    best: dict = {}
    for c in cands:
        start = min(c.nodes)
        if start not in best or len(c.nodes) > len(best[start].nodes):
            best[start] = c
    placed: set = set()
    groups = []
    for i in range(len(graph)):
        if i in placed:
            continue
        c = best.get(i)
        if c is not None and not (c.nodes & placed):
            groups.append(c)
            placed |= c.nodes
    groups += [Candidate("tvm", frozenset([i]), "tvm.op") for i in range(len(graph))
               if i not in placed]
    return order_groups(graph, groups)


def order_groups(graph, groups) -> list:
    """Groups in an executable order (producers first); raises if they form a cycle."""
    owner = {i: k for k, g in enumerate(groups) for i in g.nodes}
    deps = [{owner[p] for i in g.nodes for p in graph.nodes[i].inputs} - {k}
            for k, g in enumerate(groups)]
    done, order = set(), []
    while len(order) < len(groups):
        ready = [k for k in range(len(groups)) if k not in done and deps[k] <= done]
        if not ready:
            raise ValueError("groups form a cycle; no executable order")
        k = min(ready, key=lambda k: min(groups[k].nodes))
        done.add(k)
        order.append(groups[k])
    return order


def run_outputs(vm, args) -> list:
    out = vm["main"](*args)
    flat = []

    def walk(o):
        if isinstance(o, (list, tuple)) or type(o).__name__ == "Array":
            for x in o:
                walk(x)
        else:
            flat.append(o.numpy())

    walk(out)
    return flat


def evaluate(executable, graph, target, reference=None, rtol=1e-3, atol=1e-3, seed=0,
             cutoff_ms: float | None = None) -> dict:
    """{"ms": median latency, "outputs": [...], "match": bool|None, "max_err": float,
    "run": a zero-argument function running the model once (for interleaved timing),
    "timed_once": the first timed run passed ``cutoff_ms`` and is the reported time}."""
    dev = target_device(target)
    vm = relax.VirtualMachine(executable, dev)
    args = [tvm.runtime.tensor(a, dev) for a in random_inputs(graph.params, seed)]
    outputs = run_outputs(vm, args)
    ms, why, _ = time_main(vm, args, dev, cutoff_ms=cutoff_ms, target_ms=50.0, repeat=3,
                           max_batches=3)
    main = vm["main"]
    result = {"ms": ms, "outputs": outputs, "match": None, "max_err": math.nan,
              "run": lambda: main(*args), "timed_once": why is not None}
    if reference is not None:
        result["match"], result["max_err"] = compare_outputs(outputs, reference, rtol, atol)
    return result


def compare_outputs(outputs, reference, rtol=1e-3, atol=1e-3) -> tuple:
    """(all outputs close to the reference, max absolute error) of two lists of arrays."""
    outputs = [np.asarray(o) for o in outputs]
    reference = [np.asarray(r) for r in reference]
    errs = [float(np.max(np.abs(a - b))) if a.size else 0.0 for a, b in zip(outputs, reference)]
    match = len(outputs) == len(reference) and all(
        np.allclose(a, b, rtol=rtol, atol=atol) for a, b in zip(outputs, reference))
    return bool(match), max(errs, default=0.0)


def graph_lib_groups(graph, backend) -> list:
    """A graph library running all it can: its valid nodes merged into convex clusters
    (the whole model as one call when it can run every operator), TVM for the rest."""
    from .placer.graph_level import _valid_nodes, merge_offloaded

    valid = _valid_nodes(graph, backend)
    singles = [Candidate(backend.name if i in valid else "tvm", frozenset([i]),
                         f"{backend.name}.graph" if i in valid else "tvm.op")
               for i in range(len(graph))]
    merged = merge_offloaded(graph, singles, {i for i in range(len(graph)) if i in valid})
    return order_groups(graph, merged)


def interleaved(fns: dict, rounds: int = 7, min_ms: float = 200.0) -> dict:
    """Median ms per call of each function, timed in alternating rounds (noise hits all alike).

    Each batch starts with one untimed call: whatever the function before it left behind (a
    library's thread pool still spinning, the cache full of other weights) would otherwise
    slow down whichever function always comes next. Each round starts one function further
    along, so that slow drift of the machine does not favour the first or the last."""
    for fn in fns.values():  # warm-up
        fn()
        fn()
    number = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        number[name] = max(1, int(min_ms / max((time.perf_counter() - t0) * 1e3, 1e-3)))
    samples: dict = {n: [] for n in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            fn()  # lead-in, untimed
            t0 = time.perf_counter()
            for _ in range(number[name]):
                fn()
            samples[name].append((time.perf_counter() - t0) * 1e3 / number[name])
    return {n: statistics.median(s) for n, s in samples.items()}
