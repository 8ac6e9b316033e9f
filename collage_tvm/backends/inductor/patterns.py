"""Pattern file for the inductor backend (a graph library on cuda): ``torch.compile``.

What the Relax -> ONNX exporter writes is valid (the lowering translates that ONNX into
torch ops), as for the CPU graph libraries (see backends/onnxruntime/patterns.py). Unlike them, the
op level gets whole regions of the graph only (``regions_only``): each candidate is a
``torch.compile`` of its own, seconds of compiling where onnxruntime takes milliseconds,
and one per operator (ResNet-50 at paper size: 728 distinct; regions only: 31) would spend a GPU
session's time on kernels that cuDNN, cuBLAS and TVM already offer. Where inductor pays
(fusing and launching many kernels as one) is larger groups: the regions here, any group
the graph-level placer offloads, and the whole model, which the never-slower check builds.
"""
from collage_tvm.patterns.graph_rule import one_anchor_group, exportable
from collage_tvm.registry import add_backend_pattern_rule, register_backend

register_backend("inductor", kind="graph", device="cuda",
                 lowering="collage_tvm.backends.inductor:InductorLowering")
add_backend_pattern_rule("inductor", exportable, one_anchor_group, max_size=8, regions=4,
                         regions_only=True)
