"""Pattern file for the inductor backend (a graph library on cuda): ``torch.compile``.

The same rule as the CPU graph libraries (see patterns/onnxruntime.py): what the Relax ->
ONNX exporter writes is valid (the lowering translates that ONNX into torch ops), an
op-level group holds at most one heavy operator, and whole regions of the graph are offered
too, so that one compiled call can replace many kernels.
"""
from collage_tvm.patterns.graph_rule import one_anchor_group, exportable
from collage_tvm.registry import add_backend_pattern_rule, register_backend

register_backend("inductor", kind="graph", device="cuda",
                 lowering="collage_tvm.backends.inductor:InductorLowering")
add_backend_pattern_rule("inductor", exportable, one_anchor_group, max_size=8, regions=4)
