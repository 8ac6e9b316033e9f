"""Pattern file for ONNX Runtime (a graph library): a pattern rule, no explicit list.

Any operator the Relax -> ONNX exporter can write is valid. At the op level a group
may hold at most one heavy operator (convolution, matmul, pooling, softmax, norm) with
whatever cheap operators surround it along the post-dominator chain: that is where a
graph library's own fusions pay off per kernel. Larger offloads (a whole block, the
whole model) are the graph-level placer's job (``--graph-level``), which merges
adjacent groups into one ONNX Runtime call.
"""
from collage_tvm.patterns.graph_rule import one_anchor_group, exportable
from collage_tvm.registry import add_backend_pattern_rule, register_backend

register_backend("onnxruntime", kind="graph", device="cpu",
                 lowering="collage_tvm.backends.onnxruntime:OnnxRuntimeLowering")
add_backend_pattern_rule("onnxruntime", exportable, one_anchor_group, max_size=8, regions=4)
