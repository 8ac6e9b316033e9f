"""Cut a group of nodes out of the graph as a standalone Relax function, and hash it.

Boundary values become parameters of the right type; constants stay inline (weights are
part of what a backend compiles). Values used outside the group become its outputs.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib

import numpy as np
import tvm
from tvm import relax
from tvm_ffi.structural import structural_hash

from .dataflow import GLOBALS_ATTR, DataflowGraph, free_vars

Constant = tvm.ir.expr.GenericConst  # relax.Constant in TVM < 0.27


def group_boundary(graph: DataflowGraph, group) -> tuple[list, list]:
    """(input vars in first-use order, escaping node indices) of ``group``."""
    defined = {graph.nodes[i].var for i in group}
    inputs, seen = [], set()
    for i in sorted(group):
        for v in free_vars(graph.nodes[i].value):
            if v not in defined and v not in seen:
                seen.add(v)
                inputs.append(v)
    return inputs, graph.escapes(group)


def extract_function(graph: DataflowGraph, group, lift_constants: bool = False,
                     flat_outputs: bool = False):
    """The group as ``relax.Function``; returns (func, inputs, output_node_indices, consts).

    ``inputs``: what each parameter takes, in order: a var of the graph, or (var, j), field
    ``j`` of a tuple-typed var (a ``split``'s result whose items the group takes: a library
    takes tensors, so each field is a parameter, and the group's ``TupleGetItem`` of it is
    that parameter). With ``lift_constants`` every non-scalar constant becomes a trailing
    parameter (TVM's FuseTIR accepts no tensor constants inside a primitive function);
    ``consts`` lists them. With ``flat_outputs`` a tuple-typed output (a ``split`` whose
    items other groups take) is returned field by field, each a result of its own: a
    library returns tensors.
    """
    boundary, outputs = group_boundary(graph, group)
    inputs, new_params, vmap, fields = [], [], {}, {}
    for v in boundary:
        if isinstance(v.ty, relax.TupleType):
            fields[v] = [relax.Var(f"{v.name}_{j}", t) for j, t in enumerate(v.ty.fields)]
            inputs += [(v, j) for j in range(len(fields[v]))]
            new_params += fields[v]
            vmap[v] = relax.Tuple(fields[v])
        else:
            inputs.append(v)
            new_params.append(relax.Var(v.name, v.ty))
            vmap[v] = new_params[-1]
    consts: list = []
    const_params: list = []
    bindings = []
    for i in sorted(group):
        node = graph.nodes[i]
        if _is_param_field(node, fields, outputs):
            got = node.value
            vmap[node.var] = fields[got.tuple_value][got.index]  # the field's parameter
            continue
        value = substitute(node.value, vmap)
        if lift_constants:
            value = _lift_constants(value, consts, const_params)
        # Escaping values are bound to non-dataflow vars: they are the block's outputs.
        var_cls = relax.Var if i in outputs else relax.DataflowVar
        new_var = var_cls(node.var.name, node.var.ty)
        vmap[node.var] = new_var
        bindings.append(relax.MatchCast(new_var, value, node.match_ty) if node.match_ty is not None
                        else relax.VarBinding(new_var, value))
    out_vars = []
    for i in outputs:
        var = vmap[graph.nodes[i].var]
        if not (flat_outputs and isinstance(var.ty, relax.TupleType)):
            out_vars.append(var)
            continue
        for j, ty in enumerate(var.ty.fields):
            field = relax.Var(f"{graph.nodes[i].var.name}_{j}", ty)
            bindings.append(relax.VarBinding(field, relax.TupleGetItem(var, j)))
            out_vars.append(field)
    body_out = out_vars[0] if len(out_vars) == 1 else relax.Tuple(out_vars)
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], body_out)
    ret_ty = out_vars[0].ty if len(out_vars) == 1 else relax.TupleType([v.ty for v in out_vars])
    func = relax.Function(new_params + const_params, body, ret_ty)
    called = graph.globals_of(b.value for b in bindings)
    if called:  # the PrimFuncs of call_tir etc.: the candidate builds alone
        func = func.with_attr(GLOBALS_ATTR, called)
    return func, inputs, outputs, consts


def _is_param_field(node, fields, outputs) -> bool:
    """A field of a tuple the group takes (each field a parameter): no binding of its own."""
    got = node.value
    return (isinstance(got, relax.TupleGetItem) and got.tuple_value in fields
            and node.index not in outputs and node.match_ty is None)


def extracted_nodes(graph: DataflowGraph, group) -> list[int]:
    """The nodes of ``group`` that ``extract_function`` binds, in its order: node k of
    ``DataflowGraph(extract_function(graph, group)[0])`` is ``graph``'s node
    ``extracted_nodes(graph, group)[k]``."""
    boundary, outputs = group_boundary(graph, group)
    fields = {v for v in boundary if isinstance(v.ty, relax.TupleType)}
    return [i for i in sorted(group) if not _is_param_field(graph.nodes[i], fields, outputs)]


#: Attribute of a candidate's function (``Measurer.costs``): it is one piece of a larger
#: model, so built alone for timing it is not the whole model on one library, whose threads
#: may spin between calls (``partition``'s "sole group"): it is timed as it runs in place.
PART_ATTR = "collage.part_of_model"
#: Attribute of a function from ``without_weights``: how many trailing parameters stand
#: for weights, and the scale (standard deviation) of each.
STAND_INS_ATTR = "collage.stand_in_weights"
#: Float weights at least this large leave a function sent to the measuring process.
STAND_IN_MIN_ELEMENTS = 1 << 16


def without_weights(func: relax.Function, min_elements: int = STAND_IN_MIN_ELEMENTS):
    """``func`` (from ``extract_function``) with every float constant of at least
    ``min_elements`` elements made a trailing parameter, for a process that only times it:
    a weight's values do not change a kernel's time (``function_key`` ignores them too),
    and the model's weights (2.5 GB for ViT-H/14) are then not written out, sent and read
    back for every candidate. ``with_stand_ins`` puts random weights of the same shape,
    dtype and scale in their place. Smaller constants (biases, norms' scales, masks,
    indices) stay as they are."""
    lifted: dict = {}  # constant -> its parameter

    def lift(c):
        ty = c.ty
        if (c not in lifted and "float" in str(ty.dtype)
                and int(np.prod([int(d) for d in ty.shape])) >= min_elements):
            lifted[c] = relax.Var(f"w{len(lifted)}", ty)
        return lifted.get(c, c)

    replace = _replacer()(constant=lift).visit_expr
    out = _rebuilt(func, replace, lambda: list(func.params) + list(lifted.values()))
    if not lifted:
        return func
    return out.with_attr(STAND_INS_ATTR, [_scale(c) for c in lifted])


def _rebuilt(func: relax.Function, replace, params) -> relax.Function:
    """``func`` with ``replace`` applied to each binding's value and parameters ``params``
    (a list, or a callable giving it once the values are replaced)."""
    body = func.body
    blocks = [type(block)([relax.MatchCast(b.var, replace(b.value), b.ty)
                           if isinstance(b, relax.MatchCast)
                           else relax.VarBinding(b.var, replace(b.value))
                           for b in block.bindings])
              for block in body.blocks]
    params = params() if callable(params) else params
    return relax.Function(params, relax.SeqExpr(blocks, body.body), func.ret_ty,
                          attrs=func.attrs)


def _scale(const) -> float:
    """Standard deviation of a constant's values (1.0 when not finite: a mask of -inf)."""
    arr = np.from_dlpack(const.value)
    std = float(np.std(arr, dtype=np.float64)) if arr.size else 1.0
    return std if np.isfinite(std) and std > 0 else 1.0


def with_stand_ins(func: relax.Function, seed: int = 0) -> relax.Function:
    """A function from ``without_weights`` with random weights bound in place of its
    trailing weight parameters (normal, of each weight's scale), ready to build and time;
    any other function as it is."""
    attrs = func.attrs
    if attrs is None or STAND_INS_ATTR not in attrs:
        return func
    scales = [float(s) for s in attrs[STAND_INS_ATTR]]
    params = list(func.params)[len(func.params) - len(scales):]
    rng = np.random.default_rng(seed)
    weights = {}
    for p, scale in zip(params, scales):
        shape, dtype = tuple(int(d) for d in p.ty.shape), str(p.ty.dtype)
        arr = rng.standard_normal(shape, dtype=np.float32)
        arr *= np.float32(scale)
        weights[p] = relax.const(arr if dtype == "float32" else arr.astype(dtype))
        del arr
    kept = list(func.params)[:len(func.params) - len(scales)]
    return _rebuilt(func, lambda e: substitute(e, weights), kept).without_attr(STAND_INS_ATTR)


def one_op_function(shape, make, dtype: str = "float32") -> relax.Function:
    """``main(x) = make(x)`` for one input of ``shape``: a probe kernel, a test case."""
    x = relax.Var("x", relax.TensorType(shape, dtype))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(make(x))
        bb.emit_func_output(y)
    return bb.get()["main"]


_REPLACE = None


def substitute(expr, vmap: dict):
    """``expr`` with its variables replaced by ``vmap`` (the others kept)."""
    return _replacer()(vars=vmap).visit_expr(expr)


def _replacer():
    """A mutator class whose instances replace variable ``v`` with ``vars.get(v, v)`` and
    constant ``c`` with ``constant(c)``."""
    global _REPLACE
    if _REPLACE is None:
        @relax.expr_functor.mutator
        class Replace(relax.PyExprMutator):
            def __init__(self, vars=None, constant=None):  # noqa: A002 - a map of variables
                super().__init__()
                self.vars = vars or {}
                self.constant = constant

            def visit_var_(self, op):  # noqa: N802 (TVM's visitor naming)
                return self.vars.get(op, op)

            def visit_dataflow_var_(self, op):  # noqa: N802
                return self.vars.get(op, op)

            def visit_generic_const_(self, op):  # noqa: N802
                return op if self.constant is None else self.constant(op)

        _REPLACE = Replace
    return _REPLACE


def _lift_constants(expr, consts: list, const_params: list):
    """``expr`` (a binding's value) with its tensor constants, as call arguments or as
    fields of a tuple argument (``concat((cls_token, x))`` in a ViT), made parameters. A
    float scalar stays (TVM's legalization makes a binary op's scalar an immediate); an
    integer one is lifted (``take(x, R.const(0))``: legalized, it is a tensor argument)."""
    def lift(a):
        if isinstance(a, Constant) and (len(a.ty.shape) > 0 or "int" in str(a.ty.dtype)):
            p = relax.Var(f"c{len(consts)}", a.ty)
            consts.append(a)
            const_params.append(p)
            return p
        if isinstance(a, relax.Tuple) and any(isinstance(f, Constant) for f in a.fields):
            return relax.Tuple([lift(f) for f in a.fields])
        return a

    if not isinstance(expr, relax.Call):
        return expr
    return relax.Call(expr.op, [lift(a) for a in expr.args], expr.attrs, expr.ty_args)


def _render(expr, names: dict) -> str:
    if isinstance(expr, relax.Var):
        return names.get(expr, "?free")
    if isinstance(expr, Constant):
        arr = expr.value.numpy()
        text = f"const[{arr.shape},{arr.dtype}]"
        if arr.size == 1:  # scalars (e.g. 0.5 in x * 0.5) change semantics: keep them
            text += repr(arr.tolist())
        return text
    if isinstance(expr, relax.Call):
        op = expr.op.name if isinstance(expr.op, tvm.ir.Op) else str(expr.op)
        args = ",".join(_render(a, names) for a in expr.args)
        return f"{op}({args}){expr.attrs}|{list(expr.ty_args) if expr.ty_args else ''}"
    if isinstance(expr, relax.Tuple):
        return "(" + ",".join(_render(a, names) for a in expr.fields) + ")"
    if isinstance(expr, relax.TupleGetItem):
        return f"{_render(expr.tuple_value, names)}[{expr.index}]"
    if isinstance(expr, relax.ShapeExpr):
        return str(expr)
    return f"{type(expr).__name__}:{expr}"


def function_key(func: relax.Function) -> str:
    """Structural hash of a function, shapes/dtypes/attributes included, weights' values not.

    Two convolutions of the same shapes with different weights cost the same, so they share
    one cost-DB entry.
    """
    names = {}
    lines = []
    for i, p in enumerate(func.params):
        names[p] = f"p{i}"
        lines.append(f"p{i}:{p.ty}")
    body = func.body
    for block in body.blocks:
        for b in block.bindings:
            names[b.var] = f"v{len(names)}"
            cast = f" as {b.ty}" if isinstance(b, relax.MatchCast) else ""
            lines.append(f"{names[b.var]}:{b.var.ty}={_render(b.value, names)}{cast}")
    lines.append("ret " + _render(body.body, names))
    attrs = func.attrs
    if attrs is not None and GLOBALS_ATTR in attrs:  # what a call_tir runs is part of the kernel
        lines += sorted(f"global {gv.name_hint}: {structural_hash(f)}"
                        for gv, f in attrs[GLOBALS_ATTR].items())
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:32]


def tensor_bytes(shape, dtype) -> int:
    """Bytes of a tensor of static ``shape`` and ``dtype``."""
    return int(np.prod([int(d) for d in shape], dtype=np.int64)) * np.dtype(str(dtype)).itemsize


def constant_bytes(expr) -> int:
    """Bytes of the constants (weights) ``expr`` holds: in call arguments and tuple fields,
    nested."""
    total, pending = 0, [expr]
    while pending:
        e = pending.pop()
        if isinstance(e, Constant):
            total += tensor_bytes(e.value.shape, e.value.dtype)
        elif isinstance(e, relax.Call):
            pending.extend(e.args)
        elif isinstance(e, relax.Tuple):
            pending.extend(e.fields)
    return total


#: Operators whose second operand divides: an integer zero there is a SIGFPE that ends the
#: whole process (TVM's kernel, the libraries' alike), not an error to catch.
DIVIDING_OPS = ("relax.divide", "relax.floor_divide", "relax.mod", "relax.floor_mod")
#: Operators an integer passes through unchanged in value on its way to a divisor.
_VALUE_PRESERVING = ("relax.astype", "relax.broadcast_to", "relax.reshape", "relax.expand_dims",
                     "relax.squeeze", "relax.permute_dims", "relax.flatten")


def divisor_params(func) -> set:
    """``func``'s parameters (``relax.Var``) that reach the divisor of an integer division or modulo
    (through casts and reshapes): their random values must not be zero."""
    bound: dict = {}
    calls: list = []
    for block in getattr(func.body, "blocks", ()):
        for b in block.bindings:
            if isinstance(b, relax.VarBinding):
                bound[b.var] = b.value
                if isinstance(b.value, relax.Call) and isinstance(b.value.op, tvm.ir.Op):
                    calls.append(b.value)
    params = set(func.params)
    out = set()
    for call in calls:
        if call.op.name not in DIVIDING_OPS or len(call.args) < 2:
            continue
        e = call.args[1]
        while e in bound and isinstance(bound[e], relax.Call) and \
                isinstance(bound[e].op, tvm.ir.Op) and bound[e].op.name in _VALUE_PRESERVING:
            e = bound[e].args[0]
        if e in params:
            out.add(e)
    return out


_GIVEN: contextvars.ContextVar = contextvars.ContextVar("collage_given_inputs", default=None)


@contextlib.contextmanager
def given_inputs(arrays):
    """Within the block, ``random_inputs(..., seed=0)`` of a function whose parameters have
    the shapes and dtypes of ``arrays`` (the model's inputs) returns copies of ``arrays``:
    the user's example inputs are the first inputs every build is checked and timed on. An
    input whose values shape the computation (a slice's starts and ends, a range's limits)
    may have no random stand-in TVM alone runs. ``None``: random inputs as usual."""
    token = _GIVEN.set([np.asarray(a) for a in arrays] if arrays is not None else None)
    try:
        yield
    finally:
        _GIVEN.reset(token)


def _given_for(params) -> list | None:
    given = _GIVEN.get()
    if given is None or len(given) != len(params):
        return None
    for p, a in zip(params, given):
        ty = p.ty
        if not isinstance(ty, relax.TensorType) or ty.shape is None or ty.dtype is None:
            return None
        try:
            shape = [int(s) for s in ty.shape]
        except TypeError:  # a symbolic dimension
            return None
        if list(a.shape) != shape or str(a.dtype) != str(ty.dtype):
            return None
    return [a.copy() for a in given]


def random_inputs(params, seed: int = 0) -> list:
    """Random numpy arrays for the parameters of ``params`` (a function, or its parameter
    list): floats in [-1, 1), ints small and non-negative (valid indices), and in [1, 4)
    where the function divides by them (``divisor_params``; given a function only). Seed 0
    inside ``given_inputs`` gives the user's inputs where they fit the parameters."""
    nonzero = set()
    if isinstance(params, relax.Function):
        nonzero, params = divisor_params(params), params.params
    if seed == 0:
        given = _given_for(params)
        if given is not None:
            return given
    rng = np.random.default_rng(seed)
    out = []
    for p in params:
        shape = [int(s) for s in p.ty.shape]
        # A tensor whose dtype the importer left unknown (an ONNX sequence input stacked
        # into one tensor: onnx node test_identity_sequence): float32, as such sequences are.
        dtype = "float32" if p.ty.dtype is None else str(p.ty.dtype)
        if dtype.startswith("float"):
            out.append(rng.uniform(-1, 1, size=shape).astype(dtype))
        elif dtype == "bool":
            out.append(rng.integers(0, 2, size=shape).astype(bool))
        else:
            low = 1 if p in nonzero else 0
            out.append(rng.integers(low, 4, size=shape).astype(dtype))
    return out
