"""Relax -> ONNX: write one standalone Relax subgraph function as an ONNX model.

Why: the graph-library backends (onnxruntime, openvino; ``backends/_graphlib.py``) run a
candidate subgraph by handing it to their library, and both libraries read ONNX. The
subgraph comes from ``graph.subgraph.extract_function``: tensor parameters, one dataflow
block of ``VarBinding``s whose values are operator calls, tuples and tuple-get-items, and
constants (weights) inline. Every value has a static shape.

Two entry points:

- ``unsupported_reason(value)`` says, for one binding value, why it cannot be written
  (``None`` if it can). The pattern rules call it for every node of a model, so it only
  looks at types and attributes and never imports ``onnx``.
- ``export_function(func, opset=17)`` writes the whole function. ONNX graph inputs are the
  parameters in order (names made valid and unique), outputs are the function's results
  in order (a tuple result gives several outputs), constants become initializers (one per
  distinct Constant object). Anything not exportable raises ``ExportError`` naming the op.

The writer walks the function's bindings here; each op's converter is an entry of the op
table (``ops``: conventions, and the ops refused where the libraries disagree with TVM),
writing into the builder (``builder``). ``model`` hands a written model to a library.

After writing, ONNX shape inference runs over the result and every inferred shape is
compared with the Relax type of the same value: a disagreement (an attribute converted
wrongly) is an ``ExportError`` here, not a wrong answer at run time.
"""
from __future__ import annotations

import numpy as np
from tvm import relax

from .base import (DEFAULT_OPSET, MIN_OPSET, Constant, ExportError, _onnx_dtype, _static_shape,
                   _ty, _type_reason)
from .builder import _Builder, clear_dequantized, mark_dequantized
from .model import (OnnxFile, graph_input_names, input_names, model_source, output_names,
                    serialized)
from .ops import _OPS, unsupported_reason

__all__ = ["Constant", "DEFAULT_OPSET", "ExportError", "MIN_OPSET", "OnnxFile",
           "clear_dequantized", "export_function", "graph_input_names", "input_names",
           "mark_dequantized", "model_source", "output_names", "serialized", "skeleton",
           "unsupported_reason"]


def _flatten(names) -> list:
    if isinstance(names, list):
        return [n for item in names for n in _flatten(item)]
    return [names]


def _tensor_info(name: str, ty):
    from onnx import helper

    return helper.make_tensor_value_info(name, _onnx_dtype(str(ty.dtype)),
                                         list(_static_shape(ty)))


def _flat_types(ty) -> list:
    if isinstance(ty, relax.TupleType):
        return [t for f in ty.fields for t in _flat_types(f)]
    return [ty]


def export_function(func: relax.Function, opset: int = DEFAULT_OPSET,
                    name: str = "collage_subgraph", check: bool = True):
    """Write ``func`` as an ``onnx.ModelProto``; raises ``ExportError`` if it cannot be.

    Graph inputs are ``func.params`` in order, graph outputs the (flattened) result in
    order. Every parameter stays a graph input even when unused; note that OpenVINO drops
    unused inputs when it reads the model, so bind its inputs by name, or export only
    functions that use all their parameters (as ``extract_function`` makes them).
    ``check`` runs ONNX shape inference over the result and compares it with the Relax
    types (cheap: large initializers are left out of the copy that is inferred).
    """
    import onnx
    from onnx import helper

    if opset < MIN_OPSET or opset > onnx.defs.onnx_opset_version():
        raise ValueError(f"opset {opset} is not supported "
                         f"({MIN_OPSET}..{onnx.defs.onnx_opset_version()})")
    b = _Builder(opset)
    inputs = []
    for p in func.params:
        reason = _type_reason(p.ty, f"parameter {p.name}")
        if reason:
            raise ExportError(reason)
        pname = b.fresh(p.name)
        b.values[p] = pname
        inputs.append(_tensor_info(pname, p.ty))

    body = func.body
    blocks = body.blocks if isinstance(body, relax.SeqExpr) else []
    result = body.body if isinstance(body, relax.SeqExpr) else body
    expected: dict = {}  # ONNX name -> (op name, relax type) for the shape check
    for block in blocks:
        for binding in block.bindings:
            value = binding.value
            if isinstance(binding, relax.MatchCast):  # a run-time check of a value's type
                if binding.var.ty is None or _type_reason(binding.var.ty, "match_cast"):
                    raise ExportError(f"MatchCast of {binding.var.name}: only a cast to a "
                                      "static tensor type is exported")
            elif not isinstance(binding, relax.VarBinding):
                raise ExportError(f"{type(binding).__name__} of {binding.var.name}: "
                                  "only VarBindings and MatchCasts are supported")
            reason = unsupported_reason(value)
            if reason:
                raise ExportError(reason)
            b.base = binding.var.name
            if isinstance(value, relax.Call):
                out = _OPS[value.op.name].emit(b, value)
                op_name = value.op.name
            else:  # tuple, tuple_get_item, alias, constant
                out = b.value(value)
                op_name = type(value).__name__
            b.values[binding.var] = out
            for n, ty in zip(_flatten(out), _flat_types(binding.var.ty)):
                expected.setdefault(n, (op_name, ty))

    # Graph outputs: every result name once; params, initializers and repeats need an
    # Identity (an ONNX graph output must be a distinct value produced by a node).
    produced = {o for n in b.nodes for o in n.output}
    outputs, used = [], set()
    reason = _type_reason(_ty(result), "function result")
    if reason:
        raise ExportError(reason)
    out_names = _flatten(b.value(result))
    for n, ty in zip(out_names, _flat_types(result.ty)):
        if n not in produced or n in used:
            b.base = "output"
            n = b.node("Identity", [n])
        used.add(n)
        outputs.append(_tensor_info(n, ty))

    nodes, initializers = _fold_conv_bias(b.nodes, b.initializers, {o.name for o in outputs})
    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=initializers)
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="collage-tvm")
    model.ir_version = helper.find_min_ir_version_for(opsets)
    if check:
        _check_shapes(model, expected)
    return model


def _fold_conv_bias(nodes: list, initializers: list, outputs: set) -> tuple:
    """(nodes, initializers) with each ``Add(Conv(x, w), Reshape(b, [1, C, 1, ...]))`` whose
    Conv output feeds that Add alone written as ``Conv(x, w, b)``: TVM's importer splits an
    ONNX Conv's bias into a reshape and an add, and the libraries' fusions look for the
    bias inside the Conv (OpenVINO's int8 transformations, with the bias dequantized from
    int32, miss it otherwise). Initializers no node reads any more are dropped."""
    from onnx import numpy_helper

    producer = {o: n for n in nodes for o in n.output}
    readers: dict = {}
    for n in nodes:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    consts = {t.name: t for t in initializers}
    dropped = set()
    def channels(dims) -> bool:  # [1, C, 1, ...]: one value per output channel
        return len(dims) >= 3 and dims[0] == 1 and dims[1] > 1 and all(d == 1 for d in dims[2:])

    added = []
    for add in nodes:
        if add.op_type != "Add" or len(add.input) != 2:
            continue
        for y, bias in (tuple(add.input), tuple(reversed(add.input))):
            conv = producer.get(y)
            if (conv is None or conv.op_type != "Conv" or len(conv.input) != 2
                    or y in outputs or len(readers.get(y, ())) != 1 or id(conv) in dropped):
                continue
            reshape = producer.get(bias)
            if bias in consts and channels(list(consts[bias].dims)):  # a folded constant
                flat = numpy_helper.from_array(
                    numpy_helper.to_array(consts[bias]).reshape(-1), f"{bias}_bias")
                added.append(flat)
                conv.input.append(flat.name)
            elif (reshape is not None and reshape.op_type == "Reshape"
                  and reshape.input[1] in consts
                  and channels(numpy_helper.to_array(consts[reshape.input[1]]).tolist())):
                conv.input.append(reshape.input[0])  # (a 1-D bias: Reshape made it [1,C,1,1])
                if len(readers.get(bias, ())) == 1 and bias not in outputs:
                    dropped.add(id(reshape))
            else:
                continue
            conv.output[0] = add.output[0]
            dropped.add(id(add))
            break
    if not dropped:
        return nodes, initializers
    kept = [n for n in nodes if id(n) not in dropped]
    read = {i for n in kept for i in n.input} | outputs
    return kept, [t for t in initializers + added if t.name in read]


def _check_shapes(model, expected: dict) -> None:
    """ONNX shape inference must agree with the Relax type of every value we wrote."""
    import onnx
    from onnx import helper

    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton(model), strict_mode=True)
    except Exception as err:  # noqa: BLE001 - onnx raises several error types here
        raise ExportError(f"ONNX shape inference failed on the exported graph: {err}") from err
    for info in list(inferred.graph.value_info) + list(inferred.graph.output):
        if info.name not in expected:
            continue
        op_name, ty = expected[info.name]
        tt = info.type.tensor_type
        if tt.elem_type and tt.elem_type != _onnx_dtype(str(ty.dtype)):
            raise ExportError(f"{op_name}: ONNX computes element type "
                              f"{helper.tensor_dtype_to_np_dtype(tt.elem_type)} for "
                              f"{info.name}, Relax says {ty.dtype}")
        if not tt.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        want = list(_static_shape(ty))
        if None not in dims and dims != want:
            raise ExportError(f"{op_name}: ONNX computes shape {dims} for {info.name}, "
                              f"Relax says {want}")


def skeleton(model):
    """``model`` itself, or when it holds large weights a copy that declares them as
    graph inputs instead: shape inference then sees the same shapes without the data."""
    from onnx import helper

    def is_big(t):
        return int(np.prod(t.dims)) > 1024

    big = [t for t in model.graph.initializer if is_big(t)]
    if not big:
        return model
    small = [t for t in model.graph.initializer if not is_big(t)]
    g = model.graph
    inputs = list(g.input) + [helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                              for t in big]
    graph = helper.make_graph(list(g.node), g.name, inputs, list(g.output), initializer=small)
    return helper.make_model(graph, opset_imports=list(model.opset_import),
                             ir_version=model.ir_version)
