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
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from collage_tvm.backends._common import gemm_probe, op_calls, static_float32_shape
from collage_tvm.lowering import Lowering

_ANCHORS = ("relax.nn.conv2d", "relax.nn.conv3d", "relax.matmul")
_UNARY = {"relax.nn.relu": ("relu", ""), "relax.nn.gelu": ("gelu", "none"),
          "relax.nn.gelu_tanh": ("gelu", "tanh")}
_LAYOUTS = {"relax.nn.conv2d": ("NCHW", "OIHW"), "relax.nn.conv3d": ("NCDHW", "OIDHW")}
_TORCH_OPS = (("mkldnn", "_convolution_pointwise"), ("mkldnn", "_linear_pointwise"),
              ("mkldnn", "_reorder_linear_weight"), ("mkldnn_prepacked", "conv2d_prepack"),
              ("mkldnn_prepacked", "conv2d_run"), ("aten", "_add_relu_"))


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"dnnl: {what} is not supported")


@dataclass
class _Plan:
    """What the subgraph computes: ``unary(anchor(data, weight) + bias + residual)``."""

    anchor: str                      # relax op name of the conv / matmul
    data: int                        # param index of the activation input
    weight: object                   # np.ndarray (constant) or int (param index, run-time matmul rhs)
    out_shape: tuple
    nparams: int
    data_shape: tuple = ()
    stride: tuple = ()
    padding: tuple = ()
    dilation: tuple = ()
    groups: int = 1
    bias: np.ndarray | None = None   # (C,) per output channel
    residual: object = None          # int (param index) or np.ndarray (constant), output-shaped
    unary: tuple | None = None       # (attr, algorithm) for torch's pointwise ops


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
        plan = _analyse(func)
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


# ----------------------------------------------------------------------------- analysis

def _static_shape(expr, what: str) -> tuple:
    return static_float32_shape(expr, what, _unsupported)


def _analyse(func) -> _Plan:
    import tvm
    from tvm import relax

    if not isinstance(func, relax.Function):
        raise TypeError(f"dnnl: expected a tvm.relax.Function, got {type(func).__name__}")
    params = {p: i for i, p in enumerate(func.params)}
    body = func.body
    if not isinstance(body, relax.SeqExpr):
        raise _unsupported(f"a function body of kind {type(body).__name__}")
    calls = op_calls(body, _unsupported)
    folded = {}  # var -> np.ndarray for permute_dims of a constant (a weight transposed by the frontend)
    chain = None  # the var holding the current result after the anchor op
    plan = None

    def operand(expr):
        if isinstance(expr, tvm.ir.Constant):
            _static_shape(expr, "a constant")
            return expr.value.numpy()
        if expr in folded:
            return folded[expr]
        if expr in params:
            _static_shape(expr, f"the input {expr.name}")
            return params[expr]
        raise _unsupported(f"the operand {expr} (not a parameter or a constant of the subgraph)")

    for var, value, op in calls:
        if plan is None:
            if op == "relax.permute_dims" and isinstance(value.args[0], tvm.ir.Constant):
                axes = value.attrs.axes
                arr = value.args[0].value.numpy()
                folded[var] = np.transpose(arr, None if axes is None else [int(a) for a in axes])
                continue
            if op not in _ANCHORS:
                raise _unsupported(f"{op} (a group must start with conv2d, conv3d or matmul)")
            plan = _analyse_anchor(value, op, operand, len(params))
            chain = var
            continue
        chain_args = [i for i, a in enumerate(value.args) if a.same_as(chain)]
        if len(chain_args) != 1:
            raise _unsupported(f"{op} that does not consume the previous result exactly once")
        if plan.unary is not None:
            raise _unsupported(f"{op} after the activation")
        if op in _UNARY:
            if plan.residual is not None and op != "relax.nn.relu":
                raise _unsupported(f"{op} after a residual add")
            plan.unary = _UNARY[op]
        elif op == "relax.add":
            _analyse_add(plan, value.args[1 - chain_args[0]], operand)
        else:
            raise _unsupported(op)
        _static_shape(value, f"the result of {op}")  # dtype stays float32
        if tuple(int(d) for d in value.ty.shape.values) != plan.out_shape:
            raise _unsupported(f"{op} that changes the output shape")
        chain = var
    if plan is None:
        raise _unsupported("a subgraph without conv2d, conv3d or matmul")
    if not body.body.same_as(chain):
        raise _unsupported("a subgraph that does not return the result of its last op")
    return plan


def _analyse_anchor(call, op, operand, nparams) -> _Plan:
    out_shape = _static_shape(call, f"the output of {op}")
    data = operand(call.args[0])
    data_shape = _static_shape(call.args[0], f"the input of {op}")
    if not isinstance(data, int):
        raise _unsupported(f"{op} on a constant input")
    weight = operand(call.args[1])
    attrs = call.attrs
    if str(attrs.out_dtype or "float32") not in ("float32", "void"):
        raise _unsupported(f"{op} with out_dtype {attrs.out_dtype}")
    if op == "relax.matmul":
        lhs_shape = data_shape
        if len(lhs_shape) < 2:
            raise _unsupported("matmul with a 1-D lhs")
        if isinstance(weight, np.ndarray):
            if weight.ndim != 2:
                raise _unsupported(f"matmul with a {weight.ndim}-D constant weight")
            # (K, N) -> (N, K): torch's linear layout, pre-packed once in _build
            return _Plan(op, data, np.ascontiguousarray(weight.T), out_shape, nparams, data_shape)
        rhs_shape = _static_shape(call.args[1], "the matmul rhs")
        if len(lhs_shape) != 2 or len(rhs_shape) != 2:
            raise _unsupported(f"batched matmul of two run-time tensors {lhs_shape} x {rhs_shape}")
        return _Plan(op, data, weight, out_shape, nparams, data_shape)
    data_layout, kernel_layout = _LAYOUTS[op]
    if attrs.data_layout != data_layout or attrs.kernel_layout != kernel_layout or \
            attrs.out_layout not in (None, "", data_layout):
        raise _unsupported(f"{op} with layouts {attrs.data_layout}/{attrs.kernel_layout}/{attrs.out_layout}")
    if not isinstance(weight, np.ndarray):
        raise _unsupported(f"{op} with a run-time weight")
    nd = len(data_layout) - 2
    pad = [int(p) for p in attrs.padding]
    if pad[:nd] != pad[nd:]:
        raise _unsupported(f"{op} with asymmetric padding {pad}")
    return _Plan(op, data, np.ascontiguousarray(weight), out_shape, nparams, data_shape,
                 stride=tuple(int(s) for s in attrs.strides), padding=tuple(pad[:nd]),
                 dilation=tuple(int(d) for d in attrs.dilation), groups=int(attrs.groups))


def _analyse_add(plan: _Plan, other, operand) -> None:
    value = operand(other)
    shape = tuple(value.shape) if isinstance(value, np.ndarray) else tuple(int(d) for d in other.ty.shape.values)
    channel = 1 if plan.anchor != "relax.matmul" else len(plan.out_shape) - 1
    aligned = (1,) * (len(plan.out_shape) - len(shape)) + shape
    per_channel = len(shape) <= len(plan.out_shape) and all(
        d == (plan.out_shape[i] if i == channel else 1) for i, d in enumerate(aligned))
    # A per-channel constant is a bias even when it has the output's shape (all other output
    # dims 1, e.g. a conv3d on a 1x1x1 map): the pattern's bias slot matches it as such.
    if isinstance(value, np.ndarray) and per_channel:
        bias = value.reshape(-1).astype(np.float32)
        plan.bias = bias if plan.bias is None else plan.bias + bias
    elif shape == plan.out_shape and plan.residual is None:
        plan.residual = value
    else:
        raise _unsupported(f"add of a {list(shape)} operand to the {list(plan.out_shape)} output "
                           "(only a per-channel constant bias and one same-shaped residual)")


# ----------------------------------------------------------------------------- kernels

def _build(plan: _Plan, precision: str = "f32") -> Callable:
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
