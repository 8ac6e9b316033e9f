"""The weights of a quantized model folded to float for TVM, their int8 form kept for the
graph libraries.

An ONNX QDQ file stores each weight as int8 with a ``DequantizeLinear`` after it; TVM's
importer keeps that as ``relax.dequantize(int8 constant, scale, zero point)``, which
constant folding turns into a float weight: right for TVM's kernels (nothing dequantized
per run), but a graph library's region exported from it would then hold a float weight,
and the library's int8 fusions need the weight's ``DequantizeLinear`` (OpenVINO ran
resnet18 QDQ exported that way in 18.6 ms against 2.8 ms for the file).

``fold_dequantized_weights`` folds each such call itself and records, for the float
constant it makes, the int8 tensor, scale, zero point and axis it came from
(``export.onnx.mark_dequantized``); the ONNX exporter writes a recorded constant as the
``DequantizeLinear`` of its int8 form. Everything else sees an ordinary float constant.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from ..export.onnx import Constant, clear_dequantized, mark_dequantized


def _dequantized(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, axis: int) -> np.ndarray:
    """``(q - zero) * scale`` as ``DequantizeLinear`` computes it, a 1-D scale and zero
    point along ``axis``."""
    shape = [1] * q.ndim
    if scale.ndim == 1 and q.ndim:
        shape[axis % q.ndim] = -1
    s = scale.astype("float32").reshape(shape if scale.ndim == 1 else scale.shape)
    z = zero.astype("int64").reshape(shape if zero.ndim == 1 else zero.shape)
    return ((q.astype("int64") - z).astype("float32") * s).astype("float32")


def fold_dequantized_weights(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with each ``relax.dequantize`` of int8/uint8/int32 constants in ``main``
    replaced by its float value, recorded with its int8 form (``mark_dequantized``). The
    records of an earlier model are dropped first."""
    clear_dequantized()
    main = mod["main"]
    dequantize = tvm.ir.Op.get("relax.dequantize")

    @relax.expr_functor.mutator
    class _Fold(relax.PyExprMutator):
        def visit_call_(self, call):  # noqa: N802 - the functor's name
            new = super().visit_call_(call)
            if not (new.op.same_as(dequantize) and len(new.args) == 3
                    and all(isinstance(a, Constant) for a in new.args)
                    and str(new.attrs.out_dtype) == "float32"):
                return new
            q, scale, zero = (a.value.numpy() for a in new.args)
            if str(q.dtype) not in ("int8", "uint8", "int32") or scale.ndim > 1:
                return new
            axis = int(new.attrs.axis)
            folded = relax.const(_dequantized(q, scale, zero, axis), "float32")
            mark_dequantized(folded, q, scale, zero, axis)
            return folded

    folded = _Fold().visit_expr(main)
    if folded.same_as(main):
        return mod
    return tvm.IRModule({gv: (folded if gv.name_hint == "main" else f)
                         for gv, f in mod.functions.items()}, attrs=mod.attrs)


__all__ = ["fold_dequantized_weights"]
