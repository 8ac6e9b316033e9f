"""What every layer of the Relax -> ONNX writer shares: the error it raises, the opsets it
writes, the dtypes it can hold, how it reads Relax types and attribute values, and the shape
of one entry of the op table (``registrar``: each ``ops_*`` module's decorator).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

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
# the op table's entries
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Op:
    dtypes: frozenset                       # allowed dtypes of the first tensor argument
    emit: Callable                          # emit(builder, call) -> name | [names]
    check: Callable | None = None           # check(call) -> reason | None


def registrar(table: dict):
    """The ``_register`` decorator of one ``ops_*`` module, writing into its ``table``."""
    def _register(names, dtypes=FLOAT, check=None):
        """Decorator: ``emit`` handles the Relax ops ``names`` (without the "relax." prefix)."""
        def wrap(emit):
            for n in names.split():
                table["relax." + n] = _Op(frozenset(dtypes), emit, check)
            return emit
        return wrap
    return _register
