"""Pattern table for the dnnl (oneDNN) backend: conv2d / conv3d / matmul with fused post-ops.

oneDNN runs a convolution or an inner product with its epilogue in one primitive:
a per-channel bias, a residual add of a same-shaped tensor, and relu (gelu for matmul).
Each entry is (name, pattern, annotations, check); the lowering lives in
``__init__.py`` beside it and reads the matched subgraph itself, so the annotations only
serve the checks below. Only float32, NCHW/NCDHW data with OIHW/OIDHW weights,
static shapes and symmetric padding are offered (what torch's oneDNN entry points take).
"""
from tvm.relax.dpl import is_const, wildcard

from collage_tvm.patterns.epilogue import (EPILOGUES, GELUS, check_conv, check_dense,
                                           check_matmul, dense_weight, make_pattern)
from collage_tvm.registry import add_backend_pattern, register_backend

register_backend("dnnl", kind="op", device="cpu", lowering="collage_tvm.backends.dnnl:DnnlLowering")

_TABLE = (
    [(f"dnnl.conv2d{s}", *make_pattern("relax.nn.conv2d", is_const(), b, r, a), check_conv)
     for s, b, r, a in EPILOGUES]
    + [(f"dnnl.conv3d{s}", *make_pattern("relax.nn.conv3d", is_const(), b, r, a), check_conv)
       for s, b, r, a in EPILOGUES]
    + [(f"dnnl.dense{s}", *make_pattern("relax.matmul", dense_weight(), b, r, a), check_dense)
       for s, b, r, a in EPILOGUES + GELUS]
    + [(f"dnnl.matmul{s}", *make_pattern("relax.matmul", wildcard(), b, r, a), check_matmul)
       for s, b, r, a in EPILOGUES[:4] + GELUS[:2]]
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
