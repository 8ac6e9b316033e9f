"""cudnn backend: a matched conv2d / conv3d group on cuDNN, bias, residual and relu fused.

The binding is the cuDNN that PyTorch's CUDA build carries, called through its cuDNN entry
points (``F.conv2d`` may pick a non-cuDNN kernel, so it is not used):

* conv2d + bias + relu: ``torch.cudnn_convolution_relu`` (one fused cuDNN kernel);
* conv2d + residual (+ bias) + relu: ``torch.cudnn_convolution_add_relu`` (one kernel:
  ``relu(conv(x) + z + bias)``);
* anything else (no relu, conv3d): ``torch.cudnn_convolution`` (cuDNN picks its algorithm,
  ``benchmark=True``), then the bias, residual and relu in place on its output.

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

_ENTRY_POINTS = ("cudnn_convolution", "cudnn_convolution_relu", "cudnn_convolution_add_relu")


class CudnnLowering(Lowering):
    """Lowers one candidate subgraph (a standalone Relax function) to a cuDNN callable."""

    name = "cudnn"

    def available(self) -> tuple[bool, str]:
        ok, why = torch_cuda()
        if not ok:
            return False, why
        import torch

        try:
            if not torch.backends.cudnn.is_available():
                return False, f"torch {torch.__version__} has no cuDNN"
            for op in _ENTRY_POINTS:
                if not callable(getattr(torch, op, None)):
                    return False, f"torch {torch.__version__} lacks the cuDNN entry point torch.{op}"
        except Exception as err:  # noqa: BLE001 - available() never raises
            return False, f"{type(err).__name__}: {err}"
        return True, ""

    def version(self) -> str:
        try:
            import torch

            return f"cudnn-{torch.backends.cudnn.version()}+torch-{torch_version()}"
        except Exception:  # noqa: BLE001
            return "cudnn-unavailable"

    def lower(self, func) -> Callable:
        """``fn(*tvm_tensors) -> tvm tensor`` on the GPU; ``NotImplementedError`` for anything
        but one conv2d/conv3d (NCHW/NCDHW, constant weight) with bias / residual / relu."""
        plan = analyse(func, "cudnn")
        if plan.anchor == "relax.matmul":
            raise NotImplementedError("cudnn: matmul is not supported (the cublas backend runs it)")
        if plan.unary not in (None, ("relu", "")):
            raise NotImplementedError(f"cudnn: the activation {plan.unary[0]} is not supported "
                                      "(relu only)")
        return build(plan)


def build(plan: Plan) -> Callable:
    """The per-call function of a convolution plan; constants moved to the GPU once."""
    import torch

    f32_parity()
    torch.backends.cudnn.benchmark = True
    weight, bias = to_device(plan.weight), to_device(plan.bias)
    const_residual = to_device(plan.residual) if isinstance(plan.residual, np.ndarray) else None
    stride, padding, dilation = list(plan.stride), list(plan.padding), list(plan.dilation)
    groups, relu = plan.groups, plan.unary is not None
    channel_view = None if bias is None else bias.view(1, -1, *([1] * (len(plan.out_shape) - 2)))
    conv2d = plan.anchor == "relax.nn.conv2d"
    res_i = plan.residual if isinstance(plan.residual, int) else None
    to_torch, from_torch, check = device_io(plan.nparams, "cudnn")

    def kernel(x, r):
        if conv2d and relu and r is None:
            return torch.cudnn_convolution_relu(x, weight, bias, stride, padding, dilation, groups)
        if conv2d and relu:
            return torch.cudnn_convolution_add_relu(x, weight, r, 1.0, bias, stride, padding,
                                                    dilation, groups)
        y = torch.cudnn_convolution(x, weight, padding, stride, dilation, groups,
                                    True, False, False)  # benchmark, deterministic, allow_tf32
        if channel_view is not None:
            y.add_(channel_view)
        if r is not None:
            y.add_(r)
        return y.relu_() if relu else y

    def run(*args):
        check(args)
        with torch.inference_mode():
            r = const_residual if res_i is None else to_torch(args[res_i])
            y = kernel(to_torch(args[plan.data]), r)
        return from_torch(y.contiguous())

    run.__name__ = f"cudnn_{plan.anchor.rsplit('.', 1)[-1]}"
    run.plan = plan
    return run
