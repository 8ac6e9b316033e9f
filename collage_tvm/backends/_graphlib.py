"""What the graph-library backends (onnxruntime, openvino) share.

A graph library runs a whole subgraph at once: the subgraph is exported from Relax to
ONNX (``collage_tvm.export.onnx``), handed to the library, and the returned callable runs
it from the Relax VM. Tensors cross without copies in both directions: inputs are viewed
as numpy arrays over the TVM buffers (``np.from_dlpack``) and the library writes its
outputs straight into buffers TVM then owns (allocated by torch, 64-byte aligned, handed
over with ``tvm.runtime.from_dlpack``; ``tvm.runtime.empty`` costs ~11 us a call here,
torch.empty + from_dlpack ~7 us).
"""
from __future__ import annotations

import functools

import numpy as np

from collage_tvm.lowering import Lowering
from collage_tvm.target import library_threads


def output_specs(func) -> list:
    """[(shape, dtype)] of the function's results, in order (a Tuple result = several)."""
    from tvm import relax

    ret = func.ret_ty
    tys = list(ret.fields) if isinstance(ret, relax.TupleType) else [ret]
    specs = []
    for ty in tys:
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            raise NotImplementedError(f"graph library: result type {ty} is not a static tensor")
        specs.append((tuple(int(s) for s in ty.shape), str(ty.dtype)))
    return specs


@functools.lru_cache(maxsize=None)
def _torch_dtype(dtype: str):
    import torch

    return getattr(torch, dtype)


def model_source(model):
    """``collage_tvm.export.onnx.model_source``: the bytes, or a path past 2 GiB."""
    from collage_tvm.export.onnx import model_source as source

    return source(model)


def new_output(shape: tuple, dtype: str):
    """(TVM tensor, numpy view of the same memory) for one result."""
    import torch
    import tvm

    t = torch.empty(shape, dtype=_torch_dtype(dtype))
    out = tvm.runtime.from_dlpack(t)
    return out, t.numpy()


def as_numpy(tensor) -> np.ndarray:
    """Zero-copy numpy view of a TVM tensor."""
    return np.from_dlpack(tensor)


def threads() -> int:
    """Threads a library may use: the cores this process may run on (as TVM uses), or a
    concurrent stage's share of them (``collage_tvm.target.thread_share``)."""
    return library_threads()


class GraphLibraryLowering(Lowering):
    """Base class: export to ONNX, compile with the library, return a zero-copy callable."""

    name = "graph"
    #: ``compile`` also takes an ``OnnxFile`` (collage_tvm.export.onnx): the library reads
    #: the file itself (a saved build loads without parsing its regions first)
    reads_files = False
    #: ``compile(..., shapes=)`` compiles a dynamic model file for one point's exact input
    #: shapes, and that can run it faster than the one session that serves every shape
    #: (``collage_tvm.dynamic``: a point's "fixed" contender)
    fixes_shapes = False

    def export(self, func):
        from collage_tvm.export.onnx import ExportError, export_function

        try:
            return export_function(func, name=f"collage_{self.name}")
        except ExportError as err:
            raise NotImplementedError(f"{self.name}: {err}") from err

    def lower(self, func):
        model = self.export(func)
        sole = bool(func.attrs is not None and func.attrs.get("collage.sole_group", False))
        return self.compile(model, output_specs(func), sole)

    def compile(self, model, specs, sole: bool = False):  # pragma: no cover - abstract
        """``sole``: the subgraph is the whole model (no other runtime runs in between)."""
        raise NotImplementedError


def single_or_tuple(outs: list):
    return outs[0] if len(outs) == 1 else tuple(outs)
