"""Pattern table for the cublas backend (device cuda): GEMMs with fused epilogues.

``x @ W`` with a constant weight (a dense layer) with bias and relu or tanh-approximated
gelu (cuBLASLt's bias+activation epilogue, one kernel), and a residual add; a matmul of
two run-time tensors, 2-D or batched with one batch shape (attention's QK^T and AV), with
bias and relu. The lowering is ``__init__.py`` beside it. Erf gelu is left to other backends
(cuBLASLt's GELU epilogue is the tanh approximation).
"""
import functools

from tvm.relax.dpl import wildcard

from collage_tvm.patterns.epilogue import (EPILOGUES, GELUS, check_dense, check_matmul,
                                           dense_weight, make_pattern)
from collage_tvm.registry import add_backend_pattern, register_backend

register_backend("cublas", kind="op", device="cuda",
                 lowering="collage_tvm.backends.cublas:CublasLowering")

_TANH = [g for g in GELUS if g[3] == "relax.nn.gelu_tanh"]
_TABLE = (
    [(f"cublas.dense{s}", *make_pattern("relax.matmul", dense_weight(), b, r, a), check_dense)
     for s, b, r, a in EPILOGUES + _TANH]
    + [(f"cublas.matmul{s}", *make_pattern("relax.matmul", wildcard(), b, r, a),
        functools.partial(check_matmul, batched=True))
       for s, b, r, a in EPILOGUES[:4] + _TANH]
)
for _name, _pattern, _annotations, _check in _TABLE:
    add_backend_pattern("cublas", _pattern, check=_check, name=_name, annotations=_annotations)
