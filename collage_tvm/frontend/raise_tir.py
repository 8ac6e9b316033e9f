"""Raise the ``call_tir`` PrimFuncs TVM's ONNX importer writes back to Relax ops (issue #33).

The importer converts a few ordinary ONNX operators with ``bb.emit_te(topi.xxx, ...)``
(``Clip`` -> ``maximum`` then ``minimum``, ``Pad`` -> ``pad``, ``Tile`` -> ``tile``): what
it leaves in ``main`` is an ``R.call_tir`` that no graph-library pattern or exporter case
takes, so every onnxruntime/openvino region is cut at every ReLU6 (MobileNetV2) or window
padding (Swin). Each such call becomes the Relax op that computes the same thing, and
``minimum(maximum(x, lo), hi)`` with constant scalar bounds ``lo <= hi`` one ``R.clip``
(equal except on a NaN input: TVM's max/min give 0 for ReLU6 and its clip 6; ONNX, and
the libraries that now run it, NaN).

A PrimFunc's name only says which op to try and where its parameters are (pad widths read
from the load's indices, tile repeats from the shapes); the op is taken only when TVM's own
legalization of it gives a PrimFunc structurally equal to the importer's: the same
computation, whatever the name. Unrecognised calls (reflect padding, ``einsum``, whose
equation the PrimFunc does not keep, ``dyn_tile``) stay as they are: TVM compiles them
fine. ``collage_tvm.tools.call_tir_survey`` surveys what the importer writes (docs/COVERAGE.md).
"""
from __future__ import annotations

import logging

import tvm
from tvm import relax, tirx
from tvm_ffi import structural_equal

logger = logging.getLogger("collage_tvm")

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")
_MAXIMUM = tvm.ir.Op.get("relax.maximum")
_MINIMUM = tvm.ir.Op.get("relax.minimum")


def raise_call_tir(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with the recognised ``call_tir`` bindings of ``main`` written as Relax ops,
    and the PrimFuncs no longer called removed."""
    main = mod["main"]
    if not isinstance(main.body, relax.SeqExpr) or not _calls_tir(main):
        return mod
    raised = _Raise(mod, _use_counts(main)).visit_expr(main)
    out = tvm.IRModule({gv: (raised if gv.name_hint == "main" else f)
                        for gv, f in mod.functions.items()}, attrs=mod.attrs)
    # the maximum a clip absorbed is dead, and so is every PrimFunc no longer called
    return relax.transform.DeadCodeElimination(["main"])(out)


@relax.expr_functor.mutator
class _Raise(relax.PyExprMutator):
    def __init__(self, mod, uses):
        super().__init__(mod)
        self.mod_, self.uses, self.ops = mod, uses, {}

    def visit_call_(self, call):  # noqa: N802 - the functor's name
        new = super().visit_call_(call)
        if new.op.same_as(_CALL_TIR) and isinstance(new.args[1], relax.Tuple):
            gv, args = new.args[0], list(new.args[1].fields)
            if gv not in self.ops:  # one check per PrimFunc: the importer shares equal ones
                self.ops[gv] = _relax_op(gv.name_hint, self.mod_[gv], args, call.ty)
            if self.ops[gv] is not None:
                new = self.ops[gv](*args)
        if new.op.same_as(_MINIMUM):
            first = call.args[1].fields[0] if call.op.same_as(_CALL_TIR) else call.args[0]
            if isinstance(new.args[0], relax.Var) and self.uses.get(first, 0) == 1:
                # (a maximum with other users is computed anyway: no clip then)
                clip = _clip(new, self.lookup_binding(new.args[0]), call.ty)
                return new if clip is None else clip
        return new


def _relax_op(name: str, func, args, out_ty):
    """``make(*args)`` building the Relax op that computes what ``func`` computes, or None."""
    propose = _PROPOSALS.get(_base(name))
    if not isinstance(func, tirx.PrimFunc) or propose is None or \
            _static_shape(out_ty) is None or any(_static_shape(a.ty) is None for a in args):
        return None
    try:
        make = propose(func, args, out_ty)
        return make if make is not None and _computes(func, make, args) else None
    except Exception as err:  # noqa: BLE001 - raising is an optimisation: never stop an import
        logger.debug("call_tir %s not raised: %s: %s", name, type(err).__name__, err)
        return None


def _computes(func, make, args) -> bool:
    """Legalizing ``make`` over ``args``' types gives ``func`` (names aside)."""
    params = [relax.Var(f"a{i}", a.ty) for i, a in enumerate(args)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(make(*params))
        bb.emit_func_output(out)
    legal = relax.transform.LegalizeOps()(bb.get())
    funcs = [f for gv, f in legal.functions.items() if gv.name_hint != "main"]
    return len(funcs) == 1 and structural_equal(funcs[0], func)


# --------------------------------------------------------------------------- proposals
# PrimFunc name -> propose(func, args, out_ty) -> make(*args) | None. The name is the one
# ``emit_te`` gives (the topi function's), without the number that makes it unique.

def _binary(op, tir_op):
    def propose(func, args, out_ty):
        if len(args) == 2:
            return op
        # Clip before opset 11: the bound is an attribute, inlined in the PrimFunc
        store = _single_store(func.body)
        bound = getattr(store, "value", None)
        if len(args) == 1 and isinstance(bound, tir_op) and \
                isinstance(bound.b, (tirx.FloatImm, tirx.IntImm)):
            const = relax.const(bound.b.value, str(bound.b.dtype))
            return lambda x: op(x, const)
        return None
    return propose


def _padding(mode: str):
    """Constant padding stores ``if_then_else(inside, x[i - before], value)``, replicate
    padding ``x[max(0, min(n - 1, i - before))]``; either is ``x[i]`` where every width is 0
    (an exported ``F.pad`` that pads nothing)."""
    def propose(func, args, out_ty):
        value = getattr(_single_store(func.body), "value", None)
        if isinstance(value, tvm.ir.expr.TensorLoad):
            load, pad_value = value, 0.0
        elif mode == "constant" and isinstance(value, tvm.ir.expr.Call) and \
                value.op.name == "prim.if_then_else" and \
                isinstance(value.args[2], (tirx.FloatImm, tirx.IntImm)):
            load, pad_value = value.args[1], value.args[2].value
        else:
            return None
        before = [_offset(i) for i in getattr(load, "indices", [])]
        shape, out = _static_shape(args[0].ty), _static_shape(out_ty)
        if len(args) != 1 or len(before) != len(shape) or None in before:
            return None
        width = []
        for b, n, m in zip(before, shape, out):
            width += [b, m - n - b]
        return lambda x: relax.op.nn.pad(x, width, mode, pad_value)
    return propose


def _tile(func, args, out_ty):
    shape, out = _static_shape(args[0].ty), _static_shape(out_ty)
    if len(args) != 1 or len(out) < len(shape) or 0 in shape:
        return None
    shape = (1,) * (len(out) - len(shape)) + shape
    if any(m % n for n, m in zip(shape, out)):
        return None
    repeats = [m // n for n, m in zip(shape, out)]
    return lambda x: relax.op.tile(x, repeats)


def _flip(func, args, out_ty):
    """``out[..., i, ...] = x[..., n - 1 - i, ...]`` (CumSum with ``reverse``)."""
    load = getattr(_single_store(func.body), "value", None)
    axes = [k for k, i in enumerate(getattr(load, "indices", []))
            if isinstance(i, tirx.Sub) and isinstance(i.a, tirx.IntImm)]
    if len(args) != 1 or len(axes) != 1:
        return None
    return lambda x: relax.op.flip(x, axes[0])


_PROPOSALS = {"maximum": _binary(relax.op.maximum, tirx.Max),
              "minimum": _binary(relax.op.minimum, tirx.Min),
              "pad": _padding("constant"), "replicate_pad": _padding("replicate"),
              "tile": _tile, "flip": _flip}


def _clip(minimum, maximum, out_ty):
    """``R.clip(x, lo, hi)`` for ``minimum(maximum(x, lo), hi)`` with constant scalar bounds
    ``lo <= hi`` (for ``lo > hi`` ONNX Clip gives ``hi`` and ``R.clip`` gives ``lo``)."""
    if not isinstance(maximum, relax.Call) or not maximum.op.same_as(_MAXIMUM):
        return None
    x = maximum.args[0]
    lo, hi = _scalar(maximum.args[1]), _scalar(minimum.args[1])
    if lo is None or hi is None or not lo <= hi or _static_shape(x.ty) is None or \
            _static_shape(x.ty) != _static_shape(out_ty) or str(x.ty.dtype) != str(out_ty.dtype):
        return None
    dtype = str(x.ty.dtype)
    return relax.op.clip(x, tirx.const(lo, dtype), tirx.const(hi, dtype))


# --------------------------------------------------------------------------- helpers

def _base(name: str) -> str:
    """``maximum3`` -> ``maximum``: the BlockBuilder numbers a name it has seen."""
    return name.rstrip("0123456789")


def _single_store(stmt):
    """The one ``BufferStore`` of a loop nest around one block (what ``emit_te`` of an
    elementwise or injective ``topi`` op writes), or None."""
    while not isinstance(stmt, tirx.BufferStore):
        if isinstance(stmt, tvm.s_tir.SBlockRealize):
            stmt = stmt.block
        elif isinstance(stmt, (tirx.For, tvm.s_tir.SBlock)):
            stmt = stmt.body
        else:
            return None
    return stmt


def _offset(index):
    """``v`` -> 0, ``v - c`` -> c, the same inside a clamp; a constant (a clamped axis of
    size 1) -> 0; else None. A wrong guess fails ``_computes``: it is only a guess."""
    while isinstance(index, (tirx.Max, tirx.Min)):
        index = index.b if isinstance(index.a, tirx.IntImm) else index.a
    if isinstance(index, (tirx.Var, tirx.IntImm)):
        return 0
    if isinstance(index, tirx.Sub) and isinstance(index.b, tirx.IntImm):
        return int(index.b.value)
    return None


def _static_shape(ty):
    if not isinstance(ty, relax.TensorType) or ty.shape is None:
        return None
    values = getattr(ty.shape, "values", None)
    if values is None or not all(isinstance(v, tirx.IntImm) for v in values):
        return None
    return tuple(int(v) for v in values)


def _scalar(expr):
    """The Python value of a one-element constant, or None."""
    if not isinstance(expr, tvm.ir.expr.GenericConst):
        return None
    value = expr.value.numpy()
    return value.item() if value.size == 1 else None


def _use_counts(func) -> dict:
    """Var -> how many times ``func``'s body reads it (binding definitions not counted)."""
    counts: dict = {}

    def visit(e):
        if isinstance(e, relax.Var):
            counts[e] = counts.get(e, 0) + 1

    relax.analysis.post_order_visit(func.body, visit)
    return counts


def _calls_tir(func) -> bool:
    found = []
    relax.analysis.post_order_visit(
        func.body, lambda e: found.append(e) if isinstance(e, relax.Call)
        and e.op.same_as(_CALL_TIR) else None)
    return bool(found)
