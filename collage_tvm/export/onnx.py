"""Relax -> ONNX: write one standalone Relax subgraph function as an ONNX model.

Why: the graph-library backends (onnxruntime, openvino; ``backends/_graphlib.py``) run a
candidate subgraph by handing it to their library, and both libraries read ONNX. The
subgraph comes from ``graph.subgraph.extract_function``: tensor parameters, one dataflow
block of ``VarBinding``s whose values are operator calls, tuples and tuple-get-items, and
constants (weights) inline. Every value has a static shape.

Two entry points:

- ``unsupported_reason(value)`` says, for one binding value, why it cannot be written
  (``None`` if it can). The pattern rules call it for every node of a model, so it only
  looks at types and attributes and never imports ``onnx``.
- ``export_function(func, opset=17)`` writes the whole function. ONNX graph inputs are the
  parameters in order (names made valid and unique), outputs are the function's results
  in order (a tuple result gives several outputs), constants become initializers (one per
  distinct Constant object). Anything not exportable raises ``ExportError`` naming the op.

Each supported Relax op has one entry in ``_OPS``: the dtypes its data input may have, an
optional attribute check, and an emitter that appends ONNX nodes. Conventions worth
knowing when adding one:

- Relax conv/pool ``padding`` is ``[begin..., end...]``, the same order as ONNX ``pads``;
  ``nn.pad``'s ``pad_width`` is interleaved per axis (``[b0, a0, b1, a1, ...]``).
- Shape-only ops (reshape, squeeze, expand_dims, flatten) become one ``Reshape`` to the
  static result shape, and ``broadcast_to`` an ``Expand``: the result type already holds
  the answer, so no attribute form has to be re-derived.
- Opset 17 (the first with LayerNormalization) is the default and the minimum; later
  opsets work too: ``ReduceMean/Max/Min/Prod`` take ``axes`` as an attribute before
  opset 18 and as an input from 18 on. ``Gelu`` only exists from opset 20, so GELU is
  always written as its erf (or tanh) formula.
- Only float32 is supported for arithmetic (plus int32/int64 indices, int8/uint8/bool for
  masks and casts); other float dtypes are rejected with a reason rather than silently
  computed in another precision.

Where the libraries themselves disagree with TVM, the op is refused rather than written:
ceil-mode pooling whose last window starts in the end padding (OpenVINO keeps that
window, TVM drops it), ceil-mode average pooling with ``count_include_pad`` whose last
window runs past the padded input, and ``layer_norm`` with ``center``/``scale`` False
(TVM's legalization ignores both flags).

After writing, ONNX shape inference runs over the result and every inferred shape is
compared with the Relax type of the same value: a disagreement (an attribute converted
wrongly) is an ``ExportError`` here, not a wrong answer at run time.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
from dataclasses import dataclass
from typing import Callable

import numpy as np
import tvm
from tvm import relax

Constant = tvm.ir.expr.GenericConst  # relax.Constant in TVM < 0.27
IntImm = tvm.tirx.IntImm
FloatImm = tvm.tirx.FloatImm

DEFAULT_OPSET = 17
MIN_OPSET = 17


class ExportError(Exception):
    """The function cannot be written as ONNX; the message names the op and says why."""


# ---------------------------------------------------------------------------------------
# dtypes
# ---------------------------------------------------------------------------------------
FLOAT = frozenset({"float32"})
INDEX = frozenset({"int32", "int64"})
NUMERIC = FLOAT | INDEX
ORDERED = NUMERIC | {"int8", "uint8"}        # what ReduceMax/Min accept
ANY = ORDERED | {"bool"}                     # everything the exporter can hold
BOOL = frozenset({"bool"})

_ONNX_DTYPE = {"float32": "FLOAT", "int64": "INT64", "int32": "INT32", "int8": "INT8",
               "uint8": "UINT8", "bool": "BOOL"}
_ANY_TEXT = "float32, int32, int64, int8, uint8, bool"


def _onnx_dtype(dtype: str) -> int:
    from onnx import TensorProto

    return getattr(TensorProto, _ONNX_DTYPE[dtype])


def _dtype_str(dtype) -> str:
    """'' for an unset dtype attribute (None / void), else its name."""
    if dtype is None:
        return ""
    text = str(dtype)
    return "" if text in ("", "void", "None") else text


# ---------------------------------------------------------------------------------------
# types and attribute values
# ---------------------------------------------------------------------------------------
def _ty(expr):
    return getattr(expr, "ty", None)


def _static_shape(ty) -> tuple | None:
    """The shape of a TensorType as ints, or None when unknown or symbolic."""
    shape = getattr(ty, "shape", None)
    if shape is None:
        return None
    dims = []
    for s in getattr(shape, "values", shape):  # the ShapeExpr's array: much faster to walk
        if not isinstance(s, IntImm):
            return None
        dims.append(int(s.value))
    return tuple(dims)


def _shape(expr) -> tuple:
    return _static_shape(expr.ty)


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


def _type_reason(ty, what: str) -> str | None:
    """Why a value of type ``ty`` cannot cross into ONNX (tensors, tuples of tensors)."""
    if isinstance(ty, relax.TensorType):
        dtype = str(ty.dtype)
        if dtype not in ANY:
            return f"{what} has dtype {dtype}; only {_ANY_TEXT} are supported"
        shape = _static_shape(ty)
        if shape is None:
            return f"{what} has no static shape ({ty})"
        if any(d <= 0 for d in shape):  # empty slices can even get negative extents
            return f"{what} has an empty shape {list(shape)}"
        return None
    if isinstance(ty, relax.TupleType):
        for i, field in enumerate(ty.fields):
            reason = _type_reason(field, f"{what}[{i}]")
            if reason:
                return reason
        return None
    return f"{what} is not a tensor ({ty})"


def _is_attr_like(ty) -> bool:
    """Prim values, shapes and tuples of them are attributes, checked by the op itself."""
    if isinstance(ty, relax.TupleType):
        return all(_is_attr_like(f) for f in ty.fields)
    return isinstance(ty, (tvm.ir.PrimType, relax.ShapeType))


def _const_ints(expr) -> list | None:
    """Ints of a Tuple of IntImm or a ShapeExpr of IntImm; None when not all static."""
    if isinstance(expr, relax.ShapeExpr):
        items = list(expr.values)
    elif isinstance(expr, relax.Tuple):
        items = list(expr.fields)
    else:
        return None
    if not all(isinstance(v, IntImm) for v in items):
        return None
    return [int(v.value) for v in items]


def _ints(values) -> list:
    return [int(v) for v in values] if values is not None else []


def _norm_axis(axis: int, ndim: int) -> int:
    return axis + ndim if axis < 0 else axis


# ---------------------------------------------------------------------------------------
# the op table
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Op:
    dtypes: frozenset                       # allowed dtypes of the first tensor argument
    emit: Callable                          # emit(builder, call) -> name | [names]
    check: Callable | None = None           # check(call) -> reason | None


_OPS: dict[str, _Op] = {}


def _register(names, dtypes=FLOAT, check=None):
    """Decorator: ``emit`` handles the Relax ops ``names`` (without the "relax." prefix)."""
    def wrap(emit):
        for n in names.split():
            _OPS["relax." + n] = _Op(frozenset(dtypes), emit, check)
        return emit
    return wrap


def unsupported_reason(value) -> str | None:
    """None if the binding value can be exported, else "<op>: <why not>"."""
    if isinstance(value, relax.Call):
        op = value.op
        if not isinstance(op, tvm.ir.Op):
            name = getattr(op, "global_symbol", None) or getattr(op, "name_hint", None)
            return f"call:{name or type(op).__name__}: calls of functions are not exported"
        reason = _call_reason(value)
        return f"{op.name}: {reason}" if reason else None
    if isinstance(value, (relax.Tuple, relax.TupleGetItem, relax.Var, Constant)):
        kind = {relax.Tuple: "tuple", relax.TupleGetItem: "tuple_get_item"}.get(
            type(value), type(value).__name__)
        reason = _type_reason(getattr(value, "ty", None), "value")
        if isinstance(value, relax.Tuple) and reason is None:
            for i, f in enumerate(value.fields):
                if not isinstance(f, (relax.Var, Constant, relax.Tuple)):
                    return f"{kind}: field {i} is a {type(f).__name__}, not a tensor"
        return f"{kind}: {reason}" if reason else None
    return f"{type(value).__name__}: not an exportable binding value"


def _call_reason(call) -> str | None:
    entry = _OPS.get(call.op.name)
    if entry is None:
        return "no ONNX conversion for this operator"
    reason = _type_reason(_ty(call), "result")
    if reason:
        return reason
    first = None
    for i, arg in enumerate(call.args):
        ty = _ty(arg)
        if _is_attr_like(ty):
            continue
        reason = _type_reason(ty, f"argument {i}")
        if reason:
            return reason
        if first is None:
            first = ty.fields[0] if isinstance(ty, relax.TupleType) and ty.fields else ty
    if first is not None and isinstance(first, relax.TensorType) and \
            str(first.dtype) not in entry.dtypes:
        return (f"input dtype {first.dtype} is not supported "
                f"({', '.join(sorted(entry.dtypes))} only)")
    return entry.check(call) if entry.check else None


# ---------------------------------------------------------------------------------------
# the builder: ONNX nodes, initializers, names
# ---------------------------------------------------------------------------------------
_SMALL = 64  # arrays up to this many elements are deduplicated by value


class _Builder:
    """Collects ONNX nodes and initializers; maps Relax values to ONNX value names."""

    def __init__(self, opset: int):
        self.opset = opset
        self.nodes: list = []
        self.initializers: list = []
        self.values: dict = {}       # relax Var -> ONNX name, or (nested) list for tuples
        self.taken: set = set()
        self.base = "t"              # name stem of the values of the binding being written
        self._by_object: dict = {}   # relax Constant -> initializer name
        self._by_value: dict = {}    # (dtype, shape, bytes) -> initializer name

    def fresh(self, base: str) -> str:
        base = re.sub(r"[^A-Za-z0-9_]", "_", base) or "v"
        if base[0].isdigit():
            base = "_" + base
        name, k = base, 1
        while name in self.taken:
            name, k = f"{base}_{k}", k + 1
        self.taken.add(name)
        return name

    def node(self, op_type: str, inputs: list, outputs: int = 1, **attrs):
        """Append one node; returns its output name (a list when ``outputs`` > 1)."""
        from onnx import helper

        outs = [self.fresh(self.base) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs,
                                           name=f"{op_type}_{len(self.nodes)}", **attrs))
        return outs[0] if outputs == 1 else outs

    def array(self, arr: np.ndarray, base: str = "const") -> str:
        """An initializer holding ``arr``; small ones are shared by value."""
        from onnx import numpy_helper

        arr = np.asarray(arr)  # (not ascontiguousarray: it turns 0-d arrays into 1-d)
        key = None
        if arr.size <= _SMALL:
            key = (arr.dtype.str, arr.shape, arr.tobytes())
            if key in self._by_value:
                return self._by_value[key]
        name = self.fresh(base)
        self.initializers.append(numpy_helper.from_array(arr, name))
        if key is not None:
            self._by_value[key] = name
        return name

    def scalar(self, value, dtype: str) -> str:
        return self.array(np.asarray(value, dtype=dtype))

    def ints(self, values) -> str:
        return self.array(np.asarray(list(values), dtype=np.int64).reshape(-1))

    def constant(self, const) -> str:
        name = self._by_object.get(const)
        if name is None:
            made = _DEQUANTIZED.get(const)
            if made is not None:  # an int8 weight dequantized: written as it came
                q, scale, zero, axis = made
                name = self.node("DequantizeLinear", [self.array(q, "weight_q"),
                                                      self.array(scale, "scale"),
                                                      self.array(zero.astype(q.dtype))],
                                 axis=axis % max(q.ndim, 1))
            else:
                name = self.array(const.value.numpy())
            self._by_object[const] = name
        return name

    def value(self, expr):
        """ONNX name(s) of a Relax tensor/tuple expression."""
        if isinstance(expr, Constant):
            return self.constant(expr)
        if isinstance(expr, relax.Var):
            if expr not in self.values:
                raise ExportError(f"{expr.name}: used before it is defined")
            return self.values[expr]
        if isinstance(expr, relax.Tuple):
            return [self.value(f) for f in expr.fields]
        if isinstance(expr, relax.TupleGetItem):
            return self.value(expr.tuple_value)[int(expr.index)]
        raise ExportError(f"{type(expr).__name__}: not a tensor value")

    def reduce(self, op_type: str, x: str, axes: list, keepdims: bool) -> str:
        """ReduceSum takes axes as an input from opset 13, the others from opset 18."""
        if op_type == "ReduceSum" or self.opset >= 18:
            return self.node(op_type, [x, self.ints(axes)], keepdims=int(keepdims))
        return self.node(op_type, [x], axes=list(axes), keepdims=int(keepdims))


# ---------------------------------------------------------------------------------------
# elementwise ops
# ---------------------------------------------------------------------------------------
_UNARY = {"nn.relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "exp": "Exp", "log": "Log",
          "sqrt": "Sqrt", "erf": "Erf", "floor": "Floor", "ceil": "Ceil", "sin": "Sin",
          "cos": "Cos"}
_UNARY_NUMERIC = {"negative": "Neg", "abs": "Abs", "sign": "Sign"}
_BINARY_FLOAT = {"divide": "Div", "power": "Pow"}
_BINARY_NUMERIC = {"add": "Add", "subtract": "Sub", "multiply": "Mul", "maximum": "Max",
                   "minimum": "Min"}
_COMPARE = {"less": "Less", "less_equal": "LessOrEqual", "greater": "Greater",
            "greater_equal": "GreaterOrEqual"}
_LOGICAL = {"logical_and": "And", "logical_or": "Or", "logical_xor": "Xor"}


def _simple(onnx_op: str):
    """Emitter of a one-to-one op: every tensor argument is an input, in order."""
    def emit(b: _Builder, call):
        return b.node(onnx_op, [b.value(a) for a in call.args])
    return emit


for _table, _dt in ((_UNARY, FLOAT), (_UNARY_NUMERIC, NUMERIC), (_BINARY_FLOAT, FLOAT),
                    (_BINARY_NUMERIC, NUMERIC), (_COMPARE, NUMERIC), (_LOGICAL, BOOL)):
    for _name, _onnx_op in _table.items():
        _register(_name, _dt)(_simple(_onnx_op))
_register("logical_not", BOOL)(_simple("Not"))
_register("equal", NUMERIC | BOOL)(_simple("Equal"))


@_register("not_equal", NUMERIC | BOOL)
def _not_equal(b, call):
    return b.node("Not", [b.node("Equal", [b.value(a) for a in call.args])])


@_register("floor_divide")
def _floor_divide(b, call):
    return b.node("Floor", [b.node("Div", [b.value(a) for a in call.args])])


@_register("rsqrt")
def _rsqrt(b, call):
    return b.node("Reciprocal", [b.node("Sqrt", [b.value(call.args[0])])])


@_register("square", NUMERIC)
def _square(b, call):
    x = b.value(call.args[0])
    return b.node("Mul", [x, x])


@_register("nn.silu")
def _silu(b, call):
    x = b.value(call.args[0])
    return b.node("Mul", [x, b.node("Sigmoid", [x])])


@_register("nn.gelu")
def _gelu(b, call):
    """0.5 * x * (1 + erf(x / sqrt(2))): ONNX has no Gelu before opset 20."""
    x = b.value(call.args[0])
    t = b.node("Erf", [b.node("Mul", [x, b.scalar(1.0 / math.sqrt(2.0), "float32")])])
    t = b.node("Add", [t, b.scalar(1.0, "float32")])
    return b.node("Mul", [b.node("Mul", [x, b.scalar(0.5, "float32")]), t])


@_register("nn.gelu_tanh")
def _gelu_tanh(b, call):
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))."""
    x = b.value(call.args[0])
    x3 = b.node("Mul", [b.node("Mul", [x, x]), x])
    inner = b.node("Add", [x, b.node("Mul", [x3, b.scalar(0.044715, "float32")])])
    t = b.node("Tanh", [b.node("Mul", [inner, b.scalar(math.sqrt(2.0 / math.pi), "float32")])])
    t = b.node("Add", [t, b.scalar(1.0, "float32")])
    return b.node("Mul", [b.node("Mul", [x, b.scalar(0.5, "float32")]), t])


@_register("nn.leakyrelu")
def _leakyrelu(b, call):
    return b.node("LeakyRelu", [b.value(call.args[0])], alpha=float(call.attrs.alpha))


def _check_clip(call):
    for i in (1, 2):
        if len(call.args) <= i or not isinstance(call.args[i], (IntImm, FloatImm)):
            return "min/max must be constant scalars"
    return None


@_register("clip", NUMERIC, _check_clip)
def _clip(b, call):
    dtype = _dtype(call.args[0])
    lo, hi = (float(call.args[i].value) for i in (1, 2))
    if dtype != "float32":  # integer clip bounds, saturated to the dtype's range
        info = np.iinfo(dtype)
        lo, hi = (int(max(info.min, min(info.max, v))) for v in (lo, hi))
    return b.node("Clip", [b.value(call.args[0]), b.scalar(lo, dtype), b.scalar(hi, dtype)])


def _check_where(call):
    if _dtype(call.args[1]) not in NUMERIC | BOOL or _dtype(call.args[1]) != _dtype(call.args[2]):
        return f"branch dtype {_dtype(call.args[1])} is not supported"
    return None


@_register("where", BOOL, _check_where)
def _where(b, call):
    return b.node("Where", [b.value(a) for a in call.args])


def _check_astype(call):
    dtype = _dtype_str(call.attrs.dtype)
    return None if dtype in ANY else f"cast to {dtype or 'void'} is not supported"


@_register("astype", ANY, _check_astype)
def _astype(b, call):
    return b.node("Cast", [b.value(call.args[0])], to=_onnx_dtype(_dtype_str(call.attrs.dtype)))


# ---------------------------------------------------------------------------------------
# quantization: TVM's importer keeps an ONNX file's QuantizeLinear / DequantizeLinear as
# ``relax.quantize`` / ``relax.dequantize``; written back, a graph library's region holds the
# Q/DQ pairs it fuses into int8 kernels (not the float arithmetic TVM computes them with)
# ---------------------------------------------------------------------------------------
QUANTIZED = frozenset({"int8", "uint8"})
# A float constant that was the dequantize of an int8 weight (``frontend.quantized``):
# constant -> (int8 array, scale, zero point, axis); written as that DequantizeLinear
_DEQUANTIZED: dict = {}


def mark_dequantized(const, q, scale, zero, axis: int) -> None:
    """Record float ``const`` as ``DequantizeLinear(q, scale, zero, axis)``: the exporter
    writes it so (a library's int8 fusions need the weight's DequantizeLinear)."""
    _DEQUANTIZED[const] = (q, scale, zero, axis)


def clear_dequantized() -> None:
    """Forget the records of ``mark_dequantized`` (a new model's import)."""
    _DEQUANTIZED.clear()


def _check_qdq(call):
    """QuantizeLinear / DequantizeLinear take a scale of the input's dtype and a zero point
    of the quantized one (int8 or uint8; an int32 bias dequantized with a zero point of 0)."""
    quantize = call.op.name == "relax.quantize"
    low = _dtype_str(call.attrs.out_dtype) if quantize else _dtype(call.args[0])
    if low not in QUANTIZED | ({"int32"} if not quantize else set()):
        return f"{'to' if quantize else 'from'} {low}: only int8 and uint8" + (
            "" if quantize else " (and int32 for a bias)")
    scale, zero = call.args[1], call.args[2]
    if _dtype(scale) != "float32":
        return f"a {_dtype(scale)} scale: float32 only"
    if not isinstance(zero, Constant) or not isinstance(scale, Constant):
        return "a scale or zero point that is not a constant"
    if len(_shape(scale)) > 1 or len(_shape(zero)) > 1:
        return "a scale or zero point of more than one dimension (blocked quantization)"
    return None


def _qdq_zero_point(b, call, low: str) -> str:
    zero = call.args[2].value.numpy()
    if str(zero.dtype) != low:
        zero = zero.astype(low)  # (the importer keeps the file's; a default may be int8)
    return b.array(zero)


@_register("quantize", FLOAT, _check_qdq)
def _quantize(b, call):
    low = _dtype_str(call.attrs.out_dtype)
    axis = _norm_axis(int(call.attrs.axis), len(_shape(call.args[0])))
    return b.node("QuantizeLinear", [b.value(call.args[0]), b.value(call.args[1]),
                                     _qdq_zero_point(b, call, low)], axis=axis)


@_register("dequantize", QUANTIZED | {"int32"}, _check_qdq)
def _dequantize(b, call):
    axis = _norm_axis(int(call.attrs.axis), len(_shape(call.args[0])))
    return b.node("DequantizeLinear", [b.value(call.args[0]), b.value(call.args[1]),
                                       _qdq_zero_point(b, call, _dtype(call.args[0]))],
                  axis=axis)


# ---------------------------------------------------------------------------------------
# convolutions, matmul
# ---------------------------------------------------------------------------------------
_SPATIAL = {1: "W", 2: "HW", 3: "DHW"}


def _pads(padding, nd: int) -> list:
    """Relax padding ([p], [p per axis] or [begin..., end...]) as ONNX pads."""
    p = _ints(padding)
    if len(p) == 1:
        return p * (2 * nd)
    if len(p) == nd:
        return p + p
    return p


def _check_conv(call):
    a, name = call.attrs, call.op.name
    nd = len(_shape(call.args[0])) - 2
    transpose = "transpose" in name
    data = "NC" + _SPATIAL.get(nd, "?")
    kernel = ("IO" if transpose else "OI") + _SPATIAL.get(nd, "?")
    if a.data_layout != data:
        return f"data_layout {a.data_layout} is not supported ({data} only)"
    if a.kernel_layout != kernel:
        return f"kernel_layout {a.kernel_layout} is not supported ({kernel} only)"
    if (a.out_layout or "") not in ("", data):
        return f"out_layout {a.out_layout} is not supported ({data} only)"
    out_dtype = _dtype_str(a.out_dtype)
    if out_dtype not in ("", "float32"):
        return f"out_dtype {out_dtype} is not supported"
    if _dtype(call.args[1]) != "float32":
        return f"weight dtype {_dtype(call.args[1])} is not supported (float32 only)"
    if len(_pads(a.padding, nd)) != 2 * nd:
        return f"padding {list(a.padding)} has an unexpected length"
    return None


@_register("nn.conv1d nn.conv2d nn.conv3d", FLOAT, _check_conv)
def _conv(b, call):
    a = call.attrs
    w_shape = _shape(call.args[1])
    nd = len(w_shape) - 2
    return b.node("Conv", [b.value(call.args[0]), b.value(call.args[1])],
                  kernel_shape=list(w_shape[2:]), strides=_ints(a.strides),
                  pads=_pads(a.padding, nd), dilations=_ints(a.dilation), group=int(a.groups))


@_register("nn.conv1d_transpose nn.conv2d_transpose nn.conv3d_transpose", FLOAT, _check_conv)
def _conv_transpose(b, call):
    a = call.attrs
    w_shape = _shape(call.args[1])
    nd = len(w_shape) - 2
    return b.node("ConvTranspose", [b.value(call.args[0]), b.value(call.args[1])],
                  kernel_shape=list(w_shape[2:]), strides=_ints(a.strides),
                  pads=_pads(a.padding, nd), dilations=_ints(a.dilation), group=int(a.groups),
                  output_padding=_ints(a.output_padding))


def _check_matmul(call):
    out_dtype = _dtype_str(call.attrs.out_dtype)
    if out_dtype not in ("", "float32"):
        return f"out_dtype {out_dtype} is not supported"
    if _dtype(call.args[1]) != "float32":
        return f"second operand dtype {_dtype(call.args[1])} is not supported (float32 only)"
    return None


@_register("matmul", FLOAT, _check_matmul)
def _matmul(b, call):
    # ONNX MatMul has numpy semantics: 1-D operands, any rank, broadcast batch dims.
    return b.node("MatMul", [b.value(call.args[0]), b.value(call.args[1])])


# ---------------------------------------------------------------------------------------
# pooling
# ---------------------------------------------------------------------------------------
def _pool_out(size, k, s, d, pb, pe, ceil) -> tuple:
    """Pooled length by the ONNX formula: (as written, with ceil mode's last window dropped
    when it would start inside the end padding)."""
    num = size + pb + pe - ((k - 1) * d + 1)
    out = (-(-num // s) if ceil else num // s) + 1
    dropped = out - 1 if ceil and (out - 1) * s >= size + pb else out
    return out, dropped


def _check_pool(call):
    a, name = call.attrs, call.op.name
    in_shape, out_shape = _shape(call.args[0]), _static_shape(call.ty)
    nd = len(in_shape) - 2
    layout = "NC" + _SPATIAL.get(nd, "?")
    if a.layout != layout or (a.out_layout or "") not in ("", layout):
        return f"layout {a.layout}/{a.out_layout} is not supported ({layout} only)"
    k, s, d = _ints(a.pool_size), _ints(a.strides), _ints(a.dilation)
    pads = _pads(a.padding, nd)
    if "avg" in name and any(x != 1 for x in d):
        return "dilated average pooling needs ONNX opset 19"
    for i in range(nd):
        plain, dropped = _pool_out(in_shape[2 + i], k[i], s[i], d[i], pads[i], pads[nd + i],
                                   bool(a.ceil_mode))
        if plain != dropped:
            # TVM and onnxruntime drop a last window that starts in the end padding; ONNX
            # shape inference and OpenVINO keep it.
            return f"ceil_mode with a window starting in the padding on axis {2 + i}"
        if plain != out_shape[2 + i]:
            return (f"output size {out_shape[2 + i]} on axis {2 + i} differs from ONNX's "
                    f"{plain} (ceil_mode={bool(a.ceil_mode)})")
    if "avg" in name and a.ceil_mode and a.count_include_pad:
        # A last window running past the padded input is averaged over different counts
        # (TVM and onnxruntime agree, OpenVINO does not).
        for i in range(nd):
            if (out_shape[2 + i] - 1) * s[i] + k[i] > in_shape[2 + i] + pads[i] + pads[nd + i]:
                return "ceil_mode with count_include_pad divides the last window differently"
    return None


@_register("nn.max_pool1d nn.max_pool2d nn.max_pool3d", FLOAT, _check_pool)
def _max_pool(b, call):
    a = call.attrs
    nd = len(_shape(call.args[0])) - 2
    return b.node("MaxPool", [b.value(call.args[0])], kernel_shape=_ints(a.pool_size),
                  strides=_ints(a.strides), pads=_pads(a.padding, nd),
                  dilations=_ints(a.dilation), ceil_mode=int(bool(a.ceil_mode)))


@_register("nn.avg_pool1d nn.avg_pool2d nn.avg_pool3d", FLOAT, _check_pool)
def _avg_pool(b, call):
    a = call.attrs
    nd = len(_shape(call.args[0])) - 2
    return b.node("AveragePool", [b.value(call.args[0])], kernel_shape=_ints(a.pool_size),
                  strides=_ints(a.strides), pads=_pads(a.padding, nd),
                  ceil_mode=int(bool(a.ceil_mode)),
                  count_include_pad=int(bool(a.count_include_pad)))


def _check_adaptive(call):
    a = call.attrs
    in_shape, out_shape = _shape(call.args[0]), _static_shape(call.ty)
    nd = len(in_shape) - 2
    layout = "NC" + _SPATIAL.get(nd, "?")
    if a.layout != layout or (a.out_layout or "") not in ("", layout):
        return f"layout {a.layout}/{a.out_layout} is not supported ({layout} only)"
    for i, o in zip(in_shape[2:], out_shape[2:]):
        if i % o:
            return (f"output size {list(out_shape[2:])} does not divide input size "
                    f"{list(in_shape[2:])} (ONNX has no adaptive pooling)")
    return None


@_register("nn.adaptive_avg_pool1d nn.adaptive_avg_pool2d nn.adaptive_avg_pool3d", FLOAT,
           _check_adaptive)
def _adaptive_avg_pool(b, call):
    """Evenly divisible adaptive pooling is a plain average pool (global for output 1)."""
    x = b.value(call.args[0])
    in_shape, out_shape = _shape(call.args[0]), _static_shape(call.ty)
    if all(o == 1 for o in out_shape[2:]):
        return b.node("GlobalAveragePool", [x])
    k = [i // o for i, o in zip(in_shape[2:], out_shape[2:])]
    return b.node("AveragePool", [x], kernel_shape=k, strides=k)


# ---------------------------------------------------------------------------------------
# normalization, softmax
# ---------------------------------------------------------------------------------------
def _check_batch_norm(call):
    a = call.attrs
    ndim = len(_shape(call.args[0]))
    if ndim < 2 or _norm_axis(int(a.axis), ndim) != 1:
        return f"axis {a.axis} is not supported (channel axis 1 only)"
    if a.training:
        return "training mode (batch statistics) is not supported"
    if any(_dtype(x) != "float32" for x in call.args[1:5]):
        return "parameters must be float32"
    return None


@_register("nn.batch_norm", FLOAT, _check_batch_norm)
def _batch_norm(b, call):
    """Inference batch norm; the tuple's other fields are the moving stats, unchanged."""
    a = call.attrs
    x, gamma, beta, mean, var = (b.value(arg) for arg in call.args[:5])
    channels = _shape(call.args[0])[1]
    if not a.scale:
        gamma = b.array(np.ones(channels, np.float32))
    if not a.center:
        beta = b.array(np.zeros(channels, np.float32))
    y = b.node("BatchNormalization", [x, gamma, beta, mean, var], epsilon=float(a.epsilon))
    return [y, mean, var]


def _check_layer_norm(call):
    ndim = len(_shape(call.args[0]))
    axes = sorted(_norm_axis(int(x), ndim) for x in call.attrs.axes)
    if not axes or axes != list(range(ndim - len(axes), ndim)):
        return f"axes {list(call.attrs.axes)} are not the trailing axes"
    if any(_dtype(x) != "float32" for x in call.args[1:3]):
        return "gamma/beta must be float32"
    if not (call.attrs.center and call.attrs.scale):
        # TVM's legalization ignores these flags and applies gamma and beta anyway: the
        # op means different things to TVM and to its documentation, so we stay out.
        return "center=False / scale=False are not supported (TVM ignores them)"
    return None


@_register("nn.layer_norm", FLOAT, _check_layer_norm)
def _layer_norm(b, call):
    shape = _shape(call.args[0])
    k = len(call.attrs.axes)
    return b.node("LayerNormalization", [b.value(a) for a in call.args[:3]],
                  axis=len(shape) - k, epsilon=float(call.attrs.epsilon))


@_register("nn.softmax")
def _softmax(b, call):
    return b.node("Softmax", [b.value(call.args[0])], axis=int(call.attrs.axis))


@_register("nn.log_softmax")
def _log_softmax(b, call):
    return b.node("LogSoftmax", [b.value(call.args[0])], axis=int(call.attrs.axis))


# ---------------------------------------------------------------------------------------
# shape ops
# ---------------------------------------------------------------------------------------
@_register("reshape expand_dims squeeze flatten", ANY)
def _reshape(b, call):
    # The result type holds the static target shape, whatever the op's attribute form.
    return b.node("Reshape", [b.value(call.args[0]), b.ints(_static_shape(call.ty))])


@_register("broadcast_to", ANY)
def _broadcast_to(b, call):
    return b.node("Expand", [b.value(call.args[0]), b.ints(_static_shape(call.ty))])


@_register("tile", ANY)
def _tile(b, call):
    # ONNX Tile wants one repeat per axis; Relax left-pads the shorter of shape and repeats
    # with 1s (numpy.tile): the input is reshaped to the result's rank first where needed.
    shape, out = _shape(call.args[0]), _static_shape(call.ty)
    x = b.value(call.args[0])
    if len(shape) < len(out):
        shape = (1,) * (len(out) - len(shape)) + shape
        x = b.node("Reshape", [x, b.ints(shape)])
    return b.node("Tile", [x, b.ints([m // n for n, m in zip(shape, out)])])


@_register("flip", ANY)
def _flip(b, call):
    # ONNX has no Flip: a Slice with step -1 from the last element past the first
    axis = _norm_axis(int(call.attrs.axis), len(_shape(call.args[0])))
    return b.node("Slice", [b.value(call.args[0]), b.ints([-1]), b.ints([-(2 ** 63)]),
                            b.ints([axis]), b.ints([-1])])


@_register("permute_dims", ANY)
def _permute_dims(b, call):
    ndim = len(_shape(call.args[0]))
    axes = call.attrs.axes
    perm = list(range(ndim))[::-1] if axes is None else [_norm_axis(int(x), ndim) for x in axes]
    return b.node("Transpose", [b.value(call.args[0])], perm=perm)


def _check_concat(call):
    return "axis None (flattening concat) is not supported" if call.attrs.axis is None else None


@_register("concat", ANY, _check_concat)
def _concat(b, call):
    return b.node("Concat", list(b.value(call.args[0])), axis=int(call.attrs.axis))


@_register("split", ANY)
def _split(b, call):
    axis = int(call.attrs.axis)
    ndim = len(_shape(call.args[0]))
    fields = list(call.ty.fields)
    sizes = [_static_shape(f)[_norm_axis(axis, ndim)] for f in fields]
    outs = b.node("Split", [b.value(call.args[0]), b.ints(sizes)], outputs=len(sizes),
                  axis=axis)
    return [outs] if len(sizes) == 1 else outs


def _check_strided_slice(call):
    if len(call.args) not in (4, 5):
        return "unexpected number of arguments"
    lists = [_const_ints(a) for a in call.args[1:]]
    if any(x is None for x in lists):
        return "axes/begin/end/strides must be static"
    if len({len(x) for x in lists}) != 1:
        return "axes/begin/end/strides differ in length"
    if len(lists) == 4 and 0 in lists[3]:
        return "a stride of 0 is not valid"
    return None


@_register("strided_slice", ANY, _check_strided_slice)
def _strided_slice(b, call):
    axes, begin, end = (_const_ints(a) for a in call.args[1:4])
    strides = _const_ints(call.args[4]) if len(call.args) == 5 else [1] * len(axes)
    return b.node("Slice", [b.value(call.args[0]), b.ints(begin), b.ints(end), b.ints(axes),
                            b.ints(strides)])


def _check_take(call):
    if _dtype(call.args[1]) not in INDEX:
        return f"indices dtype {_dtype(call.args[1])} is not supported (int32/int64)"
    if call.attrs.mode not in ("fast", "clip", "wrap"):
        return f"mode {call.attrs.mode} is not supported"
    return None


@_register("take", ANY, _check_take)
def _take(b, call):
    """Gather; Relax's clip/wrap modes map indices into range first."""
    x = b.value(call.args[0])
    axis = call.attrs.axis
    if axis is None:  # take over the flattened tensor
        x, axis = b.node("Reshape", [x, b.ints([-1])]), 0
        size = int(np.prod(_shape(call.args[0])))
    else:
        axis = int(axis)
        size = _shape(call.args[0])[axis]
    idx_expr, mode = call.args[1], call.attrs.mode
    idx_dtype = _dtype(idx_expr)
    if mode != "fast" and isinstance(idx_expr, Constant):
        arr = idx_expr.value.numpy()
        arr = np.clip(arr, 0, size - 1) if mode == "clip" else np.mod(arr, size)
        idx = b.array(arr.astype(idx_dtype))
    else:
        idx = b.value(idx_expr)
        if mode == "clip":
            idx = b.node("Clip", [idx, b.scalar(0, idx_dtype), b.scalar(size - 1, idx_dtype)])
        elif mode == "wrap":
            idx = b.node("Mod", [idx, b.scalar(size, idx_dtype)])
    return b.node("Gather", [x, idx], axis=axis)


def _check_pad(call):
    a = call.attrs
    width = _ints(a.pad_width)
    if any(w < 0 for w in width):
        return "negative padding is not supported"
    if len(width) != 2 * len(_shape(call.args[0])):
        return f"pad_width {width} does not match the rank"
    if a.pad_mode not in _PAD_MODES:
        return f"pad_mode {a.pad_mode} is not supported ({', '.join(_PAD_MODES)})"
    return None


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "replicate": "edge"}


@_register("nn.pad", NUMERIC, _check_pad)
def _pad(b, call):
    a = call.attrs
    width = _ints(a.pad_width)  # interleaved: [b0, a0, b1, a1, ...]
    pads = b.ints(width[0::2] + width[1::2])
    inputs = [b.value(call.args[0]), pads]
    if a.pad_mode == "constant":
        dtype = _dtype(call.args[0])
        value = float(a.pad_value) if dtype == "float32" else int(a.pad_value)
        inputs.append(b.scalar(value, dtype))
    return b.node("Pad", inputs, mode=_PAD_MODES[a.pad_mode])


# ---------------------------------------------------------------------------------------
# reductions
# ---------------------------------------------------------------------------------------
def _axes(call) -> list:
    ndim = len(_shape(call.args[0]))
    axis = call.attrs.axis
    return list(range(ndim)) if axis is None else [_norm_axis(int(x), ndim) for x in axis]


def _check_reduce(call):
    if call.attrs.axis is not None and len(call.attrs.axis) == 0:
        return "an empty axis list is not supported"
    return None


def _reducer(onnx_op: str):
    def emit(b, call):
        return b.reduce(onnx_op, b.value(call.args[0]), _axes(call), call.attrs.keepdims)
    return emit


for _name, _onnx_op, _dt in (("sum", "ReduceSum", NUMERIC), ("mean", "ReduceMean", FLOAT),
                             ("max", "ReduceMax", ORDERED), ("min", "ReduceMin", ORDERED),
                             ("prod", "ReduceProd", NUMERIC)):
    _register(_name, _dt, _check_reduce)(_reducer(_onnx_op))


@_register("variance std", FLOAT, _check_reduce)
def _variance(b, call):
    """Population variance mean((x - mean(x))^2); std is its square root."""
    x = b.value(call.args[0])
    axes = _axes(call)
    d = b.node("Sub", [x, b.reduce("ReduceMean", x, axes, True)])
    out = b.reduce("ReduceMean", b.node("Mul", [d, d]), axes, call.attrs.keepdims)
    return b.node("Sqrt", [out]) if call.op.name == "relax.std" else out


@_register("argmax argmin", NUMERIC)
def _argmax(b, call):
    x = b.value(call.args[0])
    axis = call.attrs.axis
    op = "ArgMax" if call.op.name == "relax.argmax" else "ArgMin"
    if axis is None:  # over the flattened tensor, then into the result's shape
        flat = b.node("Reshape", [x, b.ints([-1])])
        out = b.node(op, [flat], axis=0, keepdims=0)
        return b.node("Reshape", [out, b.ints(_static_shape(call.ty))])
    return b.node(op, [x], axis=int(axis), keepdims=int(call.attrs.keepdims))


def _check_topk(call):
    if _dtype_str(call.attrs.dtype) not in INDEX:
        return f"index dtype {call.attrs.dtype} is not supported"
    return None


@_register("topk", NUMERIC, _check_topk)
def _topk(b, call):
    a = call.attrs
    values, indices = b.node("TopK", [b.value(call.args[0]), b.ints([int(a.k)])], outputs=2,
                             axis=int(a.axis), largest=int(bool(a.largest)), sorted=1)
    if _dtype_str(a.dtype) != "int64":
        indices = b.node("Cast", [indices], to=_onnx_dtype(_dtype_str(a.dtype)))
    return {"both": [values, indices], "values": values, "indices": indices}[a.ret_type]


# ---------------------------------------------------------------------------------------
# the function
# ---------------------------------------------------------------------------------------
def _flatten(names) -> list:
    if isinstance(names, list):
        return [n for item in names for n in _flatten(item)]
    return [names]


def _tensor_info(name: str, ty):
    from onnx import helper

    return helper.make_tensor_value_info(name, _onnx_dtype(str(ty.dtype)),
                                         list(_static_shape(ty)))


def _flat_types(ty) -> list:
    if isinstance(ty, relax.TupleType):
        return [t for f in ty.fields for t in _flat_types(f)]
    return [ty]


def export_function(func: relax.Function, opset: int = DEFAULT_OPSET,
                    name: str = "collage_subgraph", check: bool = True):
    """Write ``func`` as an ``onnx.ModelProto``; raises ``ExportError`` if it cannot be.

    Graph inputs are ``func.params`` in order, graph outputs the (flattened) result in
    order. Every parameter stays a graph input even when unused; note that OpenVINO drops
    unused inputs when it reads the model, so bind its inputs by name, or export only
    functions that use all their parameters (as ``extract_function`` makes them).
    ``check`` runs ONNX shape inference over the result and compares it with the Relax
    types (cheap: large initializers are left out of the copy that is inferred).
    """
    import onnx
    from onnx import helper

    if opset < MIN_OPSET or opset > onnx.defs.onnx_opset_version():
        raise ValueError(f"opset {opset} is not supported "
                         f"({MIN_OPSET}..{onnx.defs.onnx_opset_version()})")
    b = _Builder(opset)
    inputs = []
    for p in func.params:
        reason = _type_reason(p.ty, f"parameter {p.name}")
        if reason:
            raise ExportError(reason)
        pname = b.fresh(p.name)
        b.values[p] = pname
        inputs.append(_tensor_info(pname, p.ty))

    body = func.body
    blocks = body.blocks if isinstance(body, relax.SeqExpr) else []
    result = body.body if isinstance(body, relax.SeqExpr) else body
    expected: dict = {}  # ONNX name -> (op name, relax type) for the shape check
    for block in blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(binding, relax.MatchCast):  # a run-time check of a value's type
                if binding.var.ty is None or _type_reason(binding.var.ty, "match_cast"):
                    raise ExportError(f"MatchCast of {binding.var.name}: only a cast to a "
                                      "static tensor type is exported")
            elif not isinstance(binding, relax.VarBinding):
                raise ExportError(f"{type(binding).__name__} of {binding.var.name}: "
                                  "only VarBindings and MatchCasts are supported")
            reason = unsupported_reason(value)
            if reason:
                raise ExportError(reason)
            b.base = binding.var.name
            if isinstance(value, relax.Call):
                out = _OPS[value.op.name].emit(b, value)
                op_name = value.op.name
            else:  # tuple, tuple_get_item, alias, constant
                out = b.value(value)
                op_name = type(value).__name__
            b.values[binding.var] = out
            for n, ty in zip(_flatten(out), _flat_types(binding.var.ty)):
                expected.setdefault(n, (op_name, ty))

    # Graph outputs: every result name once; params, initializers and repeats need an
    # Identity (an ONNX graph output must be a distinct value produced by a node).
    produced = {o for n in b.nodes for o in n.output}
    outputs, used = [], set()
    reason = _type_reason(_ty(result), "function result")
    if reason:
        raise ExportError(reason)
    out_names = _flatten(b.value(result))
    for n, ty in zip(out_names, _flat_types(result.ty)):
        if n not in produced or n in used:
            b.base = "output"
            n = b.node("Identity", [n])
        used.add(n)
        outputs.append(_tensor_info(n, ty))

    nodes, initializers = _fold_conv_bias(b.nodes, b.initializers, {o.name for o in outputs})
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=initializers)
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="collage-tvm")
    model.ir_version = helper.find_min_ir_version_for(opsets)
    if check:
        _check_shapes(model, expected)
    return model


def _fold_conv_bias(nodes: list, initializers: list, outputs: set) -> tuple:
    """(nodes, initializers) with each ``Add(Conv(x, w), Reshape(b, [1, C, 1, ...]))`` whose
    Conv output feeds that Add alone written as ``Conv(x, w, b)``: TVM's importer splits an
    ONNX Conv's bias into a reshape and an add, and the libraries' fusions look for the
    bias inside the Conv (OpenVINO's int8 transformations, with the bias dequantized from
    int32, miss it otherwise). Initializers no node reads any more are dropped."""
    from onnx import numpy_helper

    producer = {o: n for n in nodes for o in n.output}
    readers: dict = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    consts = {t.name: t for t in initializers}
    dropped = set()
    def channels(dims) -> bool:  # [1, C, 1, ...]: one value per output channel
        return len(dims) >= 3 and dims[0] == 1 and dims[1] > 1 and all(d == 1 for d in dims[2:])

    added = []
    for add in nodes:
        if add.op_type != "Add" or len(add.input) != 2:
            continue
        for y, bias in (tuple(add.input), tuple(reversed(add.input))):
            conv = producer.get(y)
            if (conv is None or conv.op_type != "Conv" or len(conv.input) != 2
                    or y in outputs or len(readers.get(y, ())) != 1 or id(conv) in dropped):
                continue
            reshape = producer.get(bias)
            if bias in consts and channels(list(consts[bias].dims)):  # a folded constant
                flat = numpy_helper.from_array(
                    numpy_helper.to_array(consts[bias]).reshape(-1), f"{bias}_bias")
                added.append(flat)
                conv.input.append(flat.name)
            elif (reshape is not None and reshape.op_type == "Reshape"
                  and reshape.input[1] in consts
                  and channels(numpy_helper.to_array(consts[reshape.input[1]]).tolist())):
                conv.input.append(reshape.input[0])  # (a 1-D bias: Reshape made it [1,C,1,1])
                if len(readers.get(bias, ())) == 1 and bias not in outputs:
                    dropped.add(id(reshape))
            else:
                continue
            conv.output[0] = add.output[0]
            dropped.add(id(add))
            break
    if not dropped:
        return nodes, initializers
    kept = [n for n in nodes if id(n) not in dropped]
    read = {i for n in kept for i in n.input} | outputs
    return kept, [t for t in initializers + added if t.name in read]


def _check_shapes(model, expected: dict) -> None:
    """ONNX shape inference must agree with the Relax type of every value we wrote."""
    import onnx
    from onnx import helper

    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton(model), strict_mode=True)
    except Exception as err:  # noqa: BLE001 - onnx raises several error types here
        raise ExportError(f"ONNX shape inference failed on the exported graph: {err}") from err
    for info in list(inferred.graph.value_info) + list(inferred.graph.output):
        if info.name not in expected:
            continue
        op_name, ty = expected[info.name]
        tt = info.type.tensor_type
        if tt.elem_type and tt.elem_type != _onnx_dtype(str(ty.dtype)):
            raise ExportError(f"{op_name}: ONNX computes element type "
                              f"{helper.tensor_dtype_to_np_dtype(tt.elem_type)} for "
                              f"{info.name}, Relax says {ty.dtype}")
        if not tt.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        want = list(_static_shape(ty))
        if None not in dims and dims != want:
            raise ExportError(f"{op_name}: ONNX computes shape {dims} for {info.name}, "
                              f"Relax says {want}")


def skeleton(model):
    """``model`` itself, or when it holds large weights a copy that declares them as
    graph inputs instead: shape inference then sees the same shapes without the data."""
    from onnx import helper

    def is_big(t):
        return int(np.prod(t.dims)) > 1024

    big = [t for t in model.graph.initializer if is_big(t)]
    if not big:
        return model
    small = [t for t in model.graph.initializer if not is_big(t)]
    g = model.graph
    inputs = list(g.input) + [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                              for t in big]
    graph = helper.make_graph(list(g.node), g.name, inputs, list(g.output), initializer=small)
    return helper.make_model(graph, opset_imports=list(model.opset_import),
                             ir_version=model.ir_version)


def serialized(model) -> bytes | None:
    """``model``'s bytes, or None when protobuf cannot write them: one message holds at
    most 2 GiB (a model with more weights, e.g. ViT-H/14, needs external data)."""
    from google.protobuf.message import EncodeError

    try:
        return model.SerializeToString()
    except (EncodeError, ValueError):
        return None


@dataclass(frozen=True)
class OnnxFile:
    """An ONNX model left on disk (a saved build's region): a library reads it from
    ``path`` itself, without the model being parsed here first; ``inputs``: the names of
    its graph inputs, in order (what a caller's arguments bind to by position)."""

    path: str
    inputs: tuple


def graph_input_names(model) -> list:
    """The names of every graph input of ``model`` (a ``ModelProto`` or an ``OnnxFile``)."""
    if isinstance(model, OnnxFile):
        return list(model.inputs)
    return [i.name for i in model.graph.input]


@contextlib.contextmanager
def model_source(model):
    """What a library reads ``model`` from: an ``OnnxFile``'s path; its bytes, or, when they are over protobuf's
    2 GiB, the path of a temporary copy whose weights are in an external data file beside
    it (both libraries read those), removed after the block: read the model inside it.
    The weights then move out of ``model`` into the file (its initializers keep their
    names, shapes and types; their data is in the file)."""
    if isinstance(model, OnnxFile):
        yield model.path
        return
    data = serialized(model)
    if data is not None:
        yield data
        return
    import onnx

    with tempfile.TemporaryDirectory(prefix="collage-onnx-") as folder:
        path = os.path.join(folder, "model.onnx")
        onnx.save_model(model, path, save_as_external_data=True,
                        all_tensors_to_one_file=True, location="weights.bin")
        yield path


def input_names(model) -> list:
    """Names of the graph inputs of ``model`` (the function's parameters, in order)."""
    inits = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def output_names(model) -> list:
    """Names of the graph outputs of ``model`` (the function's results, in order)."""
    return [o.name for o in model.graph.output]
