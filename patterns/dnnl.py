"""Pattern table for the dnnl (oneDNN) backend: conv2d / conv3d / matmul with fused post-ops.

oneDNN runs a convolution or an inner product with its epilogue in one primitive:
a per-channel bias, a residual add of a same-shaped tensor, and relu (gelu for matmul).
Each entry is (name, pattern, annotations, check); the lowering lives in
backends/dnnl.py and reads the matched subgraph itself, so the annotations only
serve the checks below. Only float32, NCHW/NCDHW data with OIHW/OIDHW weights,
static shapes and symmetric padding are offered (what torch's oneDNN entry points take).
"""
import tvm
from tvm.relax.dpl import is_const, is_op, wildcard

from collage_tvm.registry import add_backend_pattern, register_backend

register_backend("dnnl", kind="op", device="cpu", lowering="collage_tvm.backends.dnnl:DnnlLowering")

_CONV_LAYOUTS = {"relax.nn.conv2d": ("NCHW", "OIHW", 4), "relax.nn.conv3d": ("NCDHW", "OIDHW", 5)}


def _make_pattern(op, weight, bias=False, residual=False, activation=None):
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


def _dense_weight():
    """A constant weight, as ``W`` (K, N) or as ``permute_dims(W)`` of a (N, K) constant."""
    return is_const() | is_op("relax.permute_dims")(is_const())


def _static_f32(expr, ndim=None):
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


def _check_epilogue(ctx, out_shape, channel_axis):
    """Bias broadcasts per output channel only; a residual has the output's exact shape."""
    if "bias" in ctx.annotated_expr:
        bias = _static_f32(ctx.annotated_expr["bias"])
        if bias is None or len(bias) > len(out_shape):
            return False
        aligned = [1] * (len(out_shape) - len(bias)) + bias
        axis = channel_axis % len(out_shape)
        if any(d != (out_shape[axis] if i == axis else 1) for i, d in enumerate(aligned)):
            return False
    if "residual" in ctx.annotated_expr:
        if _static_f32(ctx.annotated_expr["residual"]) != out_shape:
            return False
    return True


def _check_conv(ctx):
    conv = ctx.annotated_expr["root"]
    data_layout, kernel_layout, ndim = _CONV_LAYOUTS[conv.op.name]
    attrs = conv.attrs
    if attrs.data_layout != data_layout or attrs.kernel_layout != kernel_layout:
        return False
    if attrs.out_layout not in (None, "", data_layout) or str(attrs.out_dtype or "float32") not in ("float32", "void"):
        return False
    data, weight = _static_f32(ctx.annotated_expr["data"], ndim), _static_f32(ctx.annotated_expr["weight"], ndim)
    out = _static_f32(conv, ndim)
    if data is None or weight is None or out is None:
        return False
    groups, pad = int(attrs.groups), [int(p) for p in attrs.padding]
    if data[1] != weight[1] * groups or weight[0] % groups:
        return False
    if pad[: ndim - 2] != pad[ndim - 2:]:  # oneDNN through torch: symmetric padding only
        return False
    return _check_epilogue(ctx, out, channel_axis=1)


def _check_dense(ctx):
    """``x @ W`` with a constant 2-D weight (an inner product); x has >= 2 dims."""
    mm = ctx.annotated_expr["root"]
    weight = ctx.annotated_expr["weight"]
    if isinstance(weight, tvm.relax.Call):  # permute_dims(W): a plain 2-D transpose only
        axes = weight.attrs.axes
        if axes is not None and [int(a) for a in axes] != [1, 0]:
            return False
    lhs, out = _static_f32(ctx.annotated_expr["data"]), _static_f32(mm)
    if _static_f32(weight, 2) is None or lhs is None or out is None or len(lhs) < 2:
        return False
    if str(mm.attrs.out_dtype or "float32") not in ("float32", "void"):
        return False
    return _check_epilogue(ctx, out, channel_axis=-1)


def _check_matmul(ctx):
    """A 2-D x 2-D matmul of two run-time tensors (batched ones are not offered)."""
    mm = ctx.annotated_expr["root"]
    if isinstance(ctx.annotated_expr["weight"], tvm.ir.Constant):
        return False  # the dnnl.dense patterns cover it (with a pre-packed weight)
    lhs, rhs = _static_f32(ctx.annotated_expr["data"], 2), _static_f32(ctx.annotated_expr["weight"], 2)
    out = _static_f32(mm, 2)
    if lhs is None or rhs is None or out is None:
        return False
    if str(mm.attrs.out_dtype or "float32") not in ("float32", "void"):
        return False
    return _check_epilogue(ctx, out, channel_axis=-1)


_RELU, _GELU, _GELU_TANH = "relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh"
_EPILOGUES = [  # suffix, bias, residual, activation
    ("", False, False, None),
    ("_bias", True, False, None),
    ("_relu", False, False, _RELU),
    ("_bias_relu", True, False, _RELU),
    ("_bias_add", True, True, None),
    ("_bias_add_relu", True, True, _RELU),
    ("_add", False, True, None),
    ("_add_relu", False, True, _RELU),
]
_GELUS = [("_gelu", False, False, _GELU), ("_bias_gelu", True, False, _GELU),
          ("_gelu_tanh", False, False, _GELU_TANH), ("_bias_gelu_tanh", True, False, _GELU_TANH)]

_TABLE = (
    [(f"dnnl.conv2d{s}", *_make_pattern("relax.nn.conv2d", is_const(), b, r, a), _check_conv)
     for s, b, r, a in _EPILOGUES]
    + [(f"dnnl.conv3d{s}", *_make_pattern("relax.nn.conv3d", is_const(), b, r, a), _check_conv)
       for s, b, r, a in _EPILOGUES]
    + [(f"dnnl.dense{s}", *_make_pattern("relax.matmul", _dense_weight(), b, r, a), _check_dense)
       for s, b, r, a in _EPILOGUES + _GELUS]
    + [(f"dnnl.matmul{s}", *_make_pattern("relax.matmul", wildcard(), b, r, a), _check_matmul)
       for s, b, r, a in _EPILOGUES[:4] + _GELUS[:2]]
)

for _name, _pattern, _annotations, _check in _TABLE:
    add_backend_pattern("dnnl", _pattern, check=_check, name=_name, annotations=_annotations)

# The same primitives in bf16 (AVX512-BF16 / AMX), f32 in and out: used only under an
# accuracy budget that allows bf16 (--accuracy bf16), where the CPU has bf16 instructions.
register_backend("dnnl_bf16", kind="op", device="cpu", precision="bf16", variant_of="dnnl",
                 lowering="collage_tvm.backends.dnnl:DnnlBf16Lowering")
for _name, _pattern, _annotations, _check in _TABLE:
    add_backend_pattern("dnnl_bf16", _pattern, check=_check,
                        name=_name.replace("dnnl.", "dnnl_bf16.", 1), annotations=_annotations)
