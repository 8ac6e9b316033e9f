"""Relax passes applying the proved substitutions (``substitutions.py``)."""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

_AFFINE = {"relax.add", "relax.subtract", "relax.multiply", "relax.divide"}


def fold_conv_affine(mod: tvm.IRModule) -> tvm.IRModule:
    """Substitution ``fold_conv_affine``: in ``main``, a ``conv2d`` (NCHW/OIHW, constant
    weight) whose only user starts a chain of per-channel adds, subtracts, multiplies and
    divides by constants (each link the only user of the one before) becomes the
    convolution with each output channel's kernel scaled, plus one bias add. A chain of a
    single add (already conv + bias) is left as it is."""
    main = mod["main"]
    if not isinstance(main.body, relax.SeqExpr):
        return mod
    uses = _uses(main)
    blocks, changed = [], False  # blocks: each block's new bindings
    for block in main.body.blocks:
        bindings = list(block.bindings)
        by_input = {}
        for i, b in enumerate(bindings):
            if isinstance(b, relax.VarBinding) and isinstance(b.value, relax.Call):
                for arg in b.value.args:
                    if isinstance(arg, relax.Var):
                        by_input.setdefault(arg, []).append(i)
        drop, replace = set(), {}
        for i, b in enumerate(bindings):
            conv = _conv_with_constant_weight(b)
            if conv is None:
                continue
            channels = int(b.var.ty.shape.values[1])
            scale, shift = np.ones(channels), np.zeros(channels)
            chain, cur = [], b.var
            while uses.get(cur, 0) == 1 and len(by_input.get(cur, ())) == 1:
                j = by_input[cur][0]
                step = _affine_step(bindings[j], cur, channels)
                if step is None:
                    break
                op, c = step
                if op == "add":
                    shift = shift + c
                elif op == "subtract":
                    shift = shift - c
                elif op == "multiply":
                    scale, shift = scale * c, shift * c
                else:  # divide
                    scale, shift = scale / c, shift / c
                chain.append(j)
                cur = bindings[j].var
            if not chain or (len(chain) == 1 and _op_name(bindings[chain[0]]) == "relax.add"):
                continue
            weight = conv.args[1].value.numpy()
            new_weight = (weight * scale.reshape(-1, 1, 1, 1)).astype(weight.dtype)
            replace[i] = relax.VarBinding(b.var, relax.Call(
                conv.op, [conv.args[0], relax.const(new_weight)], conv.attrs))
            bias = relax.const(shift.reshape(1, -1, 1, 1).astype(weight.dtype))
            replace[chain[-1]] = relax.VarBinding(cur, relax.op.add(b.var, bias))
            drop.update(chain[:-1])
            changed = True
        blocks.append([replace.get(i, bnd) for i, bnd in enumerate(bindings) if i not in drop])
    if not changed:
        return mod
    return relax.transform.Normalize()(_with_blocks(mod, blocks))


def _op_name(binding) -> str | None:
    value = getattr(binding, "value", None)
    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
        return value.op.name
    return None


def _conv_with_constant_weight(binding):
    if _op_name(binding) != "relax.nn.conv2d":
        return None
    call = binding.value
    attrs = call.attrs
    if not isinstance(call.args[1], tvm.ir.expr.GenericConst):
        return None
    if (attrs.data_layout, attrs.kernel_layout) != ("NCHW", "OIHW") or \
            attrs.out_layout not in ("NCHW", ""):
        return None
    ty = binding.var.ty
    if not isinstance(ty, relax.TensorType) or str(ty.dtype) != "float32" or \
            not isinstance(ty.shape, relax.ShapeExpr) or len(ty.shape.values) != 4:
        return None
    return call


def _affine_step(binding, cur, channels: int):
    """(op, per-channel vector) when ``binding`` is ``cur <op> constant`` (or ``constant +/*
    cur``) with a constant that varies along the channels only; else None."""
    name = _op_name(binding)
    if name not in _AFFINE:
        return None
    lhs, rhs = binding.value.args
    if lhs.same_as(cur) and isinstance(rhs, tvm.ir.expr.GenericConst):
        const = rhs
    elif rhs.same_as(cur) and isinstance(lhs, tvm.ir.expr.GenericConst) and \
            name in ("relax.add", "relax.multiply"):
        const = lhs
    else:
        return None
    if binding.var.ty.shape is None or \
            [int(d) for d in binding.var.ty.shape.values] != [int(d) for d in cur.ty.shape.values]:
        return None  # the constant broadcasts the result to another shape
    vec = _per_channel(const.value.numpy(), channels)
    if vec is None or (name == "relax.divide" and not np.all(vec != 0)):
        return None
    return name.split(".")[1], vec


def _per_channel(c: np.ndarray, channels: int):
    if c.dtype != np.float32 or c.ndim > 4:
        return None
    shape = (1,) * (4 - c.ndim) + c.shape
    if shape[0] != 1 or shape[2] != 1 or shape[3] != 1 or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(c.reshape(-1).astype(np.float64), (channels,))


def _uses(func) -> dict:
    """How many times each var is used in ``func`` (bindings and the function's result)."""
    counts: dict = {}

    def visit(e):
        if isinstance(e, relax.Var):
            counts[e] = counts.get(e, 0) + 1

    for block in func.body.blocks:
        for b in block.bindings:
            relax.analysis.post_order_visit(b.value, visit)
    relax.analysis.post_order_visit(func.body.body, visit)
    return counts


# --------------------------------------------------------------------------- sibling convs

def sibling_conv_sites(mod: tvm.IRModule) -> list:
    """Sites of ``merge_sibling_convs`` in ``main``'s dataflow block: pairs (i, j) of
    binding indices of two ``conv2d`` with one input, constant weights of one input-channel
    count and kernel size, and the same strides, padding, dilation, groups = 1 and layouts
    (consecutive members of each such family)."""
    def family(b):
        conv = _conv_with_constant_weight(b)
        if conv is None or int(conv.attrs.groups) != 1:
            return None
        a = conv.attrs
        return (conv.args[0], tuple(int(v) for v in a.strides), tuple(int(v) for v in a.padding),
                tuple(int(v) for v in a.dilation), conv.args[1].value.shape[1:],
                str(a.out_dtype))

    return _sibling_pairs(mod, family)


def _sibling_pairs(mod: tvm.IRModule, family) -> list:
    """Pairs (i, j) of binding indices of ``main``'s dataflow block with one ``family(binding)``
    (None: in none), consecutive members of each family."""
    bindings = _single_block(mod)
    if bindings is None:
        return []
    families: dict = {}
    for i, b in enumerate(bindings):
        key = family(b)
        if key is not None:
            families.setdefault(key, []).append(i)
    return [(f[k], f[k + 1]) for f in families.values() for k in range(len(f) - 1)]


def merge_sibling_convs(mod: tvm.IRModule, site: tuple) -> tvm.IRModule:
    """Substitution ``merge_sibling_convs`` at ``site`` (from ``sibling_conv_sites``): one
    convolution over the two kernels stacked, split along the channels; the two results
    keep their vars (bound to the split's parts)."""
    bindings = list(_single_block(mod))
    first, second = bindings[site[0]].value, bindings[site[1]].value
    w1, w2 = first.args[1].value.numpy(), second.args[1].value.numpy()
    merged_call = relax.Call(first.op, [first.args[0], relax.const(np.concatenate([w1, w2]))],
                             first.attrs)
    return _merge_siblings(mod, site, merged_call, "merged_conv", w1.shape[0], 1)


def _merge_siblings(mod, site: tuple, merged_call, name: str, first_size: int,
                    axis: int) -> tvm.IRModule:
    """The bindings ``site`` = (i, j) of ``main``'s block replaced by ``merged_call``
    (bound before i), its split at ``first_size`` along ``axis``, and the two original vars
    bound to the split's parts."""
    bindings = list(_single_block(mod))
    i, j = site
    bb = relax.BlockBuilder()
    with bb.function("scratch", []):  # a scope to infer the new bindings' types in
        with bb.dataflow():
            merged = relax.DataflowVar(name, bb.normalize(merged_call).ty)
            split_call = relax.op.split(merged, [first_size], axis=axis)
            parts = relax.DataflowVar("merged_parts", bb.normalize(split_call).ty)
            bb.emit_output(relax.const(0.0))
        bb.emit_func_output(relax.const(0.0))
    new = (bindings[:i]
           + [relax.VarBinding(merged, merged_call), relax.VarBinding(parts, split_call),
              relax.VarBinding(bindings[i].var, relax.TupleGetItem(parts, 0))]
           + bindings[i + 1:j]
           + [relax.VarBinding(bindings[j].var, relax.TupleGetItem(parts, 1))]
           + bindings[j + 1:])
    return _with_blocks(mod, [new])


def fold_conv_affine_sites(mod: tvm.IRModule) -> list:
    """``fold_conv_affine`` as one site (it folds every chain at once: each fold only removes
    work, so there is nothing to choose)."""
    return [None] if fold_conv_affine(mod) is not mod else []


def _single_block(mod):
    main = mod["main"]
    if not isinstance(main.body, relax.SeqExpr) or len(main.body.blocks) != 1:
        return None
    return list(main.body.blocks[0].bindings)


def _with_blocks(mod, blocks: list) -> tvm.IRModule:
    """``mod`` with ``main``'s binding blocks given new bindings (one list per block, each
    block keeping its kind)."""
    main = mod["main"]
    new_blocks = [relax.DataflowBlock(b) if isinstance(old, relax.DataflowBlock)
                  else relax.BindingBlock(b) for old, b in zip(main.body.blocks, blocks)]
    func = relax.Function(main.params, relax.SeqExpr(new_blocks, main.body.body), main.ret_ty,
                          main.is_pure, main.attrs)
    return tvm.IRModule({gv: (func if gv.name_hint == "main" else f)
                         for gv, f in mod.functions.items()}, attrs=mod.attrs)


# --------------------------------------------------------------------------- conv of a concat

def concat_conv_sites(mod: tvm.IRModule) -> list:
    """Sites of ``split_conv_over_concat`` in ``main``'s dataflow block: indices of the
    ``conv2d`` bindings (constant weight, groups = 1, NCHW) whose input is a channel
    ``concat`` of two or more tensors bound in the same block."""
    bindings = _single_block(mod)
    if bindings is None:
        return []
    bound = {b.var: b for b in bindings}
    sites = []
    for i, b in enumerate(bindings):
        conv = _conv_with_constant_weight(b)
        if conv is None or int(conv.attrs.groups) != 1:
            continue
        src = bound.get(conv.args[0])
        if _concat_parts(src) is not None:
            sites.append(i)
    return sites


def _concat_parts(binding) -> list | None:
    """The parts of a channel (axis 1 of 4) ``concat`` binding with static channel counts."""
    if binding is None or _op_name(binding) != "relax.concat":
        return None
    call = binding.value
    parts = call.args[0]
    if not isinstance(parts, relax.Tuple) or len(parts.fields) < 2 or \
            int(call.attrs.axis) not in (1, -3):
        return None
    for p in parts.fields:
        shape = getattr(getattr(p, "ty", None), "shape", None)
        if not isinstance(shape, relax.ShapeExpr) or len(shape.values) != 4 or \
                not isinstance(shape.values[1], tvm.tirx.IntImm):
            return None
    return list(parts.fields)


def split_conv_over_concat(mod: tvm.IRModule, site: int) -> tvm.IRModule:
    """Substitution ``split_conv_over_concat`` at ``site`` (from ``concat_conv_sites``): the
    convolution of a channel concat becomes the sum of one convolution per part, each over
    the kernel's input channels of that part; the concat goes when nothing else uses it."""
    bindings = list(_single_block(mod))
    conv_binding = bindings[site]
    conv = conv_binding.value
    concat_var = conv.args[0]
    parts = _concat_parts(next(b for b in bindings if b.var.same_as(concat_var)))
    weight = conv.args[1].value.numpy()
    new, lo = [], 0
    bb = relax.BlockBuilder()
    with bb.function("scratch", []):  # a scope to infer the new bindings' types in
        with bb.dataflow():
            total = None
            for k, part in enumerate(parts):
                c = int(part.ty.shape.values[1])
                call = relax.Call(conv.op, [part, relax.const(np.ascontiguousarray(
                    weight[:, lo:lo + c]))], conv.attrs)
                lo += c
                var = relax.DataflowVar(f"conv_part{k}", bb.normalize(call).ty)
                new.append(relax.VarBinding(var, call))
                if total is not None:
                    call = relax.op.add(total, var)
                    total = relax.DataflowVar(f"conv_sum{k}", bb.normalize(call).ty)
                    new.append(relax.VarBinding(total, call))
                else:
                    total = var
            bb.emit_output(relax.const(0.0))
        bb.emit_func_output(relax.const(0.0))
    # the result keeps the convolution's var
    last = new.pop()
    new.append(relax.VarBinding(conv_binding.var, last.value))
    still_used = _uses(mod["main"]).get(concat_var, 0) > 1
    out = []
    for i, b in enumerate(bindings):
        if i == site:
            out += new
        elif not (b.var.same_as(concat_var) and not still_used):
            out.append(b)
    return _with_blocks(mod, [out])


# --------------------------------------------------------------------------- sibling matmuls

def _matmul_with_constant_weight(binding):
    """The ``matmul(x, W)`` call of ``binding`` with ``W`` a 2-D float32 constant, else None."""
    if _op_name(binding) != "relax.matmul":
        return None
    call = binding.value
    if not isinstance(call.args[1], tvm.ir.expr.GenericConst) or \
            len(call.args[1].value.shape) != 2 or str(call.args[1].value.dtype) != "float32":
        return None
    ty = binding.var.ty
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return call


def sibling_matmul_sites(mod: tvm.IRModule) -> list:
    """Sites of ``merge_sibling_matmuls`` in ``main``'s dataflow block: pairs (i, j) of
    binding indices of two ``matmul`` of one input by constant 2-D weights of one row count
    (consecutive members of each family: a transformer's Q, K and V projections)."""
    def family(b):
        mm = _matmul_with_constant_weight(b)
        return None if mm is None else (mm.args[0], int(mm.args[1].value.shape[0]),
                                        str(mm.attrs.out_dtype))

    return _sibling_pairs(mod, family)


def merge_sibling_matmuls(mod: tvm.IRModule, site: tuple) -> tvm.IRModule:
    """Substitution ``merge_sibling_matmuls`` at ``site`` (from ``sibling_matmul_sites``):
    one matmul by the two weights side by side, split along the last axis; the two results
    keep their vars (bound to the split's parts)."""
    bindings = list(_single_block(mod))
    first, second = bindings[site[0]].value, bindings[site[1]].value
    w1, w2 = first.args[1].value.numpy(), second.args[1].value.numpy()
    merged_call = relax.Call(first.op, [first.args[0],
                                        relax.const(np.concatenate([w1, w2], axis=1))],
                             first.attrs)
    return _merge_siblings(mod, site, merged_call, "merged_matmul", w1.shape[1], -1)
