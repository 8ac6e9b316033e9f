"""mkl backend: run a matched matmul (+ bias) group as one Intel MKL GEMM call.

The binding is ``libmkl_rt`` (MKL's single dynamic library) from the ``mkl`` PyPI wheel,
called through ctypes:

* ``cblas_sgemm`` for a 2-D matmul and for an N-D lhs times a weight shared by the whole
  batch (the lhs batch folds into the GEMM's M);
* ``cblas_sgemm_batch_strided`` for batched matmuls (equal batch dims, or an lhs shared by
  a batched rhs: stride 0);
* a rhs that is ``permute_dims`` of the last two axes (``x @ W^T``, attention's
  ``Q @ K^T``) is passed in place with ``CblasTrans``, never copied;
* a bias (constant, broadcast over the last dim) is written into C first and the GEMM runs
  with ``beta = 1``: the epilogue costs no extra pass over C.

Threading (docs/DNNL_BINDING.md, "MKL binding"): MKL runs on the GNU OpenMP layer
(``MKL_Set_Threading_Layer(MKL_THREADING_GNU)`` before the first call) on the same
``libgomp.so.1`` that torch ships and uses, preloaded by path, so torch (and the dnnl
backend) and MKL share one OpenMP thread pool whichever is imported first. The Intel layer
(``libiomp5``) beside torch's libgomp gave wrong GEMM results here; MKL runs with as many
threads as the cores this process may use (``os.sched_getaffinity``), except GEMMs under
``SINGLE_THREAD_FLOPS``, which run on one thread (``MKL_Set_Num_Threads_Local``).

Tensors cross without copies: inputs by their data pointers (``Tensor.data_ptr()``), the
output is a fresh (64-byte aligned) TVM tensor that MKL writes into.

The library binding (finding ``libmkl_rt``, its ctypes signatures, the threading setup) is
``_binding.py``. This module is the backend's lowering; ``patterns.py`` beside it is its
pattern file.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Callable

import numpy as np

from collage_tvm.backends._common import gemm_probe, op_calls, static_float32_shape
from collage_tvm.backends.mkl._binding import (CBLAS_NO_TRANS, CBLAS_ROW_MAJOR, CBLAS_TRANS,
                                               _Mkl, _load, find_libmkl_rt)
from collage_tvm.lowering import Lowering
from collage_tvm.target import share_now

_INT_MAX = 2**31 - 1  # LP64 interface: MKL_INT is 32 bits
# GEMMs below this many flops run on one thread: a second thread gains nothing there (2 cores:
# 1 MFLOP 9 us on 1 thread, 10-12 us on 2), and when other processes load the cores every
# OpenMP barrier may wait a scheduler tick for a descheduled thread (medians of 8-12 ms seen).
SINGLE_THREAD_FLOPS = 2e6


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"mkl: {what} is not supported")


class MklLowering(Lowering):
    """Lowers one candidate subgraph (a standalone Relax function) to an MKL GEMM callable.

    ``lib_path``: the ``libmkl_rt`` to use (default: :func:`find_libmkl_rt`).
    """

    name = "mkl"
    precision = "f32"

    def __init__(self, lib_path: str | None = None):
        self.lib_path = lib_path

    def _mkl(self) -> _Mkl:
        path = self.lib_path or find_libmkl_rt()
        if path is None:
            raise OSError("libmkl_rt not found (pip install mkl==2026.2.0; looked in "
                          f"{os.path.join(sys.prefix, 'lib')}, the mkl package, the library path)")
        return _load(path)

    def available(self) -> tuple[bool, str]:
        try:
            mkl = self._mkl()
        except Exception as err:  # noqa: BLE001 - available() never raises
            return False, f"cannot load MKL ({type(err).__name__}: {err})"
        if mkl.threading not in ("gnu", "sequential"):
            return False, (f"MKL's threading layer is {mkl.threading!r} (chosen before collage loaded "
                           "it); only GNU OpenMP or sequential is safe beside torch's libgomp")
        return True, ""

    def version(self) -> str:
        try:
            mkl = self._mkl()
        except Exception:  # noqa: BLE001
            return "mkl-unavailable"
        version = f"mkl-{mkl.version}+{mkl.threading}{mkl.threads}"
        return version if self.precision == "f32" else f"{version}-{self.precision}"

    def lower(self, func) -> Callable:
        """Analyse ``func`` and return ``fn(*tvm_tensors) -> tvm.runtime.Tensor``.

        Raises ``NotImplementedError("mkl: ... is not supported")`` for anything that is not
        one matmul (rhs maybe transposed / reshaped in place) followed by a bias add.
        """
        plan = _analyse(func)
        return _build(plan, self._mkl(), self.precision)

    def probe(self):
        """The switching-cost probe: a 1x1 GEMM (the engine's default, an add, is not MKL's)."""
        return gemm_probe()


class MklBf16Lowering(MklLowering):
    """MKL's ``cblas_gemm_bf16bf16f32``: A and B in bf16 (a constant converted once, a
    run-time operand on each call), C and the bias in f32. MKL has no strided-batch bf16
    GEMM: a batched matmul is one call per batch element. Used only under an accuracy
    budget that allows bf16."""

    name = "mkl_bf16"
    precision = "bf16"


# ----------------------------------------------------------------------------- analysis

@dataclass
class _Operand:
    """A GEMM operand: a parameter index or a constant array, maybe read transposed.

    ``shape`` is the logical shape; the memory holds a contiguous array whose last two
    dims are ``shape[-2:]``, or ``shape[-2:][::-1]`` when ``trans``.
    """

    src: object  # int (param index) or np.ndarray
    shape: tuple
    trans: bool = False
    reshaped: bool = False


@dataclass
class _Plan:
    lhs: _Operand
    rhs: _Operand
    out_shape: tuple
    nparams: int
    param_shapes: tuple
    bias: np.ndarray | None = None  # (N,)


def _static_shape(expr, what: str) -> tuple:
    return static_float32_shape(expr, what, _unsupported)


def _swap_last_two(ndim: int) -> list:
    return list(range(ndim - 2)) + [ndim - 1, ndim - 2]


def _view(op: str, value, x: _Operand, out_shape: tuple) -> _Operand:
    """The operand ``op(x)`` for a permute / broadcast / reshape that needs no copy."""
    if op == "relax.permute_dims":
        nd = len(x.shape)
        axes = value.attrs.axes
        axes = list(range(nd))[::-1] if axes is None else [int(a) % nd for a in axes]
        if nd >= 2 and axes == _swap_last_two(nd) and not x.trans and not x.reshaped:
            return _Operand(x.src, out_shape, trans=True)
        if isinstance(x.src, np.ndarray):  # any other permute of a constant: folded once
            return _Operand(np.ascontiguousarray(np.transpose(_materialize(x), axes)), out_shape)
        raise _unsupported(f"permute_dims with axes {axes} of a run-time tensor "
                           "(only a swap of the last two axes)")
    if op == "relax.broadcast_to":
        if out_shape != x.shape:
            raise _unsupported(f"broadcast_to from {list(x.shape)} to {list(out_shape)}")
        return x
    if op == "relax.reshape":
        if not x.trans:
            return _Operand(x.src, out_shape, reshaped=True)  # contiguous: any reshape is a view
        if len(out_shape) < 2 or out_shape[-2:] != x.shape[-2:]:
            raise _unsupported(f"reshape of a transposed tensor from {list(x.shape)} to "
                               f"{list(out_shape)} (only batch dims may merge)")
        return _Operand(x.src, out_shape, trans=True, reshaped=True)
    raise _unsupported(f"{op} before the matmul")


def _materialize(x: _Operand) -> np.ndarray:
    arr = x.src
    if x.trans:
        arr = np.swapaxes(arr, -1, -2)
    return arr.reshape(x.shape)


def _analyse(func) -> _Plan:
    import tvm
    from tvm import relax

    if not isinstance(func, relax.Function):
        raise TypeError(f"mkl: expected a tvm.relax.Function, got {type(func).__name__}")
    params = {p: i for i, p in enumerate(func.params)}
    param_shapes = tuple(_static_shape(p, f"the input {p.name}") for p in func.params)
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        raise _unsupported(f"a function body of kind {type(body).__name__}")
    calls = op_calls(body, _unsupported)
    views: dict = {}  # var -> _Operand (a no-copy view of a parameter or a constant)
    plan, chain = None, None

    def operand(expr) -> _Operand:
        if isinstance(expr, tvm.ir.Constant):
            shape = _static_shape(expr, "a constant")
            return _Operand(np.ascontiguousarray(expr.value.numpy(), dtype=np.float32), shape)
        if expr in views:
            return views[expr]
        if expr in params:
            return _Operand(params[expr], param_shapes[params[expr]])
        raise _unsupported(f"the operand {expr} (not a parameter or a constant of the subgraph)")

    for var, value, op in calls:
        out_shape = _static_shape(value, f"the result of {op}")
        if plan is None:
            if op != "relax.matmul":
                views[var] = _view(op, value, operand(value.args[0]), out_shape)
                continue
            plan = _analyse_matmul(value, operand, out_shape, len(params), param_shapes)
            chain = var
            continue
        chain_args = [i for i, a in enumerate(value.args) if a.same_as(chain)]
        if op != "relax.add" or len(chain_args) != 1:
            raise _unsupported(f"{op} after the matmul (only a bias add)")
        if out_shape != plan.out_shape:
            raise _unsupported("an add that broadcasts the matmul's output")
        _analyse_bias(plan, value.args[1 - chain_args[0]], operand)
        chain = var
    if plan is None:
        raise _unsupported("a subgraph without a matmul")
    if not body.body.same_as(chain):
        raise _unsupported("a subgraph that does not return the result of its last op")
    return plan


def _analyse_matmul(call, operand, out_shape, nparams, param_shapes) -> _Plan:
    if str(call.attrs.out_dtype or "float32") not in ("float32", "void"):
        raise _unsupported(f"matmul with out_dtype {call.attrs.out_dtype}")
    lhs, rhs = operand(call.args[0]), operand(call.args[1])
    if lhs.trans:
        raise _unsupported("a transposed lhs")
    if not 2 <= len(lhs.shape) <= 4 or not 2 <= len(rhs.shape) <= 4:
        raise _unsupported(f"matmul of ranks {len(lhs.shape)} x {len(rhs.shape)} (2..4 only)")
    if 0 in lhs.shape or 0 in rhs.shape:
        raise _unsupported("matmul with an empty dimension")
    if lhs.shape[-1] != rhs.shape[-2]:
        raise _unsupported(f"matmul of {list(lhs.shape)} x {list(rhs.shape)}")
    if _batch_mode(lhs.shape, rhs.shape) is None:
        raise _unsupported(f"mixed batch broadcast {list(lhs.shape[:-2])} x {list(rhs.shape[:-2])} "
                           "(equal batch dims, or one side unbatched)")
    if int(np.prod(out_shape)) > _INT_MAX or int(np.prod(lhs.shape)) > _INT_MAX or \
            int(np.prod(rhs.shape)) > _INT_MAX:
        raise _unsupported("a matmul with more than 2**31 elements per operand (LP64 MKL)")
    return _Plan(lhs, rhs, out_shape, nparams, param_shapes)


def _batch_mode(lhs: tuple, rhs: tuple) -> str | None:
    lb, rb = list(lhs[:-2]), list(rhs[:-2])
    n = max(len(lb), len(rb))
    lb, rb = [1] * (n - len(lb)) + lb, [1] * (n - len(rb)) + rb
    if all(d == 1 for d in rb):
        return "fold"      # one GEMM, the lhs batch folded into M
    if all(d == 1 for d in lb):
        return "shared_a"  # batched GEMM, A stride 0
    if lb == rb:
        return "strided"
    return None


def _analyse_bias(plan: _Plan, other, operand) -> None:
    value = operand(other)
    if not isinstance(value.src, np.ndarray):
        raise _unsupported("an add of a run-time tensor (only a constant bias)")
    shape, n = value.shape, plan.out_shape[-1]
    if not (1 <= len(shape) <= len(plan.out_shape) and shape[-1] == n and all(d == 1 for d in shape[:-1])):
        raise _unsupported(f"add of a {list(shape)} operand to the {list(plan.out_shape)} output "
                           "(only a constant bias broadcast over the last dim)")
    bias = _materialize(value).reshape(n).astype(np.float32)
    plan.bias = bias if plan.bias is None else plan.bias + bias


# ----------------------------------------------------------------------------- kernel

def _gemm(plan: _Plan, mkl: _Mkl, precision: str, mode: str, batch: int) -> Callable:
    """``gemm(a, b, c)``: the MKL call(s) of ``plan`` on the three pointers, every other
    argument fixed. ``precision`` "bf16": A and B in bf16 (``cblas_gemm_bf16bf16f32``)."""
    lhs, rhs = plan.lhs, plan.rhs
    m, k = lhs.shape[-2], lhs.shape[-1]
    n = rhs.shape[-1]
    transb = CBLAS_TRANS if rhs.trans else CBLAS_NO_TRANS
    ldb = k if rhs.trans else n
    beta = 0.0 if plan.bias is None else 1.0
    if precision == "bf16":
        gemm_bf16, stride_a = mkl.gemm_bf16, 0 if mode == "shared_a" else m * k
        rows = int(np.prod(lhs.shape[:-1], dtype=np.int64)) if mode == "fold" else m
        calls = [(0, 0, 0)] if mode == "fold" else [  # byte offsets of A, B, C per batch
            (2 * i * stride_a, 2 * i * k * n, 4 * i * m * n) for i in range(batch)]

        def gemm(a, b, c):
            for da, db, dc in calls:
                gemm_bf16(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, transb, rows, n, k, 1.0, a + da, k,
                          b + db, ldb, beta, c + dc, n)
    elif mode == "fold":
        rows = int(np.prod(lhs.shape[:-1], dtype=np.int64))
        sgemm = mkl.sgemm

        def gemm(a, b, c):
            sgemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, transb, rows, n, k, 1.0, a, k, b, ldb, beta, c, n)
    else:
        stride_a = 0 if mode == "shared_a" else m * k
        batched = mkl.sgemm_batch_strided

        def gemm(a, b, c):
            batched(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, transb, m, n, k, 1.0, a, k, stride_a,
                    b, ldb, k * n, beta, c, n, m * n, batch)
    return gemm


def _allocator(out_shape, f32, dev) -> Callable:
    """``alloc(shape, dtype, device, scope)``: what ``tvm.runtime.empty`` calls, without its
    per-call argument conversions (~3 us); the public API on a TVM without it."""
    import tvm

    try:
        from tvm.runtime import _ffi_api

        alloc = _ffi_api.TVMTensorAllocWithScope
        alloc(out_shape, f32, dev, None)
        return alloc
    except Exception:  # noqa: BLE001 - another TVM: the public API
        def alloc(shape, dtype, device, scope):
            return tvm.runtime.empty(shape, dtype, device)
        return alloc


def _build(plan: _Plan, mkl: _Mkl, precision: str = "f32") -> Callable:
    """Fix every GEMM argument but the three pointers; return the per-call function.
    ``precision`` "bf16": A and B in bf16 (``cblas_gemm_bf16bf16f32``), C in f32."""
    import tvm
    import tvm_ffi

    lhs, rhs = plan.lhs, plan.rhs
    m, k = lhs.shape[-2], lhs.shape[-1]
    n = rhs.shape[-1]
    mode = _batch_mode(lhs.shape, rhs.shape)
    batch = int(np.prod(plan.out_shape[:-2], dtype=np.int64))
    gemm = _gemm(plan, mkl, precision, mode, batch)

    # This thread's MKL thread count: 1 for a small GEMM, 0 (the global count) otherwise.
    # Changed only when it differs from the last kernel's (one ctypes call is ~0.6 us).
    # In a concurrent stage (``collage_tvm.target.thread_share``): at most its share.
    share = share_now()
    local_threads = 1 if 2.0 * batch * m * n * k < SINGLE_THREAD_FLOPS else (share or 0)
    set_local, tls = mkl.set_num_threads_local, mkl.tls
    # Constants live as long as the callable; their pointers are fixed.
    consts = [_in_precision(x.src, precision) for x in (lhs, rhs)]
    a_const, b_const = (_address(c) for c in consts)
    pointer = _bf16_pointer if precision == "bf16" else _f32_pointer
    a_i = None if a_const is not None else lhs.src
    b_i = None if b_const is not None else rhs.src
    bias = plan.bias
    nparams, param_shapes = plan.nparams, plan.param_shapes
    out_shape = tvm_ffi.Shape(list(plan.out_shape))
    f32, dev = tvm_ffi.dtype("float32"), tvm.cpu(0)
    alloc = _allocator(out_shape, f32, dev)

    def run(*args):
        if len(args) != nparams:
            raise TypeError(f"mkl kernel takes {nparams} tensors, got {len(args)}")
        for t, shape in zip(args, param_shapes):
            if t.shape != shape:
                raise ValueError(f"mkl kernel: input of shape {tuple(t.shape)}, expected {shape}")
        if getattr(tls, "threads", 0) != local_threads:
            set_local(local_threads)
            tls.threads = local_threads
        out = alloc(out_shape, f32, dev, None)  # 64-byte aligned, compact
        if bias is not None:
            np.copyto(np.from_dlpack(out), bias)  # C = bias; the GEMM adds with beta = 1
        keep: list = []  # run-time operands converted to bf16 live until the GEMM returns
        gemm(a_const if a_i is None else pointer(args[a_i], keep),
             b_const if b_i is None else pointer(args[b_i], keep), out.data_ptr())
        return out

    run.__name__ = (f"mkl_{'sgemm' if mode == 'fold' else 'sgemm_batch_strided'}"
                    if precision == "f32" else "mkl_gemm_bf16bf16f32")
    run.mkl_plan = plan
    run.mkl_threads = local_threads or mkl.threads
    run._consts = consts  # keep the constant buffers alive
    return run


def _in_precision(src, precision: str):
    """A constant operand as the GEMM reads it (a bf16 torch tensor for bf16); a parameter
    index stays as it is."""
    if not isinstance(src, np.ndarray) or precision == "f32":
        return src
    import torch

    return torch.from_numpy(np.ascontiguousarray(src)).to(torch.bfloat16)


def _address(const):
    """The data pointer of a constant operand, None for a parameter index."""
    if isinstance(const, np.ndarray):
        return const.ctypes.data
    return None if isinstance(const, int) else const.data_ptr()


def _f32_pointer(tensor, keep: list) -> int:
    return tensor.data_ptr()


def _bf16_pointer(tensor, keep: list) -> int:
    """A run-time f32 operand converted to bf16 (kept in ``keep`` while MKL reads it)."""
    import torch

    converted = torch.from_dlpack(tensor).to(torch.bfloat16)
    keep.append(converted)
    return converted.data_ptr()
