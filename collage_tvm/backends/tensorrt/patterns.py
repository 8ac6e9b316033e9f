"""Pattern file for the tensorrt backend (a graph library on cuda): TVM's own TensorRT table.

The patterns are the ones TVM ships for its TensorRT codegen
(``tvm.relax.backend.contrib.tensorrt``: convolutions, pooling, elementwise, reductions,
shape ops, ...), added in TVM's priority order. The lowering (``__init__.py`` beside it) says
why TensorRT cannot run here; the backend is then skipped with that reason.
"""
from collage_tvm.registry import add_backend_patterns_from_tvm, register_backend

register_backend("tensorrt", kind="graph", device="cuda",
                 lowering="collage_tvm.backends.tensorrt:TensorRTLowering")
add_backend_patterns_from_tvm("tensorrt", "tensorrt")
