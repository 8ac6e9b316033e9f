"""A dataflow-graph view of one Relax function: one node per binding of its dataflow block.

The placers work on node indices in topological order; the partitioner maps the chosen
groups back to bindings. Constants and function parameters are not nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax

from .op_kind import TUPLE, OPAQUE, op_kind


@dataclass
class Node:
    index: int
    var: relax.Var          # the bound variable
    value: relax.Expr       # the bound value (a Call, Tuple or TupleGetItem)
    op_name: str            # "relax.nn.conv2d"; "tuple" / "tuple_get_item" / "call:<callee>"
    kind: int               # op kind for TVM's fusion rule (graph/op_kind.py)
    inputs: list = field(default_factory=list)  # producer node indices, unique, sorted
    users: list = field(default_factory=list)   # consumer node indices, unique, sorted

    @property
    def call(self):
        return self.value if isinstance(self.value, relax.Call) else None

    @property
    def attrs(self):
        return self.value.attrs if isinstance(self.value, relax.Call) else None

    @property
    def ty(self):
        return self.var.ty

    @property
    def args(self) -> list:
        if isinstance(self.value, relax.Call):
            return list(self.value.args)
        if isinstance(self.value, relax.Tuple):
            return list(self.value.fields)
        if isinstance(self.value, relax.TupleGetItem):
            return [self.value.tuple_value]
        return []

    def __repr__(self) -> str:
        return f"Node({self.index}, {self.op_name}, in={self.inputs})"


def _op_name(value) -> str:
    if isinstance(value, relax.Call):
        if isinstance(value.op, tvm.ir.Op):
            return value.op.name
        if isinstance(value.op, relax.ExternFunc):
            return f"call:{value.op.global_symbol}"
        return f"call:{getattr(value.op, 'name_hint', type(value.op).__name__)}"
    if isinstance(value, relax.Tuple):
        return "tuple"
    if isinstance(value, relax.TupleGetItem):
        return "tuple_get_item"
    return type(value).__name__


def free_vars(expr) -> list:
    """Relax vars an expression reads (deduplicated, in first-use order)."""
    seen, out = set(), []

    def visit(e):
        if isinstance(e, relax.Var) and e not in seen:
            seen.add(e)
            out.append(e)

    relax.analysis.post_order_visit(expr, visit)
    return out


class DataflowGraph:
    """Nodes of the single dataflow block of ``func`` (call ``normalize_for_collage`` first)."""

    def __init__(self, func: relax.Function):
        self.func = func
        self.params = list(func.params)
        blocks = func.body.blocks if isinstance(func.body, relax.SeqExpr) else []
        if len(blocks) != 1 or not isinstance(blocks[0], relax.DataflowBlock):
            raise ValueError("collage expects a function whose body is one dataflow block; "
                             f"got {len(blocks)} block(s). Run normalize_for_collage first.")
        self.block = blocks[0]
        self.nodes: list[Node] = []
        index_of: dict = {}
        for binding in self.block.bindings:
            if not isinstance(binding, relax.VarBinding):
                raise ValueError(f"unsupported binding {type(binding).__name__} for {binding.var}")
            value = binding.value
            name = _op_name(value)
            kind = TUPLE if name in ("tuple", "tuple_get_item") else (
                op_kind(name) if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                else OPAQUE)
            node = Node(len(self.nodes), binding.var, value, name, kind)
            node.inputs = sorted({index_of[v] for v in free_vars(value) if v in index_of})
            for p in node.inputs:
                self.nodes[p].users.append(node.index)
            index_of[binding.var] = node.index
            self.nodes.append(node)
        self.index_of = index_of
        out_vars = free_vars(func.body.body)
        self.outputs = sorted({index_of[v] for v in out_vars if v in index_of})
        for n in self.nodes:
            n.users = sorted(set(n.users))

    def __len__(self) -> int:
        return len(self.nodes)

    @property
    def producers(self) -> list:
        return [n.inputs for n in self.nodes]

    def var2val(self) -> dict:
        return {n.var: n.value for n in self.nodes}

    def escapes(self, group) -> list:
        """Nodes of ``group`` whose values are used outside it (or are function outputs)."""
        outs = set(self.outputs)
        return [i for i in sorted(group)
                if i in outs or any(u not in group for u in self.nodes[i].users)]

    def post_dominators(self) -> list:
        """Immediate post-dominator of each node (None when only the exit post-dominates it)."""
        n = len(self.nodes)
        exit_ = n  # a virtual sink after every output
        succ = [list(node.users) for node in self.nodes]
        for o in self.outputs:
            succ[o].append(exit_)
        for i, node in enumerate(self.nodes):
            if not succ[i]:
                succ[i].append(exit_)  # dead values flow to the sink too
        ipdom: list = [None] * (n + 1)
        ipdom[exit_] = exit_
        order = {i: i for i in range(n + 1)}

        def intersect(a, b):
            while a != b:
                while order[a] < order[b]:
                    a = ipdom[a]
                while order[b] < order[a]:
                    b = ipdom[b]
            return a

        # Nodes are topologically sorted, so one reverse sweep reaches the fixpoint.
        for i in range(n - 1, -1, -1):
            cur = None
            for s in succ[i]:
                cur = s if cur is None else intersect(cur, s)
            ipdom[i] = cur
        return [None if ipdom[i] == exit_ else ipdom[i] for i in range(n)]
