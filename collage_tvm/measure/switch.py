"""Switch costs: what a kernel of one backend costs beyond its own time right after a kernel
of another (thread pools of two runtimes waking and competing), measured for every pair.

The op-level DP adds ``switch[(a, b)]`` (``op_level.pair_cost``) where a ``b`` kernel
follows an ``a`` one. Not to be mixed with a backend's call overhead (the paper's epsilon:
``Measurer.epsilon``), which every call of a backend pays, whatever ran before it.
"""
from __future__ import annotations

import math

from tvm import relax

from ..candidates import generate_candidates
from ..graph import DataflowGraph
from ..graph.subgraph import one_op_function
from .keys import SWITCH_KEY


def switch_probes(variant: int = 0) -> list:
    """Kernels big enough to wake a runtime's thread pool (~0.05-0.3 ms on 2 cores), in
    order of preference: an elementwise op, a 3x3 convolution, a GEMM. ``variant`` widens
    the last input dimension, giving a second, distinct kernel of the same kind."""
    import numpy as np

    rng = np.random.default_rng(variant)
    v = variant

    def const(*shape):
        return relax.const(rng.standard_normal(shape).astype("float32"))

    return [
        one_op_function((1, 64, 56, 56 + v), relax.op.nn.relu),
        one_op_function((1, 32, 28, 28 + v),
                        lambda x: relax.op.nn.conv2d(x, const(32, 32, 3, 3), padding=1)),
        one_op_function((64 + v, 256), lambda x: relax.op.matmul(x, const(256, 256))),
    ]


def switch_probe(backend, variant: int = 0) -> relax.Function | None:
    """The first of ``switch_probes(variant)`` that ``backend``'s patterns run as one kernel."""
    for func in switch_probes(variant):
        graph = DataflowGraph(func)
        whole = frozenset(range(len(graph)))
        if any(c.nodes == whole for c in generate_candidates(graph, [backend])):
            return func
    return None


def switch_costs(measurer, backends) -> dict:
    """``(a, b) -> ms``: measured cost of running a kernel of ``b`` right after one of
    ``a`` (thread pools of two runtimes waking and competing), for every pair.

    Each backend runs its ``switch_probe``; a pair is timed alternating against each
    alone (``timing.time_switch``), once per device and library versions (``measurer``'s
    cost DB). ``(a, a)`` is measured for graph libraries: each of their kernels is a session
    of its own (own threads, own state), so two different ones in a row can cost more than
    one repeated; op libraries share one runtime per process and pay nothing there.
    A pair that cannot be measured counts as 0 (the additive model) with a logged reason.
    """
    backends = sorted(backends, key=lambda b: b.name)
    probes = {b.name: switch_probe(b) for b in backends}
    out: dict = {}
    for i, a in enumerate(backends):
        for b in backends[i:]:
            if probes[a.name] is None or probes[b.name] is None:
                continue
            probe_b = probes[b.name]
            if a is b:
                if a.kind != "graph":
                    continue
                probe_b = switch_probe(a, variant=1)
            cost = measurer._cached(
                a.name, f"{a.version()}|{b.version()}", f"{SWITCH_KEY}:{b.name}",
                f"switch {a.name}<->{b.name}",
                lambda a=a, b=b, pb=probe_b: _measure_switch(measurer, a, probes[a.name], b, pb))
            if math.isfinite(cost):
                out[(a.name, b.name)] = cost
    return out


def _measure_switch(measurer, a, func_a, b, func_b) -> tuple:
    return measurer.timer.run("measure_switch", [(a, func_a, None), (b, func_b, None)])
