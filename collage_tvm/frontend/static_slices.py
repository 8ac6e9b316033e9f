"""Slices whose bounds are computed from constants become static slices.

PyTorch's TorchScript-based ONNX exporter writes ``x.chunk(2, dim=1)`` (ShuffleNet's channel
split, many gated units) as a ``Slice`` whose starts and ends are computed at run time from
``Shape`` of a tensor of static shape. TVM's ONNX importer keeps that computation and emits
``R.dynamic_strided_slice(x, begin, end, strides)`` of unknown output shape; every operator
after it then has unknown shape, and legalizing the next convolution fails
(``emit_te now only supports Tensor that has ShapeExpr shape``): TVM alone cannot compile
such a model either.

Here the index computations -- bindings of small integer tensors, shapes and scalars whose
inputs are all constants -- are evaluated once with TVM, and each slice whose bounds come
out constant is rewritten as ``R.strided_slice`` over every axis. Re-normalizing infers the
static shapes downstream. Slices whose bounds depend on an input stay as they are.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

_MAX_ELEMENTS = 1024  # an index computation: small tensors only (weights are never folded)


def static_slices(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with constant-bound ``dynamic_strided_slice`` calls of ``main`` made static."""
    main = mod["main"]
    if not isinstance(main.body, relax.SeqExpr):
        return mod
    dss = tvm.ir.Op.get("relax.dynamic_strided_slice")
    bindings = [b for block in main.body.blocks for b in block.bindings]
    slices = [b.value for b in bindings
              if isinstance(b, relax.VarBinding) and isinstance(b.value, relax.Call)
              and b.value.op.same_as(dss)]
    if not slices:
        return mod
    const_vars = _constant_index_vars(bindings)
    wanted = {a for call in slices for a in call.args[1:]
              if isinstance(a, relax.Var) and a in const_vars}
    if not wanted:
        return mod
    values = _evaluate(const_vars, sorted(wanted, key=lambda v: v.name))
    if values is None:
        return mod

    def constant(arg):
        if isinstance(arg, tvm.ir.expr.GenericConst):
            return arg.value.numpy()
        return values.get(arg)

    @relax.expr_functor.mutator
    class _Rewrite(relax.PyExprMutator):
        def visit_call_(self, call):  # noqa: N802 - the functor's name
            new = super().visit_call_(call)
            if not call.op.same_as(dss):
                return new
            bounds = [constant(a) for a in call.args[1:]]
            if any(b is None for b in bounds):
                return new
            begin, end, strides = (np.asarray(b).reshape(-1).tolist() for b in bounds)
            return relax.op.strided_slice(new.args[0], list(range(len(begin))), begin, end,
                                          strides)

    rewritten = _Rewrite().visit_expr(main)
    out = tvm.IRModule({gv: (rewritten if gv.name_hint == "main" else f)
                        for gv, f in mod.functions.items()}, attrs=mod.attrs)
    return relax.transform.DeadCodeElimination(["main"])(out)


def _constant_index_vars(bindings) -> dict:
    """{var: value} of the vars bound to small integer/bool tensors, shapes or scalars
    computed from constants; ``shape_of`` a tensor of static shape is that shape."""
    shape_of = tvm.ir.Op.get("relax.shape_of")
    out: dict = {}
    for b in bindings:
        if not isinstance(b, relax.VarBinding) or not _is_index(b.var.ty):
            continue
        value = b.value
        if isinstance(value, relax.Call) and value.op.same_as(shape_of):
            shape = getattr(value.args[0].ty, "shape", None)
            if isinstance(shape, relax.ShapeExpr) and all(
                    isinstance(d, tvm.tirx.IntImm) for d in shape.values):
                out[b.var] = shape
            continue
        if isinstance(value, relax.Call) and not isinstance(value.op, tvm.ir.Op):
            continue  # a call_tir/function call: leave it
        if all(v in out for v in relax.analysis.free_vars(value)):
            out[b.var] = value
    return out


def _is_index(ty) -> bool:
    if isinstance(ty, (relax.ShapeType, tvm.ir.PrimType)):
        return True
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return False
    dtype = str(ty.dtype)
    if not (dtype.startswith("int") or dtype.startswith("uint") or dtype == "bool"):
        return False
    dims = getattr(ty.shape, "values", None)
    if dims is None or not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return False
    return int(np.prod([int(d) for d in dims])) <= _MAX_ELEMENTS


def _evaluate(const_vars: dict, wanted) -> dict | None:
    """{var: numpy value} of ``wanted``, computed by compiling the bindings of ``const_vars``
    alone; None when that fails (the model is then left as imported)."""
    out = relax.Var("index_values", relax.TupleType([v.ty for v in wanted]))
    bindings = [relax.VarBinding(v, value) for v, value in const_vars.items()]
    block = relax.DataflowBlock([*bindings, relax.VarBinding(out, relax.Tuple(list(wanted)))])
    func = relax.Function([], relax.SeqExpr([block], out), ret_ty=out.ty)
    try:
        mod = tvm.IRModule({"main": func.with_attr("global_symbol", "main")})
        vm = relax.VirtualMachine(tvm.compile(relax.transform.Normalize()(mod), "llvm"),
                                  tvm.cpu())
        got = vm["main"]()
    except Exception:  # noqa: BLE001 - leave the model as imported; TVM's error comes later
        return None
    return {v: (g.numpy() if hasattr(g, "numpy") else np.array(list(g)))
            for v, g in zip(wanted, got)}
