"""Converters of reductions: sum, mean, max, min, prod, variance and std, argmax/argmin,
topk.
"""
from __future__ import annotations

from .base import (FLOAT, INDEX, NUMERIC, ORDERED, _dtype_str, _norm_axis, _onnx_dtype, _shape,
                   _static_shape, registrar)

OPS: dict = {}  # this kind's entries of the op table (``ops._OPS``)
_register = registrar(OPS)

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
