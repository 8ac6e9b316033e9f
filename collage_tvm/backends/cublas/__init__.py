"""cublas backend: a matched matmul group on cuBLAS / cuBLASLt, bias and activation fused.

The binding is the cuBLAS that PyTorch's CUDA build carries:

* ``x @ W`` with a constant weight, + bias + relu / gelu (tanh): ``torch._addmm_activation``
  (cuBLASLt with the bias-and-activation epilogue: one kernel); + bias alone:
  ``torch.addmm``; no bias: ``torch.mm``. An N-D ``x`` is its 2-D view (rows x K);
* a matmul of two run-time tensors, 2-D or batched (one batch shape): ``torch.matmul``
  (cuBLAS GEMM / strided batched GEMM), the bias and activation in place after it;
* a residual add runs in place on the GEMM's output.

Tensors stay on the GPU: DLPack in and out, no copies (backends/_cuda.py).

This module is the backend's lowering; ``patterns.py`` beside it is its pattern file.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from collage_tvm.backends._cuda import (device_io, f32_parity, to_device, torch_cuda,
                                        torch_version)
from collage_tvm.backends._epilogue import Plan, analyse
from collage_tvm.lowering import Lowering

_ACTIVATIONS = {None: None, ("relu", ""): "relu", ("gelu", "tanh"): "gelu_tanh"}


class CublasLowering(Lowering):
    """Lowers one candidate subgraph (a standalone Relax function) to a cuBLAS callable."""

    name = "cublas"

    def available(self) -> tuple[bool, str]:
        ok, why = torch_cuda()
        if not ok:
            return False, why
        import torch

        if not callable(getattr(torch, "_addmm_activation", None)):
            return False, (f"torch {torch.__version__} lacks the cuBLASLt epilogue entry point "
                           "torch._addmm_activation")
        return True, ""

    def version(self) -> str:
        try:
            import torch

            return f"cublas-cuda{torch.version.cuda}+torch-{torch_version()}"
        except Exception:  # noqa: BLE001
            return "cublas-unavailable"

    def lower(self, func) -> Callable:
        """``fn(*tvm_tensors) -> tvm tensor`` on the GPU; ``NotImplementedError`` for anything
        but one matmul with bias / residual / relu / gelu (tanh)."""
        plan = analyse(func, "cublas", batched_matmul=True)
        if plan.anchor != "relax.matmul":
            raise NotImplementedError(f"cublas: {plan.anchor} is not supported (the cudnn "
                                      "backend runs convolutions)")
        if plan.unary not in _ACTIVATIONS:
            raise NotImplementedError(f"cublas: the activation {plan.unary} is not supported "
                                      "(relu and tanh-approximated gelu)")
        return build(plan)


def build(plan: Plan) -> Callable:
    """The per-call function of a matmul plan; constants moved to the GPU once."""
    import torch

    f32_parity()
    act = _ACTIVATIONS[plan.unary]
    bias = to_device(plan.bias)
    # the plan keeps a constant weight as (N, K), torch's linear layout: W is its transpose
    w_const = to_device(plan.weight).t() if isinstance(plan.weight, np.ndarray) else None
    const_residual = to_device(plan.residual) if isinstance(plan.residual, np.ndarray) else None
    res_i = plan.residual if isinstance(plan.residual, int) else None
    w_i = plan.weight if isinstance(plan.weight, int) else None
    out_shape = tuple(plan.out_shape)
    to_torch, from_torch, check = device_io(plan.nparams, "cublas")

    def gemm_plain(x, w):  # mm or a strided batched GEMM, the bias in place after it
        y = torch.matmul(x, w)
        return y if bias is None else y.add_(bias)

    def gemm(x, w):
        if w_i is not None:  # two run-time tensors
            y = gemm_plain(x, w)
            return y if act is None else _activate(y, act)
        x2 = x.reshape(-1, x.shape[-1])
        if bias is not None and act is not None:
            y = torch._addmm_activation(bias, x2, w, use_gelu=act == "gelu_tanh")
        elif bias is not None:
            y = torch.addmm(bias, x2, w)
        else:
            y = _activate(torch.mm(x2, w), act) if act else torch.mm(x2, w)
        return y.view(out_shape)

    def run(*args):
        check(args)
        with torch.inference_mode():
            x = to_torch(args[plan.data])
            w = w_const if w_i is None else to_torch(args[w_i])
            r = const_residual if res_i is None else to_torch(args[res_i])
            if r is None:
                y = gemm(x, w)
            else:  # the residual before the activation: GEMM (+ bias), add, activate
                y = gemm_plain(x, w).add_(r)
                y = y if act is None else _activate(y, act)
        return from_torch(y.contiguous())

    run.__name__ = "cublas_matmul"
    run.plan = plan
    return run


def _activate(y, act: str):
    import torch

    if act == "relu":
        return y.relu_()
    return torch.nn.functional.gelu(y, approximate="tanh")
