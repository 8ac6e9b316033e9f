"""The plan of an operator library's group: ``unary(anchor(data, weight) + bias + residual)``.

What the groups of ``collage_tvm.patterns.epilogue`` compute, read back from the standalone
Relax function of a candidate: the anchor (conv2d, conv3d or matmul) and its attributes,
which parameter is the data (and a run-time weight or residual), the constant weight and
per-channel bias as arrays, and the activation. The oneDNN, cuDNN and cuBLAS lowerings build
their kernels from it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from collage_tvm.backends._common import op_calls, static_float32_shape

ANCHORS = ("relax.nn.conv2d", "relax.nn.conv3d", "relax.matmul")
UNARY = {"relax.nn.relu": ("relu", ""), "relax.nn.gelu": ("gelu", "none"),
         "relax.nn.gelu_tanh": ("gelu", "tanh")}
LAYOUTS = {"relax.nn.conv2d": ("NCHW", "OIHW"), "relax.nn.conv3d": ("NCDHW", "OIDHW")}


@dataclass
class Plan:
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


def analyse(func, library: str, batched_matmul: bool = False) -> Plan:
    """What ``func`` computes, as a :class:`Plan`; raises ``NotImplementedError("<library>:
    ... is not supported")`` for anything but one conv2d / conv3d / matmul followed by a
    per-channel bias, one same-shaped residual add and relu / gelu. ``batched_matmul``:
    also a batched matmul of two run-time tensors of one batch shape."""
    return _Analysis(library, batched_matmul).run(func)


class _Analysis:
    def __init__(self, library: str, batched_matmul: bool):
        self.library, self.batched_matmul = library, batched_matmul

    def unsupported(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"{self.library}: {what} is not supported")

    def static_shape(self, expr, what: str) -> tuple:
        return static_float32_shape(expr, what, self.unsupported)

    def run(self, func) -> Plan:
        import tvm
        from tvm import relax

        if not isinstance(func, relax.Function):
            raise TypeError(f"{self.library}: expected a tvm.relax.Function, got {type(func).__name__}")
        params = {p: i for i, p in enumerate(func.params)}
        body = func.body
        if not isinstance(body, relax.SeqExpr):
            raise self.unsupported(f"a function body of kind {type(body).__name__}")
        calls = op_calls(body, self.unsupported)
        folded = {}  # var -> np.ndarray for permute_dims of a constant (a weight transposed by the frontend)
        chain = None  # the var holding the current result after the anchor op
        plan = None

        def operand(expr):
            if isinstance(expr, tvm.ir.Constant):
                self.static_shape(expr, "a constant")
                return expr.value.numpy()
            if expr in folded:
                return folded[expr]
            if expr in params:
                self.static_shape(expr, f"the input {expr.name}")
                return params[expr]
            raise self.unsupported(f"the operand {expr} (not a parameter or a constant of the subgraph)")

        for var, value, op in calls:
            if plan is None:
                if op == "relax.permute_dims" and isinstance(value.args[0], tvm.ir.Constant):
                    axes = value.attrs.axes
                    arr = value.args[0].value.numpy()
                    folded[var] = np.transpose(arr, None if axes is None else [int(a) for a in axes])
                    continue
                if op not in ANCHORS:
                    raise self.unsupported(f"{op} (a group must start with conv2d, conv3d or matmul)")
                plan = self.anchor(value, op, operand, len(params))
                chain = var
                continue
            chain_args = [i for i, a in enumerate(value.args) if a.same_as(chain)]
            if len(chain_args) != 1:
                raise self.unsupported(f"{op} that does not consume the previous result exactly once")
            if plan.unary is not None:
                raise self.unsupported(f"{op} after the activation")
            if op in UNARY:
                if plan.residual is not None and op != "relax.nn.relu":
                    raise self.unsupported(f"{op} after a residual add")
                plan.unary = UNARY[op]
            elif op == "relax.add":
                self.add(plan, value.args[1 - chain_args[0]], operand)
            else:
                raise self.unsupported(op)
            self.static_shape(value, f"the result of {op}")  # dtype stays float32
            if tuple(int(d) for d in value.ty.shape.values) != plan.out_shape:
                raise self.unsupported(f"{op} that changes the output shape")
            chain = var
        if plan is None:
            raise self.unsupported("a subgraph without conv2d, conv3d or matmul")
        if not body.body.same_as(chain):
            raise self.unsupported("a subgraph that does not return the result of its last op")
        return plan


    def anchor(self, call, op, operand, nparams) -> Plan:
        out_shape = self.static_shape(call, f"the output of {op}")
        data = operand(call.args[0])
        data_shape = self.static_shape(call.args[0], f"the input of {op}")
        if not isinstance(data, int):
            raise self.unsupported(f"{op} on a constant input")
        weight = operand(call.args[1])
        attrs = call.attrs
        if str(attrs.out_dtype or "float32") not in ("float32", "void"):
            raise self.unsupported(f"{op} with out_dtype {attrs.out_dtype}")
        if op == "relax.matmul":
            lhs_shape = data_shape
            if len(lhs_shape) < 2:
                raise self.unsupported("matmul with a 1-D lhs")
            if isinstance(weight, np.ndarray):
                if weight.ndim != 2:
                    raise self.unsupported(f"matmul with a {weight.ndim}-D constant weight")
                # (K, N) -> (N, K): torch's linear layout, pre-packed once in _build
                return Plan(op, data, np.ascontiguousarray(weight.T), out_shape, nparams, data_shape)
            rhs_shape = self.static_shape(call.args[1], "the matmul rhs")
            batched = self.batched_matmul and len(lhs_shape) == len(rhs_shape) \
                and lhs_shape[:-2] == rhs_shape[:-2]
            if not batched and (len(lhs_shape) != 2 or len(rhs_shape) != 2):
                raise self.unsupported(f"batched matmul of two run-time tensors {lhs_shape} x {rhs_shape}")
            return Plan(op, data, weight, out_shape, nparams, data_shape)
        data_layout, kernel_layout = LAYOUTS[op]
        if attrs.data_layout != data_layout or attrs.kernel_layout != kernel_layout or \
                attrs.out_layout not in (None, "", data_layout):
            raise self.unsupported(f"{op} with layouts {attrs.data_layout}/{attrs.kernel_layout}/{attrs.out_layout}")
        if not isinstance(weight, np.ndarray):
            raise self.unsupported(f"{op} with a run-time weight")
        nd = len(data_layout) - 2
        pad = [int(p) for p in attrs.padding]
        if pad[:nd] != pad[nd:]:
            raise self.unsupported(f"{op} with asymmetric padding {pad}")
        return Plan(op, data, np.ascontiguousarray(weight), out_shape, nparams, data_shape,
                     stride=tuple(int(s) for s in attrs.strides), padding=tuple(pad[:nd]),
                     dilation=tuple(int(d) for d in attrs.dilation), groups=int(attrs.groups))


    def add(self, plan: Plan, other, operand) -> None:
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
            raise self.unsupported(f"add of a {list(shape)} operand to the {list(plan.out_shape)} output "
                               "(only a per-channel constant bias and one same-shaped residual)")
