"""Pattern file for OpenVINO (a graph library): a pattern rule, no explicit list.

The same rule as onnxruntime (see patterns/onnxruntime.py): what the Relax -> ONNX
exporter writes is valid, and an op-level group holds at most one heavy operator.
OpenVINO's per-call overhead is high (DESIGN.md), so it mostly wins through the
graph-level placer, on large merged subgraphs.
"""
from collage_tvm.patterns.graph_rule import one_anchor_group, exportable
from collage_tvm.registry import add_backend_pattern_rule, register_backend

register_backend("openvino", kind="graph", device="cpu",
                 lowering="collage_tvm.backends.openvino:OpenVinoLowering")
add_backend_pattern_rule("openvino", exportable, one_anchor_group, max_size=8)
