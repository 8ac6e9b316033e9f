"""Pattern table for the mkl backend: Intel MKL GEMM / batched GEMM with a fused bias.

MKL's ``cblas_sgemm`` computes ``C = alpha * op(A) @ op(B) + beta * C``; with the bias
preloaded into C and ``beta = 1`` a matmul + bias add is one call, and
``cblas_sgemm_batch_strided`` runs a batch of equal-shaped GEMMs. ``op(B)`` may be
``B^T`` for free, so a rhs that is ``permute_dims`` swapping the last two axes (attention's
``Q @ K^T``, the frontends' ``x @ W^T`` for nn.Linear) is read in place, never copied.

Entries (each with and without ``_bias``):

* ``mkl.dense``: ``x @ W`` with a constant W, or ``x @ permute_dims(W)`` (nn.Linear as the
  torch / ONNX frontends write it);
* ``mkl.matmul``: ``a @ b`` with a run-time rhs;
* ``mkl.matmul_transb``: ``a @ permute_dims(b)`` with a run-time b, also in the form
  ``torch.matmul`` exports for >= 3-D tensors: ``reshape(broadcast_to(permute_dims(b)))``
  where the broadcast changes nothing and the reshape only merges batch dimensions.

Offered: float32, static shapes, rank 2..4 operands, batch dimensions that are equal or
where one side has none (all 1: a weight shared by the batch); the bias is a constant
broadcast over the last dimension. The lowering is ``__init__.py`` beside it.
"""
import tvm
from tvm.relax.dpl import is_const, is_op, wildcard

from collage_tvm.registry import add_backend_pattern, register_backend

register_backend("mkl", kind="op", device="cpu", lowering="collage_tvm.backends.mkl:MklLowering")


def _static_f32(expr, ranks=None):
    """The static shape of a float32 tensor (list of ints), or None."""
    ty = expr.ty
    if not isinstance(ty, tvm.relax.TensorType) or ty.dtype != "float32":
        return None
    dims = getattr(ty.shape, "values", None)  # None: unknown rank or a symbolic shape var
    if dims is None or not all(isinstance(d, (int, tvm.tirx.IntImm)) for d in dims):
        return None
    dims = [int(d) for d in dims]
    return dims if ranks is None or len(dims) in ranks else None


def _swaps_last_two(call, ndim):
    axes = call.attrs.axes
    axes = list(range(ndim))[::-1] if axes is None else [int(a) % ndim for a in axes]
    return axes == list(range(ndim - 2)) + [ndim - 1, ndim - 2]


def _batch_ok(lhs, rhs):
    """Batch dims equal, or one side has none (all 1): one strided batched GEMM runs it."""
    lb, rb = lhs[:-2], rhs[:-2]
    n = max(len(lb), len(rb))
    lb, rb = [1] * (n - len(lb)) + lb, [1] * (n - len(rb)) + rb
    return lb == rb or all(d == 1 for d in lb) or all(d == 1 for d in rb)


def _bias_ok(ctx, out):
    if "bias" not in ctx.annotated_expr:
        return True
    bias = _static_f32(ctx.annotated_expr["bias"])
    return bias is not None and 1 <= len(bias) <= len(out) and bias[-1] == out[-1] \
        and all(d == 1 for d in bias[:-1])


def _check(ctx):
    ann = ctx.annotated_expr
    mm = ann["root"]
    if str(mm.attrs.out_dtype or "float32") not in ("float32", "void"):
        return False
    lhs_expr, rhs_expr = mm.args
    if isinstance(lhs_expr, tvm.ir.Constant):
        return False  # a constant lhs: nothing to offload (constant folding's job)
    lhs, rhs, out = (_static_f32(lhs_expr, (2, 3, 4)), _static_f32(rhs_expr, (2, 3, 4)),
                     _static_f32(mm, (2, 3, 4)))
    if lhs is None or rhs is None or out is None or lhs[-1] != rhs[-2] or not _batch_ok(lhs, rhs):
        return False
    if 0 in lhs or 0 in rhs:
        return False  # empty GEMMs: MKL rejects a leading dimension of 0
    if "src" in ann:  # transB: the permute must swap the last two axes, nothing else
        perm = ann["perm"]
        src = _static_f32(ann["src"], (2, 3, 4))
        if src is None or not _swaps_last_two(perm, len(src)):
            return False
        pshape = _static_f32(perm)
        if "bcast" in ann and _static_f32(ann["bcast"]) != pshape:
            return False  # a real broadcast would need copies
        if ("reshape" in ann or "reshape_only" in ann) and rhs[-2:] != pshape[-2:]:
            return False  # the reshape may only merge batch dims
    elif "rhs" in ann and isinstance(ann["rhs"], tvm.ir.Constant):
        return False  # a constant rhs is mkl.dense's (a permuted constant is folded by the lowering)
    return _bias_ok(ctx, out)


def _make_pattern(rhs_kind, bias):
    """``matmul(data, rhs) [+ bias]`` and its annotations; ``root`` is the matmul."""
    data = wildcard()
    annotations = {"data": data}
    if rhs_kind == "dense":
        weight = is_const()
        perm = is_op("relax.permute_dims")(weight)
        rhs = weight | perm
        annotations.update(weight=weight, perm=perm)
    elif rhs_kind == "matmul":
        rhs = wildcard()
        annotations["rhs"] = rhs
    else:  # matmul_transb
        src = wildcard()
        perm = is_op("relax.permute_dims")(src)
        bcast = is_op("relax.broadcast_to")(perm, wildcard())
        reshape = is_op("relax.reshape")(bcast, wildcard())
        reshape_only = is_op("relax.reshape")(perm, wildcard())
        rhs = perm | reshape | reshape_only
        annotations.update(src=src, perm=perm, bcast=bcast, reshape=reshape, reshape_only=reshape_only)
    root = is_op("relax.matmul")(data, rhs)
    annotations["root"] = root
    out = root
    if bias:
        annotations["bias"] = b = is_const()
        out = is_op("relax.add")(root, b) | is_op("relax.add")(b, root)
    return out, annotations


# mkl_bf16: the same GEMMs with bf16 A and B (cblas_gemm_bf16bf16f32), f32 out; used only
# under an accuracy budget that allows bf16 (--accuracy bf16), where the CPU has bf16.
register_backend("mkl_bf16", kind="op", device="cpu", precision="bf16", variant_of="mkl",
                 lowering="collage_tvm.backends.mkl:MklBf16Lowering")

for _backend in ("mkl", "mkl_bf16"):
    for _kind in ("dense", "matmul", "matmul_transb"):
        for _bias in (False, True):
            _pattern, _annotations = _make_pattern(_kind, _bias)
            add_backend_pattern(_backend, _pattern, check=_check,
                                name=f"{_backend}.{_kind}{'_bias' if _bias else ''}",
                                annotations=_annotations)
