"""Converters of the network layers: convolutions (and transposed), matmul, pooling
(adaptive pooling where it divides evenly), batch and layer norm, softmax.
"""
from __future__ import annotations

import numpy as np

from .base import FLOAT, _dtype, _dtype_str, _ints, _norm_axis, _shape, _static_shape, registrar

OPS: dict = {}  # this kind's entries of the op table (``ops._OPS``)
_register = registrar(OPS)

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
