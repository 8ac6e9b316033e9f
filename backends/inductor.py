"""inductor backend (kind ``graph``, device cuda): a Relax subgraph compiled by
``torch.compile`` (TorchInductor: Triton kernels on the GPU, fused across operators).

The GPU graph library that exists on our GPU machines (TensorRT cannot be installed there:
backends/tensorrt.py). The subgraph travels the way it does to the other graph libraries:
exported from Relax to ONNX (``collage_tvm.export.onnx``, shape-checked on export), then
translated into a ``torch.fx`` module by onnx2torch's op table (weights become the
module's parameters, moved to the device once), which ``torch.compile`` compiles. Tensors
cross by DLPack on the device without copies; the outputs are torch's, handed to TVM.

The translation and the compiled module run on the CPU as well (``device = "cpu"``): the
tests check a subgraph's outputs there, without a GPU.
"""
from __future__ import annotations

import functools

from collage_tvm.backends._cuda import f32_parity, torch_cuda, torch_version
from collage_tvm.backends._graphlib import GraphLibraryLowering, single_or_tuple


@functools.lru_cache(maxsize=None)
def _onnx2torch():
    """onnx2torch's ``convert``; it imports torchvision (detection ops), which imports
    against a CPU torch only through ``collage_tvm._torchvision``."""
    from collage_tvm._torchvision import import_torchvision

    import_torchvision()
    from onnx2torch import convert

    return convert


def _aten_graph(module, model, device):
    """``module`` traced once on zeros of the subgraph's input shapes into a graph of aten
    operators. onnx2torch's modules compute from their shape inputs in Python
    (``torch.Size(shape_tensor)`` in Reshape), which TorchDynamo cannot trace; with real
    tensors those shapes are constants (every shape here is static) and the traced graph
    holds plain tensor operators, which ``torch.compile`` takes whole."""
    import onnx
    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    examples = []
    for value in model.graph.input:
        tt = value.type.tensor_type
        dtype = getattr(torch, onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name)
        examples.append(torch.zeros([d.dim_value for d in tt.shape.dim], dtype=dtype,
                                    device=device))
    with torch.no_grad():
        return make_fx(module, tracing_mode="real", _error_on_data_dependent_ops=False)(*examples)


class InductorLowering(GraphLibraryLowering):
    name = "inductor"
    device = "cuda"
    #: ``torch.compile`` mode: the default (no CUDA graphs: torch's caching allocator would
    #: hand out memory a replayed graph still writes, DESIGN.md / backends/_cuda.py).
    mode = "default"

    def available(self) -> tuple[bool, str]:
        if self.device == "cuda":
            ok, why = torch_cuda()
            if not ok:
                return False, why
        try:
            import torch

            if not callable(getattr(torch, "compile", None)):
                return False, f"torch {torch.__version__} has no torch.compile"
            _onnx2torch()
            from collage_tvm.export import onnx as _export  # noqa: F401
        except Exception as err:  # noqa: BLE001 - available() never raises
            return False, f"{type(err).__name__}: {err}"
        return True, ""

    def version(self) -> str:
        try:
            from importlib.metadata import version

            return f"inductor-torch-{torch_version()}+onnx2torch-{version('onnx2torch')}"
        except Exception:  # noqa: BLE001
            return "inductor-unavailable"

    def compile(self, model, specs, sole: bool = False):
        import torch
        import tvm

        if self.device == "cuda":
            f32_parity()
        try:
            module = _onnx2torch()(model)
        except Exception as err:  # an ONNX op onnx2torch has no converter for
            raise NotImplementedError(f"inductor: onnx2torch: {type(err).__name__}: "
                                      f"{str(err)[:300]}") from err
        module = module.to(self.device).eval()
        nin, nout = len(model.graph.input), len(specs)
        compiled = torch.compile(_aten_graph(module, model, self.device), mode=self.mode,
                                 dynamic=False)
        from_dlpack, to_tvm = torch.from_dlpack, tvm.runtime.from_dlpack

        def call(*args):
            if len(args) != nin:
                raise TypeError(f"inductor subgraph takes {nin} tensors, got {len(args)}")
            with torch.no_grad():
                outs = compiled(*[from_dlpack(a) for a in args])
            outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
            if len(outs) != nout:
                raise RuntimeError(f"inductor: the module returned {len(outs)} outputs, "
                                   f"the subgraph has {nout}")
            return single_or_tuple([to_tvm(o.contiguous()) for o in outs])

        call.module = compiled  # keep the module (and its weights) alive with the callable
        return call
