"""The op table: every supported Relax op's entry, one dict built from the converters of each
kind (``ops_elementwise``, ``ops_quantize``, ``ops_nn``, ``ops_shape``, ``ops_reduce``), and
``unsupported_reason``, what the table says of one binding value.

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
"""
from __future__ import annotations

import tvm
from tvm import relax

from . import ops_elementwise, ops_nn, ops_quantize, ops_reduce, ops_shape
from .base import Constant, _is_attr_like, _Op, _ty, _type_reason

_OPS: dict[str, _Op] = {**ops_elementwise.OPS, **ops_quantize.OPS, **ops_nn.OPS,
                        **ops_shape.OPS, **ops_reduce.OPS}


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
