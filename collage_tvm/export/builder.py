"""The builder the converters write into: ONNX nodes, initializers and value names, and the
float constants recorded as the dequantize of an int8 weight (``frontend.quantized``),
written back as that ``DequantizeLinear``.
"""
from __future__ import annotations

import re

import numpy as np
from tvm import relax

from .base import Constant, ExportError

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
