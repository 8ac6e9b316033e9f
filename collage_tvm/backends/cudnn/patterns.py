"""Pattern table for the cudnn backend (device cuda): conv2d / conv3d with fused epilogues.

cuDNN runs a convolution with a per-channel bias, a residual add of a same-shaped tensor
and relu in one kernel (``relu(conv(x) + z + bias)``); the lowering (``__init__.py`` beside it)
reads the matched subgraph itself. Only float32, NCHW/NCDHW data with OIHW/OIDHW constant
weights, static shapes and symmetric padding are offered (what torch's cuDNN entry points
take). TVM's own cuDNN table (``tvm.relax.backend.cuda.cudnn``) is NHWC only, which our
NCHW models never match, so the table is ours.
"""
from tvm.relax.dpl import is_const

from collage_tvm.patterns.epilogue import EPILOGUES, check_conv, make_pattern
from collage_tvm.registry import add_backend_pattern, register_backend

register_backend("cudnn", kind="op", device="cuda",
                 lowering="collage_tvm.backends.cudnn:CudnnLowering")

for _op in ("conv2d", "conv3d"):
    for _suffix, _bias, _residual, _act in EPILOGUES:
        _pattern, _annotations = make_pattern(f"relax.nn.{_op}", is_const(), _bias, _residual, _act)
        add_backend_pattern("cudnn", _pattern, check=check_conv, name=f"cudnn.{_op}{_suffix}",
                            annotations=_annotations)
