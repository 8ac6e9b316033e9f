"""Converters of quantization: TVM's importer keeps an ONNX file's QuantizeLinear /
DequantizeLinear as ``relax.quantize`` / ``relax.dequantize``; written back, a graph
library's region holds the Q/DQ pairs it fuses into int8 kernels (not the float arithmetic
TVM computes them with). An int8 weight dequantized on import is the builder's
(``builder.mark_dequantized``).
"""
from __future__ import annotations

from .base import FLOAT, Constant, _dtype, _dtype_str, _norm_axis, _shape, registrar

OPS: dict = {}  # this kind's entries of the op table (``ops._OPS``)
_register = registrar(OPS)

QUANTIZED = frozenset({"int8", "uint8"})


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
