"""Build a placement, run it on random inputs, compare its outputs, time it end to end."""
from __future__ import annotations

import math
import time

import tvm
from tvm import relax

from ..graph.subgraph import random_inputs
from ..byoc import compile_placement
from ..measure.cuda_graph import capture, flat_numpy
from ..measure.timing import past_second_look, time_main
from .._errors import first_line  # noqa: F401 - re-exported: the check's reasons
from ..precision import Accuracy, compare_outputs  # noqa: F401 - compare_outputs re-exported
from ..target import device_sync, target_device


def run_outputs(vm, args) -> list:
    """The outputs of ``vm["main"](*args)`` as a flat list of numpy arrays."""
    return flat_numpy(vm["main"](*args))


def evaluate(executable, graph, target, reference=None, seed=0,
             cutoff_ms: float | None = None, first_run_counts: bool = False) -> dict:
    """{"ms": median latency, "outputs": [...], "match": bool|None and "max_err" against
    ``reference`` (outputs) by the strict f32 check, whose tolerance follows the outputs'
    scale (``precision.Accuracy.check``), "run": a zero-argument function running the model
    once (for interleaved timing),
    "timed_once": the first timed run passed ``cutoff_ms`` and is the reported time,
    "cuda_graph": None, or on a GPU whether the build runs as one CUDA graph, and if not
    why (``measure.cuda_graph``)}. ``first_run_counts``: the run that gives the outputs is
    the first timed one too (a build with no library to initialise on its first call: an
    untuned TVM build past ``cutoff_ms`` by over ``timing.SECOND_LOOK_MS`` then runs once,
    not twice; nearer the cutoff, ``time_main`` gives it its second look)."""
    dev = target_device(target)
    vm = relax.VirtualMachine(executable, dev)
    args = [tvm.runtime.tensor(a, dev) for a in random_inputs(graph.func, seed)]
    t0 = time.perf_counter()
    outputs = run_outputs(vm, args)
    first_ms = (time.perf_counter() - t0) * 1e3
    if first_run_counts and past_second_look(first_ms, cutoff_ms) \
            and device_sync(target) is None:
        result = {"ms": first_ms, "outputs": outputs, "match": None, "max_err": math.nan,
                  "run": lambda: vm["main"](*args), "timed_once": True, "cuda_graph": None}
    else:
        main = capture(vm, args, target)
        ms, why, _ = time_main(vm, args, dev, cutoff_ms=cutoff_ms, target_ms=50.0, repeat=3,
                               max_batches=3, sync=device_sync(target), run=main)
        result = {"ms": ms, "outputs": outputs, "match": None, "max_err": math.nan,
                  "run": main.replay, "timed_once": why is not None, "cuda_graph": main.state}
    if reference is not None:
        check = Accuracy().check(outputs, reference)
        result["match"], result["max_err"] = check["match"], check["max_err"]
    return result


def outputs_on(executable, graph, target, seeds) -> list:
    """The outputs of the build on the random inputs of each seed: [[arrays] per seed]."""
    dev = target_device(target)
    vm = relax.VirtualMachine(executable, dev)
    return [run_outputs(vm, [tvm.runtime.tensor(a, dev) for a in random_inputs(graph.func, s)])
            for s in seeds]


def tvm_reference(graph, backends: dict, target, seeds) -> list:
    """The outputs of TVM alone in f32 (every node its own TVM kernel) on the random inputs
    of each seed: the reference a reduced-precision build is checked against."""
    from ..placement import single_ops

    executable, _ = compile_placement(graph, single_ops(graph), {"tvm": backends["tvm"]},
                                      target)
    return outputs_on(executable, graph, target, seeds)


def latency_evaluator(graph, backends: dict, target, accuracy=None):
    """``evaluate(groups) -> (ms, reason)`` for the graph-level search: build, run, time.

    The first placement evaluated (the op-level one, the search's seed) gives the reference
    outputs; a later placement whose outputs differ, or whose build fails (a graph library
    that cannot load its subgraph), is invalid: infinite latency and the reason. Under an
    accuracy budget that is not strict (``precision.Accuracy``), the reference is TVM
    alone in f32 and a placement is valid within the budget.
    """
    from ..precision import parse_accuracy

    accuracy = parse_accuracy(accuracy)
    reference: list = [] if accuracy.strict else tvm_reference(graph, backends, target, [0])

    def evaluate_groups(groups):
        try:
            executable, _ = compile_placement(graph, groups, backends, target)
            r = evaluate(executable, graph, target)
        except Exception as err:  # noqa: BLE001 - an invalid individual, not a failed search
            return math.inf, first_line(err)
        if not reference:
            reference.append(r["outputs"])
            return r["ms"], None
        check = accuracy.check(r["outputs"], reference[0])
        if not check["match"]:
            return math.inf, (f"outputs differ from the reference's (max err "
                              f"{check['max_err']:.3g}, {check['rel_err']:.3g} of the scale)")
        return r["ms"], None

    return evaluate_groups
