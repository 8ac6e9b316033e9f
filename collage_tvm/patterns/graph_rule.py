"""The pattern rule graph libraries share: any exportable operator, one heavy op per group."""
from __future__ import annotations

from ..graph.op_kind import OPAQUE, OUT_EWISE_FUSABLE


def exportable(node) -> bool:
    """``valid_op``: the node can be written as ONNX (``collage_tvm.export.onnx``)."""
    from ..export.onnx import unsupported_reason

    return unsupported_reason(node.value) is None


def one_anchor_group(nodes) -> bool:
    """``fusion_rule``: at most one heavy operator (conv, matmul, pool, softmax, norm...)."""
    return sum(1 for n in nodes if n.call is not None
               and n.kind in (OUT_EWISE_FUSABLE, OPAQUE)) <= 1
