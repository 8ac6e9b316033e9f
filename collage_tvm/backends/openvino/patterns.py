"""Pattern file for OpenVINO (a graph library): a pattern rule, no explicit list.

The same rule as onnxruntime (see backends/onnxruntime/patterns.py): what the Relax -> ONNX
exporter writes is valid, and an op-level group holds at most one heavy operator.
OpenVINO's call overhead is high (docs/DESIGN.md), so it mostly wins through the
graph-level placer, on large merged subgraphs.
"""
from collage_tvm.patterns.graph_rule import one_anchor_group, exportable
from collage_tvm.registry import add_backend_pattern_rule, register_backend

register_backend("openvino", kind="graph", device="cpu",
                 lowering="collage_tvm.backends.openvino:OpenVinoLowering")
add_backend_pattern_rule("openvino", exportable, one_anchor_group, max_size=8, regions=4)

# The same library in bf16, OpenVINO's default precision on CPUs with bf16 instructions:
# used only under an accuracy budget that allows bf16 (--accuracy bf16).
register_backend("openvino_bf16", kind="graph", device="cpu", precision="bf16",
                 variant_of="openvino",
                 lowering="collage_tvm.backends.openvino:OpenVinoBf16Lowering")
add_backend_pattern_rule("openvino_bf16", exportable, one_anchor_group, max_size=8, regions=4)
