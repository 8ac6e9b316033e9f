"""dnnl backend: run a matched conv2d / conv3d / matmul group on oneDNN, post-ops fused.

The binding is the oneDNN that PyTorch's CPU build carries, called through torch's
inference entry points (``torch.ops.mkldnn``, as inductor emits them, and
``torch.ops.mkldnn_prepacked``, as TorchScript freezing does); docs/DNNL_BINDING.md has
the measurements behind the choice:

* conv2d: ``torch.ops.mkldnn_prepacked.conv2d_prepack`` once in :meth:`DnnlLowering.lower`
  (weight reordered to oneDNN's blocked layout, primitive parameters cached, bias and
  relu fused), ``conv2d_run`` per call; NCHW in and out without layout conversions;
* conv3d and conv2d+gelu: ``torch.ops.mkldnn._convolution_pointwise`` (unary post-op fused);
* matmul with a constant weight: ``torch.ops.mkldnn._reorder_linear_weight`` once,
  ``torch.ops.mkldnn._linear_pointwise`` per call (bias + relu/gelu fused), and its
  ``.binary`` overload for a residual add fused as a oneDNN binary post-op;
* 2-D matmul of two run-time tensors: ``_linear_pointwise`` on the transposed view.

A residual add on a convolution runs right after the oneDNN kernel as one in-place
``aten._add_relu_`` (or ``add_``): torch fuses the oneDNN binary post-op only for
channels-last tensors, and converting three NCHW tensors to channels-last and back
costs more than the fused add saves (docs/DNNL_BINDING.md, rows R1/R2).

Tensors cross by DLPack without copies: ``torch.from_dlpack`` on the way in and
``tvm.runtime.from_dlpack`` on the way out; the DLPack capsule keeps the torch result
alive for as long as TVM holds the returned tensor.

This module is the backend's lowering; ``patterns.py`` beside it is its pattern file.
"""
from __future__ import annotations

import functools
import re
from typing import Callable

import numpy as np

from collage_tvm.backends._common import gemm_probe
from collage_tvm.backends._epilogue import Plan, analyse
from collage_tvm.lowering import Lowering

_TORCH_OPS = (("mkldnn", "_convolution_pointwise"), ("mkldnn", "_linear_pointwise"),
              ("mkldnn", "_reorder_linear_weight"), ("mkldnn_prepacked", "conv2d_prepack"),
              ("mkldnn_prepacked", "conv2d_run"), ("aten", "_add_relu_"))


class DnnlLowering(Lowering):
    """Lowers one candidate subgraph (a standalone Relax function) to a oneDNN callable."""

    name = "dnnl"
    precision = "f32"

    def available(self) -> tuple[bool, str]:
        try:
            import torch
        except Exception as err:  # noqa: BLE001 - any import failure means "not here"
            return False, f"torch is not importable ({type(err).__name__}: {err})"
        try:
            if not torch.backends.mkldnn.is_available():
                return False, "this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)"
            for ns, op in _TORCH_OPS:
                try:
                    getattr(getattr(torch.ops, ns), op)
                except (AttributeError, RuntimeError):
                    return False, f"torch {torch.__version__} lacks the oneDNN entry point torch.ops.{ns}.{op}"
            if _onednn_version() is None:
                return False, "cannot read the oneDNN version from torch.__config__.show()"
        except Exception as err:  # noqa: BLE001 - available() never raises
            return False, f"{type(err).__name__}: {err}"
        return True, ""

    def version(self) -> str:
        try:
            import torch
        except Exception:  # noqa: BLE001
            return "onednn-unavailable"
        version = f"onednn-{_onednn_version() or 'unknown'}+torch-{torch.__version__.split('+')[0]}"
        return version if self.precision == "f32" else f"{version}-{self.precision}"

    def lower(self, func) -> Callable:
        """Analyse ``func`` and return ``fn(*tvm_tensors) -> tvm.runtime.Tensor``.

        Raises ``NotImplementedError("dnnl: ... is not supported")`` for anything that is
        not one conv2d/conv3d/matmul followed by bias / residual add / relu / gelu.
        """
        plan = analyse(func, "dnnl")
        return _build(plan, self.precision)

    def probe(self):
        """The switching-cost probe (collage_tvm.measure): the smallest kernel dnnl runs.

        The engine's default probe, a 1-element ``add``, is not a dnnl op; a 1x1 inner
        product measures the same thing: one call's overhead through torch and DLPack.
        """
        return gemm_probe()


class DnnlBf16Lowering(DnnlLowering):
    """The same oneDNN primitives in bf16 (AVX512-BF16 / AMX kernels): weights, bias and a
    constant residual converted once when the kernel is built, the activations on each
    call, the result back to f32. Used only under an accuracy budget that allows bf16."""

    name = "dnnl_bf16"
    precision = "bf16"


@functools.lru_cache(maxsize=1)
def _onednn_version() -> str | None:
    import torch

    found = re.search(r"(?:MKL-DNN|oneDNN)\s+v(\d+(?:\.\d+)*)", torch.__config__.show())
    return found.group(1) if found else None


# ----------------------------------------------------------------------------- kernels

def _build(plan: Plan, precision: str = "f32") -> Callable:
    """Pack the constants once; return the per-call function. ``precision`` "bf16": the
    kernel computes in bf16 between f32 inputs and output (converted on each call)."""
    import torch
    import tvm

    ops, prepacked, aten = torch.ops.mkldnn, torch.ops.mkldnn_prepacked, torch.ops.aten
    unary, algo = plan.unary or ("none", "")
    fused = unary if plan.residual is None or plan.anchor == "relax.matmul" else "none"
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32

    def const(arr):
        return None if arr is None else torch.from_numpy(arr.copy()).to(dtype)

    with torch.inference_mode():
        bias = const(plan.bias)
        weight = const(plan.weight) if isinstance(plan.weight, np.ndarray) else None
        const_residual = const(plan.residual) if isinstance(plan.residual, np.ndarray) else None

        if plan.anchor == "relax.nn.conv2d" and fused in ("none", "relu"):
            ctx = prepacked.conv2d_prepack(weight, bias, list(plan.stride), list(plan.padding),
                                           list(plan.dilation), plan.groups, list(plan.data_shape), fused)

            def kernel(x, w, r):
                return prepacked.conv2d_run(x, ctx)
        elif plan.anchor in ("relax.nn.conv2d", "relax.nn.conv3d"):
            # A pre-packed (mkldnn-layout) weight switches torch to channels-last I/O: two layout
            # conversions per call on NCHW tensors. The dense weight keeps NC(D)HW in and out.
            conv_args = (list(plan.padding), list(plan.stride), list(plan.dilation), plan.groups)

            def kernel(x, w, r):
                return ops._convolution_pointwise(x, weight, bias, *conv_args, fused, [], algo)
        else:  # matmul: x @ W (W constant, pre-packed) or x @ w (2-D run-time rhs, transposed view)
            packed = None
            if weight is not None:
                packed = ops._reorder_linear_weight(weight, int(np.prod(plan.out_shape[:-1])))

            def kernel(x, w, r):
                wt = packed if packed is not None else w.t()
                if r is None:
                    return ops._linear_pointwise(x, wt, bias, fused, [], algo)
                y = ops._linear_pointwise.binary(x, r, wt, bias, "add")  # oneDNN binary post-op
                return y.relu_() if unary == "relu" else y

    conv_residual = plan.residual is not None and plan.anchor != "relax.matmul"
    data_i, nparams = plan.data, plan.nparams
    weight_i = plan.weight if isinstance(plan.weight, int) else None
    res_i = plan.residual if isinstance(plan.residual, int) else None
    from_torch = tvm.runtime.from_dlpack  # zero-copy; needs a contiguous, 64-byte aligned tensor
    if dtype is torch.float32:
        to_torch = torch.from_dlpack
    else:
        def to_torch(t):
            return torch.from_dlpack(t).to(dtype)

    def run(*args):
        if len(args) != nparams:
            raise TypeError(f"dnnl kernel takes {nparams} tensors, got {len(args)}")
        with torch.inference_mode():
            x = to_torch(args[data_i])
            w = None if weight_i is None else to_torch(args[weight_i])
            r = const_residual if res_i is None else to_torch(args[res_i])
            y = kernel(x, w, r)
            if conv_residual:  # one in-place pass right after the oneDNN kernel
                if unary != "relu":
                    y = y.add_(r)
                elif y.dtype is torch.float32:
                    y = aten._add_relu_(y, r)
                else:  # aten's fused add_relu is f32 only
                    y = y.add_(r).relu_()
            if y.dtype is not torch.float32:
                y = y.float()
        if not y.is_contiguous():
            y = y.contiguous()
        return from_torch(y)

    run.__name__ = f"dnnl_{plan.anchor.rsplit('.', 1)[-1]}"
    run.dnnl_plan = plan
    return run
