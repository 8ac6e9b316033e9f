"""Converters of shape and data movement: reshapes (to the result's static shape),
broadcast, tile, flip, transpose, concat, split, strided slice, take (gather), pad.
"""
from __future__ import annotations

import numpy as np

from .base import (ANY, INDEX, NUMERIC, Constant, _const_ints, _dtype, _ints, _norm_axis,
                   _shape, _static_shape, registrar)

OPS: dict = {}  # this kind's entries of the op table (``ops._OPS``)
_register = registrar(OPS)

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
