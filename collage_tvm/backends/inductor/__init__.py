"""inductor backend (kind ``graph``, device cuda): a Relax subgraph compiled by
``torch.compile`` (TorchInductor: Triton kernels on the GPU, fused across operators).

The GPU graph library that exists on our GPU machines (TensorRT cannot be installed there:
backends/tensorrt/). The subgraph travels the way it does to the other graph libraries:
exported from Relax to ONNX (``collage_tvm.export.onnx``, shape-checked on export), then
translated into a ``torch.fx`` module by onnx2torch's op table (weights become the
module's parameters, moved to the device once), which ``torch.compile`` compiles. Tensors
cross by DLPack on the device without copies; the outputs are torch's, handed to TVM.

The translation and the compiled module run on the CPU as well (``device = "cpu"``): the
tests check a subgraph's outputs there, without a GPU.

This module is the backend's lowering; ``patterns.py`` beside it is its pattern file.
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
        graph = make_fx(module, tracing_mode="real", _error_on_data_dependent_ops=False)(*examples)
    # onnx2torch's shape checks (Reshape's ``any(shape == 0)``, ``torch.Size(shape)``) leave
    # dead ``.item()`` reads of constants in the trace (``aten._local_scalar_dense``, 200 in
    # a 2-layer BERT). Each one is a graph break for TorchDynamo, which then analyses the
    # rest of the graph's code again at every break: BERT-base's whole encoder (over a
    # thousand of them) did not compile in 300 s on an H200. Their results are unused.
    graph.graph.eliminate_dead_code()
    graph.recompile()
    return graph


class InductorLowering(GraphLibraryLowering):
    name = "inductor"
    device = "cuda"
    build_cache = True  # inductor's FX graph and Triton caches, on disk
    #: ``torch.compile`` mode of a subgraph among other groups: the default (no CUDA graphs:
    #: torch's caching allocator would hand out memory a replayed graph still writes while
    #: TVM's kernels run in between, backends/_cuda.py).
    mode = "default"
    #: ... of the whole model on the GPU (the sole group: nothing else runs in the build):
    #: CUDA graphs, as ``torch.compile(mode="reduce-overhead")`` runs a model, one replay a
    #: call instead of a launch per kernel (at batch 1 the launches are most of the time).
    #: The outputs then live in the graph's memory pool, which the next replay overwrites:
    #: each call hands TVM copies of them.
    sole_mode = "reduce-overhead"

    def mode_for(self, sole: bool) -> str:
        """The ``torch.compile`` mode of a subgraph (``sole``: the whole model alone)."""
        return self.sole_mode if sole and self.device == "cuda" else self.mode

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
        mode = self.mode_for(sole)
        compiled = torch.compile(_aten_graph(module, model, self.device), mode=mode,
                                 dynamic=False)
        replayed = mode == "reduce-overhead"  # outputs in the CUDA graph's pool: copied out
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
            outs = [o.clone(memory_format=torch.contiguous_format) if replayed
                    else o.contiguous() for o in outs]
            return single_or_tuple([to_tvm(o) for o in outs])

        call.module = compiled  # keep the module (and its weights) alive with the callable
        call.captures_itself = replayed  # measure.cuda_graph: not inside another capture
        return call
