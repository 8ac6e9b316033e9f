"""onnxruntime backend (kind ``graph``): a Relax subgraph exported to ONNX, run by ONNX Runtime.

One ``InferenceSession`` per subgraph (CPU execution provider, all graph optimizations,
as many intra-op threads as the process has cores). By default each session has its own
thread pool, whose threads do not spin between calls unless the subgraph is the whole
model (spinning threads starve the next runtime's threads; collage_tvm/__init__.py).
Each call binds the TVM input buffers and freshly allocated output buffers with ONNX
Runtime's I/O binding, so no tensor is copied on the way in or out.

``COLLAGE_ORT_SHARED_POOL=1`` puts every session on ONNX Runtime's global thread pool
instead. Measured on ResNet-50 (2 cores, op-level placement with 56-78 onnxruntime calls):
the calls took 87 ms in context with a pool each (45 ms alone) and 49 ms with the shared
pool (41 ms alone); but the shared pool's threads spin after each call, and an MKL GEMM
right after the last onnxruntime call took 20 ms instead of 0.18, while dnnl+tvm timed
next to onnxruntime builds slowed down. It is also a process-wide choice: once it is set
up, ONNX Runtime refuses any session in the process that asks for its own pool (a user's
own sessions included). Hence opt-in. The version string (the cost DB key) says which.

This module is the backend's lowering; ``patterns.py`` beside it is its pattern file.
"""
from __future__ import annotations

import os

import numpy as np

from collage_tvm.backends._graphlib import (GraphLibraryLowering, as_numpy, model_source,
                                            new_output, single_or_tuple, threads)

_NP = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32,
       "int8": np.int8, "uint8": np.uint8,
       "bool": np.bool_, "float64": np.float64}


_GLOBAL_POOL: bool | None = None  # None: not tried yet in this process


def _whole_call(sess, in_names: list, out_names: list, specs: list, run_options):
    """The callable of a session that runs the whole model: ``run`` on zero-copy views of
    the inputs, each output handed to TVM by DLPack (copied once into an aligned buffer
    where ONNX Runtime's is not 64-byte aligned, as TVM requires). The I/O binding path of
    the pieces was measurably slower than ``run`` for a whole small model (the commit that
    made this change has the figures).

    As little Python as possible runs per call: right after a run, while ONNX Runtime's
    threads spin, every step here took many times its usual time (on the 2-core AMX Xeon:
    ``ndarray.ctypes`` 15 us instead of 0.8), and the ~40 us this callable spent around the
    run was 1-3% of a small model's latency (docs/COVERAGE.md)."""
    import tvm

    run = sess._sess.run  # the public wrapper only adds checks
    from_dlpack, view = tvm.runtime.from_dlpack, np.from_dlpack

    def _to_tvm(array, spec):
        try:
            return from_dlpack(array)  # 64-byte aligned and contiguous: no copy
        except Exception:  # noqa: BLE001 - TVM refuses it: one aligned copy
            out, buffer = new_output(array.shape, spec[1])  # (a dynamic model: its shape)
            buffer[...] = array
            return out

    if len(out_names) == 1 and len(in_names) == 1:
        (name,), spec = in_names, specs[0]

        def call(arg):
            return _to_tvm(run(out_names, {name: view(arg)}, run_options)[0], spec)
    else:
        def call(*args):
            outs = run(out_names, {n: view(a) for n, a in zip(in_names, args)}, run_options)
            return single_or_tuple([_to_tvm(o, spec) for o, spec in zip(outs, specs)])

    def numpy_call(*arrays):  # numpy in, ONNX Runtime's fresh numpy outputs out
        return run(out_names, dict(zip(in_names, arrays)), run_options)

    call.session = sess
    call.numpy_call = numpy_call  # (``artifact.LoadedModule``: a build that is this file)
    return call


def _global_pool() -> bool:
    """Set up ONNX Runtime's process-wide thread pool once (only with
    COLLAGE_ORT_SHARED_POOL=1); False when off or when it cannot be set up."""
    global _GLOBAL_POOL
    if _GLOBAL_POOL is None and os.environ.get("COLLAGE_ORT_SHARED_POOL", "0") != "1":
        _GLOBAL_POOL = False
    if _GLOBAL_POOL is None:
        try:
            from onnxruntime.capi import _pybind_state

            _pybind_state.set_global_thread_pool_sizes(threads(), 1)
            _GLOBAL_POOL = True
        except Exception as err:  # noqa: BLE001 - per-session pools still work
            _disable_global_pool(err)
    return _GLOBAL_POOL


def _disable_global_pool(err: BaseException) -> None:
    global _GLOBAL_POOL
    import logging

    logging.getLogger("collage_tvm").info(
        "onnxruntime: no shared thread pool (%s: %s); one pool per session",
        type(err).__name__, err)
    _GLOBAL_POOL = False


class OnnxRuntimeLowering(GraphLibraryLowering):
    name = "onnxruntime"
    reads_files = True

    def available(self) -> tuple[bool, str]:
        try:
            import onnx  # noqa: F401
            import onnxruntime as ort

            if "CPUExecutionProvider" not in ort.get_available_providers():
                return False, "onnxruntime has no CPUExecutionProvider"
            from collage_tvm.export import onnx as _export  # noqa: F401
        except Exception as err:  # noqa: BLE001 - available() never raises
            return False, f"{type(err).__name__}: {err}"
        return True, ""

    def version(self) -> str:
        try:
            import onnxruntime as ort

            # "-in-place": a piece of a model is timed with its threads not spinning, as it
            # runs among other groups (costs measured before that are not reused).
            return (f"onnxruntime-{ort.__version__}-in-place"
                    + ("-shared-pool" if _global_pool() else ""))
        except Exception:  # noqa: BLE001
            return "onnxruntime-unavailable"

    def session(self, source, spin: bool = True, shared_pool: bool = True):
        """An ``InferenceSession`` of ``source`` (model bytes or an ONNX file's path) on the
        shared global thread pool when ``shared_pool`` and the pool is available, else on
        its own pool (spinning between calls iff ``spin``)."""
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        opts.log_severity_level = 3
        if shared_pool and _global_pool():
            opts.use_per_session_threads = False
            try:
                return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
            except Exception as err:  # noqa: BLE001 - fall back to a pool of its own
                _disable_global_pool(err)
                opts.use_per_session_threads = True
        opts.intra_op_num_threads = threads()
        opts.inter_op_num_threads = 1
        if not spin:  # see collage_tvm/__init__.py: spinning threads starve other runtimes
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])

    def compile(self, model, specs, sole: bool = False):
        # Spinning threads help only when nothing else runs between two calls: the whole
        # model on onnxruntime. Anywhere else they starve the next runtime's threads.
        with model_source(model) as source:  # a path when over protobuf's 2 GiB
            sess = self.session(source, spin=sole)
        in_names = [i.name for i in sess.get_inputs()]
        out_names = [o.name for o in sess.get_outputs()]
        if len(out_names) != len(specs):
            raise RuntimeError(f"onnxruntime: session has {len(out_names)} outputs, "
                               f"the subgraph {len(specs)}")
        import onnxruntime as ort

        run_options = ort.RunOptions()
        if sole:
            return _whole_call(sess, in_names, out_names, specs, run_options)
        binding = sess.io_binding()
        run = sess._sess.run_with_iobinding  # the public wrapper only adds an error check
        bind_input, bind_output = binding.bind_input, binding.bind_output
        out_np = [_NP[d] for _, d in specs]

        def call(*args):
            for name, a in zip(in_names, args):
                view = as_numpy(a)
                bind_input(name, "cpu", 0, view.dtype, view.shape, view.ctypes.data)
            outs = []
            for name, (shape, dtype), npdt in zip(out_names, specs, out_np):
                out, view = new_output(shape, dtype)
                bind_output(name, "cpu", 0, npdt, shape, view.ctypes.data)
                outs.append(out)
            run(binding._iobinding, run_options)
            return single_or_tuple(outs)

        call.session = sess  # keep the session alive with the callable
        return call
