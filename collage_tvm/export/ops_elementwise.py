"""Converters of elementwise ops: arithmetic, comparisons and logic, activations (GELU
written as its formula), clip, where and casts.
"""
from __future__ import annotations

import math

import numpy as np

from .base import (ANY, BOOL, FLOAT, NUMERIC, FloatImm, IntImm, _dtype, _dtype_str, _onnx_dtype,
                   registrar)
from .builder import _Builder

OPS: dict = {}  # this kind's entries of the op table (``ops._OPS``)
_register = registrar(OPS)

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
