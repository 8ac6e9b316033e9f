"""TVM's own codegen (LLVM on CPU): runs every operator; fuses like TVM's FuseOps.

A pattern rule, not a list: ``valid_op`` accepts any operator and the fusion rule
reproduces TVM's kinds-based rule (Relay FuseOps, phase 0/1) with our op-kind table.
"""
from collage_tvm.graph.op_kind import (BROADCAST, COMM_REDUCE, INJECTIVE, OPAQUE,
                                       OUT_EWISE_FUSABLE, TUPLE)
from collage_tvm.registry import add_backend_pattern_rule, register_backend

register_backend("tvm", kind="op", device="cpu", lowering=None)


def valid_op(node):
    """Every node: TVM compiles whatever the frontend emits (call_tir, tuples, match_cast)."""
    return True


def fusion_rule(nodes):
    """``nodes`` run from a start node to one of its post-dominators, in topological order."""
    first, middle, last = nodes[0], nodes[1:-1], nodes[-1]
    if any(n.kind in (OPAQUE, TUPLE) for n in nodes):
        return False
    if first.kind == OUT_EWISE_FUSABLE:  # conv/matmul/pool + an elementwise epilogue
        return all(n.kind <= BROADCAST for n in nodes[1:])
    if first.kind <= BROADCAST:  # elementwise into an injective or reduction sink
        return (all(n.kind <= INJECTIVE for n in middle)
                and (last.kind <= INJECTIVE or last.kind == COMM_REDUCE))
    if first.kind == INJECTIVE:
        return all(n.kind <= INJECTIVE for n in nodes[1:])
    return False


add_backend_pattern_rule("tvm", valid_op, fusion_rule, max_size=8)
