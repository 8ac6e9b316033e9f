"""Helpers the built-in lowerings share: shape checks, a subgraph's op calls, probes."""
from __future__ import annotations


def gemm_probe():
    """A 1x1 GEMM (``x @ ones((1, 1))``): the switching-cost probe of a GEMM library (dnnl,
    mkl), whose smallest kernel is an inner product, not the measurer's default ``add``."""
    import numpy as np
    from tvm import relax

    from collage_tvm.graph.subgraph import one_op_function

    w = relax.const(np.ones((1, 1), "float32"))
    return one_op_function((1, 1), lambda x: relax.op.matmul(x, w))


def static_float32_shape(expr, what: str, unsupported) -> tuple:
    """The static shape of a float32 tensor ``expr``; else raises ``unsupported(reason)``."""
    import tvm

    ty = expr.ty
    values = getattr(ty.shape, "values", None) if isinstance(ty, tvm.relax.TensorType) else None
    if values is None:
        raise unsupported(f"{what} without a known static shape")
    if ty.dtype != "float32":
        raise unsupported(f"{what} of dtype {ty.dtype} (float32 only)")
    dims = []
    for d in values:
        if not isinstance(d, (int, tvm.tirx.IntImm)):
            raise unsupported(f"{what} with the dynamic shape {ty.shape}")
        dims.append(int(d))
    return tuple(dims)


def op_calls(body, unsupported) -> list:
    """[(var, call, op name)] of a subgraph body: only ``var = op(...)`` bindings are accepted;
    anything else raises ``unsupported(reason)``."""
    import tvm
    from tvm import relax

    out = []
    for block in body.blocks:
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                raise unsupported(f"a {type(binding).__name__} binding")
            value = binding.value
            if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
                raise unsupported(f"the expression {value}")
            out.append((binding.var, value, value.op.name))
    return out
