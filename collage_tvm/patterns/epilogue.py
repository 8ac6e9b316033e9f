"""Patterns of an anchor op with its epilogue, for the pattern files of operator libraries.

``activation(anchor(data, weight) [+ bias] [+ residual])`` with ``anchor`` a conv2d, conv3d
or matmul: what oneDNN, cuDNN and cuBLAS(Lt) run as one kernel. ``make_pattern`` builds the
``tvm.relax.dpl`` pattern and its annotations; the ``check_*`` functions accept a match only
where such a library can run it (float32, static shapes, NCHW/NCDHW data with OIHW/OIDHW
weights, symmetric padding, a per-channel bias, a residual of the output's exact shape).
``EPILOGUES`` and ``GELUS`` list the (suffix, bias, residual, activation) variants.
"""
import tvm
from tvm.relax.dpl import is_const, is_op, wildcard

CONV_LAYOUTS = {"relax.nn.conv2d": ("NCHW", "OIHW", 4), "relax.nn.conv3d": ("NCDHW", "OIDHW", 5)}


def make_pattern(op, weight, bias=False, residual=False, activation=None):
    """``activation(op(data, weight) [+ bias] [+ residual])`` and its annotations."""
    data = wildcard()
    root = is_op(op)(data, weight)
    annotations = {"root": root, "data": data, "weight": weight}
    out = root
    if bias:
        annotations["bias"] = b = is_const()
        out = is_op("relax.add")(out, b) | is_op("relax.add")(b, out)
    if residual:
        annotations["residual"] = r = wildcard()
        out = is_op("relax.add")(out, r) | is_op("relax.add")(r, out)
    if activation:
        out = is_op(activation)(out)
    return out, annotations


def dense_weight():
    """A constant weight, as ``W`` (K, N) or as ``permute_dims(W)`` of a (N, K) constant."""
    return is_const() | is_op("relax.permute_dims")(is_const())


def static_f32(expr, ndim=None):
    ty = expr.ty
    if not isinstance(ty, tvm.relax.TensorType) or ty.dtype != "float32":
        return None
    shape = getattr(ty.shape, "values", None)  # None: unknown rank or a symbolic shape var
    if shape is None:
        return None
    if not all(isinstance(d, (int, tvm.tirx.IntImm)) for d in shape):
        return None
    shape = [int(d) for d in shape]
    return shape if ndim is None or len(shape) == ndim else None


def check_epilogue(ctx, out_shape, channel_axis):
    """Bias broadcasts per output channel only; a residual has the output's exact shape."""
    if "bias" in ctx.annotated_expr:
        bias = static_f32(ctx.annotated_expr["bias"])
        if bias is None or len(bias) > len(out_shape):
            return False
        aligned = [1] * (len(out_shape) - len(bias)) + bias
        axis = channel_axis % len(out_shape)
        if any(d != (out_shape[axis] if i == axis else 1) for i, d in enumerate(aligned)):
            return False
    if "residual" in ctx.annotated_expr:
        if static_f32(ctx.annotated_expr["residual"]) != out_shape:
            return False
    return True


def check_conv(ctx):
    conv = ctx.annotated_expr["root"]
    data_layout, kernel_layout, ndim = CONV_LAYOUTS[conv.op.name]
    attrs = conv.attrs
    if attrs.data_layout != data_layout or attrs.kernel_layout != kernel_layout:
        return False
    if attrs.out_layout not in (None, "", data_layout) or str(attrs.out_dtype or "float32") not in ("float32", "void"):
        return False
    data, weight = static_f32(ctx.annotated_expr["data"], ndim), static_f32(ctx.annotated_expr["weight"], ndim)
    out = static_f32(conv, ndim)
    if data is None or weight is None or out is None:
        return False
    groups, pad = int(attrs.groups), [int(p) for p in attrs.padding]
    if data[1] != weight[1] * groups or weight[0] % groups:
        return False
    if pad[: ndim - 2] != pad[ndim - 2:]:  # torch's conv entry points: symmetric padding only
        return False
    return check_epilogue(ctx, out, channel_axis=1)


def check_dense(ctx):
    """``x @ W`` with a constant 2-D weight (an inner product); x has >= 2 dims."""
    mm = ctx.annotated_expr["root"]
    weight = ctx.annotated_expr["weight"]
    if isinstance(weight, tvm.relax.Call):  # permute_dims(W): a plain 2-D transpose only
        axes = weight.attrs.axes
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return False
    lhs, out = static_f32(ctx.annotated_expr["data"]), static_f32(mm)
    if static_f32(weight, 2) is None or lhs is None or out is None or len(lhs) < 2:
        return False
    if str(mm.attrs.out_dtype or "float32") not in ("float32", "void"):
        return False
    return check_epilogue(ctx, out, channel_axis=-1)


def check_matmul(ctx, batched: bool = False):
    """A matmul of two run-time tensors: 2-D x 2-D, or with ``batched`` also N-D x N-D of
    one batch shape (a batched GEMM; no broadcasting)."""
    mm = ctx.annotated_expr["root"]
    if isinstance(ctx.annotated_expr["weight"], tvm.ir.Constant):
        return False  # the dense patterns cover it (with a pre-packed weight)
    lhs, rhs = static_f32(ctx.annotated_expr["data"]), static_f32(ctx.annotated_expr["weight"])
    out = static_f32(mm)
    if lhs is None or rhs is None or out is None or len(lhs) != len(rhs) or len(lhs) < 2:
        return False
    if len(lhs) > 2 and (not batched or lhs[:-2] != rhs[:-2]):
        return False
    if str(mm.attrs.out_dtype or "float32") not in ("float32", "void"):
        return False
    return check_epilogue(ctx, out, channel_axis=-1)


RELU, GELU, GELU_TANH = "relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh"
EPILOGUES = [  # suffix, bias, residual, activation
    ("", False, False, None),
    ("_bias", True, False, None),
    ("_relu", False, False, RELU),
    ("_bias_relu", True, False, RELU),
    ("_bias_add", True, True, None),
    ("_bias_add_relu", True, True, RELU),
    ("_add", False, True, None),
    ("_add_relu", False, True, RELU),
]
GELUS = [("_gelu", False, False, GELU), ("_bias_gelu", True, False, GELU),
         ("_gelu_tanh", False, False, GELU_TANH), ("_bias_gelu_tanh", True, False, GELU_TANH)]
