"""A dataflow-graph view of one Relax function: one node per binding of its dataflow block.

The placers work on node indices in topological order; the partitioner maps the chosen
groups back to bindings. Constants and function parameters are not nodes. A function with
no binding at all (a model that returns its input, a constant) has no nodes.

The module-level functions ``main`` calls (the PrimFuncs of ``call_tir``, the functions of a
``call_dps_packed`` to a GlobalVar) travel with the graph as ``globals``: every function cut
out of the graph carries those it calls in its ``collage.globals`` attribute, so a
candidate builds alone and the partitioned module keeps them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import tvm
from tvm import relax

from .op_kind import TUPLE, OPAQUE, op_kind

GLOBALS_ATTR = "collage.globals"


def _distinct(expr, kind) -> list:
    """The sub-expressions of ``expr`` of type ``kind``, deduplicated, in first-use order."""
    seen, out = set(), []

    def visit(e):
        if isinstance(e, kind) and e not in seen:
            seen.add(e)
            out.append(e)

    relax.analysis.post_order_visit(expr, visit)
    return out


def called_globals(expr) -> list:
    """The GlobalVars ``expr`` refers to (as a callee or an argument, e.g. of ``call_tir``)."""
    return _distinct(expr, relax.GlobalVar)


@dataclass
class Node:
    index: int
    var: relax.Var          # the bound variable
    value: relax.Expr       # the bound value (a Call, Tuple or TupleGetItem)
    op_name: str            # "relax.nn.conv2d"; "tuple" / "tuple_get_item" / "call:<callee>"
    kind: int               # op kind for TVM's fusion rule (graph/op_kind.py)
    inputs: list = field(default_factory=list)  # producer node indices, unique, sorted
    users: list = field(default_factory=list)   # consumer node indices, unique, sorted
    match_ty: object = None  # a MatchCast binding's type (None: a plain VarBinding)
    defines: list = field(default_factory=list)  # symbolic shape vars this match_cast defines

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
    return _distinct(expr, relax.Var)


def _symbols_read(binding) -> list:
    """The symbolic shape vars a binding reads: in its value (a shape expression, a
    ``call_tir``'s output type) and, for a match_cast, those its type uses but cannot define
    (``R.Tensor((n * 2,))`` reads ``n``) or that an earlier binding defined."""
    out = list(relax.analysis.free_symbolic_vars(binding.value))
    if isinstance(binding, relax.MatchCast):  # a var defined before is checked: a read
        out += list(relax.analysis.tir_vars_in_type(binding.ty))
    return out


class NotDataflow(ValueError):
    """No graph to place: the function is not one dataflow block (control flow, impure
    calls), or its inputs are not static."""


class DataflowGraph:
    """Nodes of the single dataflow block of ``func`` (call ``normalize_for_collage`` first).

    ``globals``: GlobalVar -> function of the module ``func`` calls into; default: the
    function's ``collage.globals`` attribute (a cut-out candidate), else none.
    """

    def __init__(self, func: relax.Function, globals: dict | None = None):
        self.func = func
        self.params = list(func.params)
        if globals is None:
            attrs = func.attrs
            globals = dict(attrs[GLOBALS_ATTR]) if attrs is not None and GLOBALS_ATTR in attrs else {}
        self.globals = dict(globals)
        blocks = list(func.body.blocks) if isinstance(func.body, relax.SeqExpr) else []
        if len(blocks) > 1 or (blocks and not isinstance(blocks[0], relax.DataflowBlock)):
            kinds = ", ".join(type(b).__name__ for b in blocks)
            raise NotDataflow("collage places a function whose body is one dataflow block; "
                              f"this one has {len(blocks)} block(s) ({kinds}): control flow or "
                              "impure calls that normalize_for_collage could not bring into one")
        self.block = blocks[0] if blocks else None
        self._param_symbols = {s for p in self.params
                               for s in relax.analysis.definable_tir_vars_in_type(p.ty)}
        self.nodes: list[Node] = []
        index_of: dict = {}
        # Symbolic shape vars (``T.int64()``) a match_cast of the body defines -> its node.
        # A node that reads one (``R.reshape(x, R.shape([d0, d1]))``) depends on that node
        # though it reads none of its Relax vars; the function's parameters define the rest.
        defined_by: dict = {}
        # Nodes that stay single TVM ops inline in ``main`` (``partition``): those defining
        # symbolic vars (main computes the shapes after them from those vars) and those
        # reading them (a function cut around such a node would have free shape vars).
        self.pinned: set = set()
        for binding in (self.block.bindings if self.block is not None else []):
            value = binding.value
            if isinstance(binding, relax.MatchCast):
                name, kind, match_ty = "match_cast", OPAQUE, binding.ty
            elif isinstance(binding, relax.VarBinding):
                name, match_ty = _op_name(value), None
                kind = TUPLE if name in ("tuple", "tuple_get_item") else (
                    op_kind(name) if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)
                    else OPAQUE)
            else:
                raise ValueError(f"unsupported binding {type(binding).__name__} for {binding.var}")
            node = Node(len(self.nodes), binding.var, value, name, kind, match_ty=match_ty)
            reads = {index_of[v] for v in free_vars(value) if v in index_of}
            symbolic = {defined_by[s] for s in _symbols_read(binding) if s in defined_by}
            node.inputs = sorted(reads | symbolic)
            if symbolic:
                self.pinned.add(node.index)
            if match_ty is not None:
                node.defines = [s for s in relax.analysis.definable_tir_vars_in_type(match_ty)
                                if s not in defined_by and s not in self._param_symbols]
                for s in node.defines:
                    defined_by[s] = node.index
                if node.defines:
                    self.pinned.add(node.index)
            for p in node.inputs:
                self.nodes[p].users.append(node.index)
            index_of[binding.var] = node.index
            self.nodes.append(node)
        self.index_of = index_of
        out_vars = free_vars(func.body.body if isinstance(func.body, relax.SeqExpr) else func.body)
        self.outputs = sorted({index_of[v] for v in out_vars if v in index_of})
        for n in self.nodes:
            n.users = sorted(set(n.users))

    @classmethod
    def from_module(cls, mod: tvm.IRModule, name: str = "main") -> "DataflowGraph":
        """The graph of ``mod[name]``, with every other function of ``mod`` as its globals."""
        return cls(mod[name], {gv: mod[gv] for gv in mod.get_global_vars()
                               if gv.name_hint != name})

    def globals_of(self, exprs) -> dict:
        """The globals ``exprs`` call into (GlobalVar -> function)."""
        found = {gv for e in exprs for gv in called_globals(e)}
        return {gv: f for gv, f in self.globals.items() if gv in found}

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
