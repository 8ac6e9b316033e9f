"""Models with dynamic dimensions: one build serves every shape of a range.

``shapes``: the ranges (``--shapes``, defaults read from the model); ``search``: Collage's
search at the optimum and the choice per shape; ``dispatch``: the build that sends each
call to what serves its shape.
"""
from __future__ import annotations

import os

from .shapes import ShapeError, ShapeRanges, is_dynamic, parse_shapes, shape_ranges


def dynamic_model(model, shapes=(), input_shapes: dict | None = None):
    """(proto, path or None, ``ShapeRanges``) of an ONNX ``model`` (a path or a
    ``ModelProto``) with a dimension that neither ``input_shapes`` (static shapes, as
    ``--input-shape`` gives) fixes; None for any other model. ``shapes``:
    ``SearchOptions.shapes`` ((name, (min, opt, max)), ...)."""
    path = None
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not (path.endswith(".onnx") and os.path.isfile(path)):
            return None  # load_model names what is wrong
        import onnx

        try:
            header = onnx.load(path, load_external_data=False)
        except Exception:  # noqa: BLE001 - load_model names what is wrong
            return None
    elif type(model).__name__ == "ModelProto":
        header = model
    else:
        return None
    if not is_dynamic(header):
        return None
    given = dict(shapes or ())
    for name, shape in (input_shapes or {}).items():
        given[name] = (tuple(shape),) * 3  # a static shape given wins
    ranges = shape_ranges(header, given)
    if all(a.min == a.opt == a.max for a in ranges.axes.values()) and input_shapes:
        return None  # the static shapes the user gave: the static build, as before
    proto = header if path is None else _full(path, header)
    return proto, path, ranges


def _full(path: str, header):
    """The model at ``path`` with its weights (read once more only where they are outside
    the file)."""
    import onnx

    if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in header.graph.initializer):
        return header
    return onnx.load(path)


def optimize_dynamic(*args, **kwargs):
    from .search import optimize_dynamic as run

    return run(*args, **kwargs)


__all__ = ["ShapeError", "ShapeRanges", "dynamic_model", "is_dynamic", "optimize_dynamic",
           "parse_shapes", "shape_ranges"]
