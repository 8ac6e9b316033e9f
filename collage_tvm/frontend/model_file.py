"""The model as the user gave it, as an ONNX file: what they would run without Collage.

The final check times it whole on each graph library (docs/DESIGN.md, "The final check"): the
user's own ONNX file, or a torch module's own ONNX export (``torch.onnx.export``, opset 17,
as a PyTorch user exports for ONNX Runtime or OpenVINO). Collage's own placements start from
TVM's import of the model, which can differ from the file (operators decomposed, written as
TVM kernels): the file run whole is the floor a shipped build must not fall below.
"""
from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import dataclass


# onnxruntime 1.31 reads IR versions up to 13; onnx 1.23 writes 14 (docs/DESIGN.md,
# platform facts)
MAX_IR_VERSION = 10


@dataclass
class ModelFile:
    """Where the user's model is as ONNX: a ``path``, a ``proto``, or a torch module to
    export on first use (``torch_module``, ``inputs``); none of them: there is no file, and
    ``why`` says why."""

    path: str | None = None
    proto: object = None
    why: str = ""
    torch_module: object = None
    inputs: tuple = ()
    _dir: str | None = None  # the temporary folder of our export of a torch module

    def load(self):
        """The ONNX ``ModelProto``: read from ``path`` on each call (not kept in memory
        during the search); a torch module is exported on the first call (raises what the
        exporter raised)."""
        if self.proto is not None:
            return self.proto
        if self.path is None and self.torch_module is not None:
            self._dir = tempfile.mkdtemp(prefix="collage-model-file-")
            self.path = export_torch(self.torch_module, self.inputs,
                                     os.path.join(self._dir, "model.onnx"))
        import onnx

        return onnx.load(self.path)

    def __bool__(self) -> bool:
        return self.path is not None or self.proto is not None or self.torch_module is not None

    def close(self) -> None:
        """Remove our export of a torch module (a library holds what it loaded)."""
        if self._dir:
            import shutil

            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = self.path = None


def model_file(model, example_inputs=None) -> ModelFile:
    """The ``ModelFile`` of ``model`` (as ``load_model`` takes it): an ONNX path or proto as
    given; a torch module, exported to ONNX on first use into a temporary folder (``close``
    removes it); none for a Relax module (the user has no file of it)."""
    if isinstance(model, (str, os.PathLike)):
        return ModelFile(path=os.fspath(model))
    if type(model).__name__ == "ModelProto":
        return ModelFile(proto=model)
    if type(model).__name__ == "IRModule":
        return ModelFile(why="a Relax module: no model file to run on a graph library")
    if example_inputs is None or not hasattr(model, "state_dict"):
        return ModelFile(why="not an ONNX model or a torch module with example inputs")
    import torch

    inputs = tuple(example_inputs) if isinstance(example_inputs, (list, tuple)) else (
        example_inputs,)
    return ModelFile(torch_module=model, inputs=tuple(torch.as_tensor(x) for x in inputs))


def export_torch(model, inputs: tuple, path: str, **export_args) -> str:
    """``model`` exported as a PyTorch user exports it for a graph library (TorchScript
    exporter, opset 17; ``export_args``: more of ``torch.onnx.export``'s, e.g. input names),
    at an IR version onnxruntime reads."""
    import torch

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), inputs, path, dynamo=False, opset_version=17,
                          **export_args)
    return cap_ir_version(path)


def cap_ir_version(path: str) -> str:
    """The ONNX file at ``path`` rewritten at IR version ``MAX_IR_VERSION`` where it is
    newer (external data stays where it is); returns ``path``."""
    import onnx

    proto = onnx.load(path, load_external_data=False)
    if proto.ir_version > MAX_IR_VERSION:
        proto.ir_version = MAX_IR_VERSION
        onnx.save(proto, path)
    return path
