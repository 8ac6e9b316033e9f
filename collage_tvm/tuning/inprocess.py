"""MetaSchedule's builder and runner, in this process.

The stock ``LocalBuilder`` starts worker processes that each import every target's tensor
intrinsics (CUDA's alone ~30 s, 45-53 s in all on our machines), past its 30 s timeout,
and re-creates the pool per batch: every build timed out. Here a candidate schedule is
compiled with ``tvm.compile`` and timed with MetaSchedule's own evaluator in the same
process; the built module is handed from builder to runner through a table, keyed by a
name that looks like an artifact path (the runner removes the entry). A schedule that
fails to build or run is a result with its error, as with the stock ones.
"""
from __future__ import annotations

import itertools
import threading

import numpy as np
import tvm
from tvm.ir.utils import derived_object
from tvm.s_tir.meta_schedule.builder import BuilderResult, PyBuilder
from tvm.s_tir.meta_schedule.runner import (EvaluatorConfig, PyRunner, PyRunnerFuture,
                                            RunnerResult)
from tvm.s_tir.meta_schedule.runner.utils import alloc_argument_common, run_evaluator_common

_BUILT: dict = {}
_LOCK = threading.Lock()
_IDS = itertools.count()

#: Timing of one candidate schedule: at least 30 ms of calls, 3 repeats (median kept by
#: MetaSchedule's mean of run_secs; the evaluator already amortises the call).
EVALUATOR = EvaluatorConfig(number=1, repeat=3, min_repeat_ms=30, enable_cpu_cache_flush=False)


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip()[:1000]}"


def tensor_intrinsics(target) -> None:
    """Register the tensor intrinsics a schedule for ``target`` uses (x86's on a CPU,
    CUDA's on a GPU) without running ``tvm.s_tir.tensor_intrin``'s ``__init__``, which
    imports every target's: 45-53 s on our machines, and minutes in a process that holds
    many modules (each intrinsic's TVMScript parse walks the stack through
    ``inspect.getmodule``, which scans ``sys.modules``; 234 s measured in the test run).

    The package is put in ``sys.modules`` unexecuted, then the one submodule imported: a
    later ``import tvm.s_tir.tensor_intrin`` (MetaSchedule's ``TuneContext``) finds it
    there, and any other submodule still imports on request."""
    import importlib
    import importlib.util
    import sys

    import tvm.s_tir

    name = "tvm.s_tir.tensor_intrin"
    if name not in sys.modules:
        package = importlib.util.module_from_spec(importlib.util.find_spec(name))
        sys.modules[name] = package
        tvm.s_tir.tensor_intrin = package
    kind = target.kind.name if hasattr(target, "kind") else str(target)
    importlib.import_module(f"{name}.{'cuda' if kind == 'cuda' else 'x86'}")


def build_kernel(mod: tvm.IRModule, target):
    """The runtime module of a scheduled (or unscheduled) TIR workload."""
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    tensor_intrinsics(target)

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.compile(mod, target=target).mod


def _fill(array) -> None:
    """Random inputs for a candidate: uniform floats, small integers (indices stay valid)."""
    rng = np.random.default_rng(0)
    dtype = str(array.dtype)
    if "float" in dtype:
        data = rng.uniform(-1, 1, array.shape).astype(dtype)
    else:
        data = np.zeros(array.shape, dtype=dtype)
    array.copyfrom(data)


def time_kernel(rt_mod, args_info, config: EvaluatorConfig = EVALUATOR) -> list:
    """Seconds per call (one per repeat) of ``rt_mod`` on random arguments."""
    dev = tvm.cpu()
    args = alloc_argument_common(_fill, dev, args_info, 1)
    return [float(s) for s in run_evaluator_common(rt_mod, dev, config, args)]


@derived_object
class InProcessBuilder(PyBuilder):
    """Builds each candidate schedule with ``tvm.compile`` here."""

    def build(self, build_inputs):
        out = []
        for bi in build_inputs:
            try:
                rt = build_kernel(bi.mod, bi.target)
            except Exception as err:  # noqa: BLE001 - a failed schedule is a result
                out.append(BuilderResult(None, _error(err)))
                continue
            name = f"collage-inprocess/{next(_IDS)}"
            with _LOCK:
                _BUILT[name] = rt
            out.append(BuilderResult(name, None))
        return out


@derived_object
class _Ready(PyRunnerFuture):
    def __init__(self, result) -> None:
        super().__init__()
        self._result = result

    def done(self) -> bool:
        return True

    def result(self):
        return self._result


@derived_object
class InProcessRunner(PyRunner):
    """Times each built candidate here with MetaSchedule's evaluator."""

    def __init__(self, config: EvaluatorConfig = EVALUATOR) -> None:
        super().__init__()
        self.config = config

    def run(self, runner_inputs):
        futures = []
        for ri in runner_inputs:
            with _LOCK:
                rt = _BUILT.pop(ri.artifact_path, None)
            if rt is None:
                futures.append(_Ready(RunnerResult(None, f"no built module {ri.artifact_path}")))
                continue
            try:
                secs = time_kernel(rt, [a.as_json() for a in ri.args_info], self.config)
                futures.append(_Ready(RunnerResult(secs, None)))
            except Exception as err:  # noqa: BLE001 - a failed run is a result
                futures.append(_Ready(RunnerResult(None, _error(err))))
        return futures
