"""A model TVM cannot import, run whole on a graph library that can.

TVM's ONNX importer refuses some operators (LSTM, GRU, ...) that ONNX Runtime and OpenVINO
run. Such a model has no Relax graph to place, but it still has a build: a Relax ``main``
whose one call hands the ONNX model, as it is, to a graph library (``R.call_pure_packed``
into the library's session, as every external group is called). The executable runs in a
``relax.VirtualMachine`` like any other build; Collage's search has nothing to choose.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from .._errors import first_line
from ..export.onnx import OnnxFile, graph_input_names, skeleton
from .external import register


class NotWhole(Exception):
    """The model cannot run whole on a library either; the message says why."""


def _static_type(value_info, what: str):
    import onnx

    t = value_info.type.tensor_type
    if not value_info.type.HasField("tensor_type") or not t.HasField("shape"):
        raise NotWhole(f"{what} {value_info.name!r} is not a tensor of known rank")
    dims = []
    for d in t.shape.dim:
        if not d.HasField("dim_value"):
            raise NotWhole(f"{what} {value_info.name!r} has a dynamic dimension "
                           f"({d.dim_param or '?'}): give it with --input-shape")
        dims.append(int(d.dim_value))
    dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).name
    return relax.TensorType(tuple(dims), dtype)


def _run_output_types(proto, inputs, in_types, why) -> list:
    """The outputs' types where shape inference left a dimension unknown though every input
    is static: onnxruntime runs the model on two random inputs and the outputs' shapes must
    agree (a shape that follows the input's values has no static type: ``why`` again)."""
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(proto.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
    except Exception as err:  # noqa: BLE001 - it cannot tell the shapes either
        raise NotWhole(f"{why}; onnxruntime could not load it to find the shape: "
                       f"{first_line(err, 300)}") from err
    rng = np.random.default_rng(0)
    runs = []
    for _ in range(2):
        feed = {}
        for vi, t in zip(inputs, in_types):
            shape, dtype = tuple(int(d) for d in t.shape.values), np.dtype(str(t.dtype))
            feed[vi.name] = (rng.standard_normal(shape).astype(dtype)
                             if dtype.kind == "f" else np.zeros(shape, dtype))
        try:
            outputs = session.run(None, feed)
        except Exception as err:  # noqa: BLE001 - the library's refusal is the reason
            raise NotWhole(f"{why}; onnxruntime failed to run it: {first_line(err, 300)}") from err
        runs.append([(o.shape, o.dtype.name) for o in outputs])
    if runs[0] != runs[1]:
        raise NotWhole(f"{why}; its shape follows the input's values")
    return [relax.TensorType(tuple(int(d) for d in shape), dtype) for shape, dtype in runs[0]]


def _changed_shapes(proto, input_shapes: dict | None) -> dict:
    """The entries of ``input_shapes`` (input name -> shape) that differ from what
    ``proto`` declares for that input."""
    declared = {vi.name: [d.dim_value if d.HasField("dim_value") else None
                          for d in vi.type.tensor_type.shape.dim] for vi in proto.graph.input}
    return {name: shape for name, shape in (input_shapes or {}).items()
            if declared.get(name) != [int(d) for d in shape]}


def _copy(proto):
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    return copy


def with_input_shapes(proto, input_shapes: dict | None):
    """``proto`` with the shapes the user gave (input name -> shape) in place of the declared
    ones: a copy where they differ, ``proto`` itself where they do not."""
    changed = _changed_shapes(proto, input_shapes)
    if not changed:
        return proto
    proto = _copy(proto)
    for vi in proto.graph.input:
        if vi.name in changed:
            dims = vi.type.tensor_type.shape.dim
            del dims[:]
            for d in changed[vi.name]:
                dims.add().dim_value = int(d)
    return proto


def whole_model_module(proto, backend, input_shapes: dict | None = None,
                       like: relax.Function | None = None,
                       path: str | None = None) -> tvm.IRModule:
    """A Relax module whose ``main`` runs ONNX ``proto`` wholly on graph library
    ``backend`` (a ``registry.Backend`` whose lowering has ``compile(model, specs, sole)``);
    raises ``NotWhole`` when its inputs or outputs have no static shapes or the library
    cannot load it. ``like``: the ``main`` of TVM's import of the same model, whose inputs
    and outputs this one must have (the same random inputs run both in the final check).
    ``path``: the file ``proto`` was read from. When the input shapes leave the model as it
    is, the library loads that file itself, as the user's own session does, and the model
    is not serialized again (over 2 GiB, not copied to a temporary file either)."""
    import onnx

    shaped = with_input_shapes(proto, input_shapes)
    if shaped is not proto:
        proto, path = shaped, None
    # inferred without the weights' data (protobuf cannot write a model over 2 GiB)
    inferred = onnx.shape_inference.infer_shapes(skeleton(proto), strict_mode=False,
                                                 data_prop=True)
    weights = {i.name for i in proto.graph.initializer}
    inputs = [vi for vi in inferred.graph.input if vi.name not in weights]
    in_types = [_static_type(vi, "input") for vi in inputs]
    try:
        out_types = [_static_type(vi, "output") for vi in inferred.graph.output]
    except NotWhole as why:  # (a Loop's outputs: shape inference does not see through it)
        out_types = _run_output_types(proto, inputs, in_types, why)
    if like is not None:
        _same_signature(in_types, out_types, like)
    specs = [(tuple(int(d) for d in t.shape.values), str(t.dtype)) for t in out_types]
    lowering = backend.get_lowering()
    compile_whole = getattr(lowering, "compile", None)
    if compile_whole is None:
        raise NotWhole(f"{backend.name} is not a graph library that runs an ONNX model")
    # a library that reads files reads the user's file itself; any other takes the proto
    if path is None or not getattr(lowering, "reads_files", False):
        source = proto
    else:
        source = OnnxFile(path, tuple(graph_input_names(proto)))
    try:
        fn = compile_whole(source, specs, True)
    except Exception as err:  # noqa: BLE001 - the library's refusal is the reason
        raise NotWhole(f"{backend.name} cannot load it: {first_line(err, 300)}") from err
    symbol = register(f"collage.whole.{backend.name}", fn, ("onnx", backend.name, proto, specs))
    return one_call_module(symbol, in_types, out_types)


def one_call_module(symbol: str, in_types: list, out_types: list) -> tvm.IRModule:
    """A Relax module whose ``main`` takes parameters of ``in_types`` and returns what the
    packed function ``symbol`` returns for them (``out_types``: one, or a tuple of them),
    its one call (``call_pure_packed``); the module lists ``symbol`` as its own."""
    params = [relax.Var(f"in{k}", t) for k, t in enumerate(in_types)]
    ret = out_types[0] if len(out_types) == 1 else relax.TupleType(out_types)
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(relax.op.call_pure_packed(symbol, *params, ty_args=ret))
        bb.emit_func_output(out)
    return bb.get().with_attr("collage.symbols", [symbol])


def _same_signature(in_types: list, out_types: list, main: relax.Function) -> None:
    """``NotWhole`` unless the file's inputs and outputs have the types of ``main``'s."""

    def text(types) -> str:
        return ", ".join(f"{t.dtype}{[int(d) for d in t.shape.values]}" for t in types)

    ret = main.ret_ty
    outs = list(ret.fields) if isinstance(ret, relax.TupleType) else [ret]
    params = [p.ty for p in main.params]
    for what, file_types, ours in (("inputs", in_types, params), ("outputs", out_types, outs)):
        if not all(isinstance(t, relax.TensorType) and t.shape is not None for t in ours):
            raise NotWhole(f"TVM's import has {what} that are not static tensors")
        if text(file_types) != text(ours):
            raise NotWhole(f"the file's {what} ({text(file_types)}) differ from TVM's import's "
                           f"({text(ours)})")
