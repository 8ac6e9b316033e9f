"""An exported model handed on: its bytes (or, past protobuf's 2 GiB, a temporary file with
external data) for a library to read, a model left on disk (``OnnxFile``), and the names of
its graph inputs and outputs.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass

def serialized(model) -> bytes | None:
    """``model``'s bytes, or None when protobuf cannot write them: one message holds at
    most 2 GiB (a model with more weights, e.g. ViT-H/14, needs external data)."""
    from google.protobuf.message import EncodeError

    try:
        return model.SerializeToString()
    except (EncodeError, ValueError):
        return None


@dataclass(frozen=True)
class OnnxFile:
    """An ONNX model left on disk (a saved build's region): a library reads it from
    ``path`` itself, without the model being parsed here first; ``inputs``: the names of
    its graph inputs, in order (what a caller's arguments bind to by position)."""

    path: str
    inputs: tuple


def graph_input_names(model) -> list:
    """The names of every graph input of ``model`` (a ``ModelProto`` or an ``OnnxFile``)."""
    if isinstance(model, OnnxFile):
        return list(model.inputs)
    return [i.name for i in model.graph.input]


@contextlib.contextmanager
def model_source(model):
    """What a library reads ``model`` from: an ``OnnxFile``'s path; its bytes, or, when they are over protobuf's
    2 GiB, the path of a temporary copy whose weights are in an external data file beside
    it (both libraries read those), removed after the block: read the model inside it.
    The weights then move out of ``model`` into the file (its initializers keep their
    names, shapes and types; their data is in the file)."""
    if isinstance(model, OnnxFile):
        yield model.path
        return
    data = serialized(model)
    if data is not None:
        yield data
        return
    import onnx

    with tempfile.TemporaryDirectory(prefix="collage-onnx-") as folder:
        path = os.path.join(folder, "model.onnx")
        onnx.save_model(model, path, save_as_external_data=True,
                        all_tensors_to_one_file=True, location="weights.bin")
        yield path


def input_names(model) -> list:
    """Names of the graph inputs of ``model`` (the function's parameters, in order)."""
    inits = {t.name for t in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in inits]


def output_names(model) -> list:
    """Names of the graph outputs of ``model`` (the function's results, in order)."""
    return [o.name for o in model.graph.output]
