"""Shape computations of an ONNX model, evaluated once before TVM imports it.

PyTorch's exporters write many models with their reshapes, pads, masks and slices computed
at run time from ``Shape`` of tensors whose shapes are in fact static: torchvision's Swin
builds its window partition and attention mask from ``Shape -> Gather -> Concat ->
Reshape`` chains, ``Range``/``ConstantOfShape``/``ScatterND``. TVM's ONNX importer keeps
those computations, so the tensors after them have unknown shapes, and it then rejects
the model (``Reshape expects the input tensor to have known shape``) or fails to compile
it: TVM alone cannot build such a model.

``fold_shapes`` does what onnx-simplifier does, with the onnx wheel's own parts: ONNX shape
inference gives every tensor's static shape, ``Shape``/``Size`` of a static tensor become
constants, and every node whose inputs are all constants is evaluated with the ONNX
reference implementation and replaced by an initializer (outputs up to ``max_elements``;
random, control-flow and sequence operators are never folded). Rounds repeat while
something folded, since a reshape with a constant target makes the next shape static.
Nodes left without a consumer are dropped. A model that computes no shape (no
``Shape``/``Size``, every pad, target shape and slice bound a constant) is left as it is,
and so is one over protobuf's 2 GB (shape inference serializes it; its weights are external
data). Folding is best effort: a node the reference cannot evaluate stays as it is, and a
model shape inference cannot read is returned unchanged.
"""
from __future__ import annotations

import numpy as np

_NEVER = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
          "Multinomial", "Bernoulli", "If", "Loop", "Scan", "SequenceConstruct",
          "SequenceEmpty", "SequenceInsert", "SequenceAt", "SequenceErase", "SequenceLength",
          "SplitToSequence", "ConcatFromSequence", "SequenceMap", "Optional",
          "OptionalGetElement", "OptionalHasElement", "Constant"}
_MAX_ROUNDS = 64  # each round reaches one reshape further: Swin's 12 blocks take ~16
_SMALL = 4096  # initializers kept in the shape-inference skeleton (elements)
_SHAPE_OPS = {"Shape", "Size"}
# Inputs TVM's importer needs constant (a pad, a target shape, slice bounds, ...), by op.
_SHAPE_INPUTS = {"Pad": (1,), "Reshape": (1,), "Expand": (1,), "Tile": (1,),
                 "Slice": (1, 2, 3, 4), "ConstantOfShape": (0,), "Resize": (1, 2, 3),
                 "Upsample": (1,), "Unsqueeze": (1,), "Squeeze": (1,), "Range": (0, 1, 2),
                 "TopK": (1,), "OneHot": (1,)}
_MAX_BYTES = 2_000_000_000


def _computes_shapes(graph) -> bool:
    """Whether ``graph`` computes a shape at run time: a ``Shape``/``Size``, or an input
    TVM needs constant (``_SHAPE_INPUTS``) that is computed by other nodes, e.g. the pads
    the TorchScript exporter writes for ``F.pad`` as ConstantOfShape -> Concat -> Reshape
    -> Slice -> Transpose -> Reshape -> Cast of constants (timm's botnet)."""
    known = {i.name for i in graph.initializer} | {
        o for n in graph.node if n.op_type == "Constant" for o in n.output}
    for n in graph.node:
        if n.op_type in _SHAPE_OPS:
            return True
        for k in _SHAPE_INPUTS.get(n.op_type, ()):
            if k < len(n.input) and n.input[k] and n.input[k] not in known:
                return True
    return False


def fold_shapes(proto, input_shapes: dict | None = None, max_elements: int = 1 << 20):
    """``(model, folded)``: a copy of the ONNX ``proto`` with its constant computations
    evaluated (``folded`` nodes), or ``proto`` itself and 0 when nothing folded.
    ``input_shapes``: input name -> static shape, applied before shape inference."""
    import onnx

    if not _computes_shapes(proto.graph):
        return proto, 0  # nothing computes a shape: TVM imports it as it is
    if _too_big(proto):
        return proto, 0  # shape inference serializes the model: protobuf's 2 GB limit
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    _set_input_shapes(model.graph, input_shapes or {})
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    folded = 0
    for _ in range(_MAX_ROUNDS):
        shapes = _static_shapes(model)
        if shapes is None:
            break
        n = _fold_round(model.graph, shapes, opset, max_elements)
        if not n:
            break
        folded += n
    if not folded:
        return proto, 0
    _drop_dead_nodes(model.graph)
    return model, folded


def _too_big(proto) -> bool:
    """Over protobuf's 2 GB (``ByteSize`` itself raises past 2 GiB)."""
    from google.protobuf.message import EncodeError

    try:
        return proto.ByteSize() > _MAX_BYTES
    except (EncodeError, ValueError):
        return True


def _set_input_shapes(graph, input_shapes: dict) -> None:
    for inp in graph.input:
        shape = input_shapes.get(inp.name)
        if shape is None or not inp.type.HasField("tensor_type"):
            continue
        dims = inp.type.tensor_type.shape.dim
        del dims[:]
        for d in shape:
            dims.add().dim_value = int(d)


def _static_shapes(model) -> dict | None:
    """Tensor name -> its static shape, for every tensor ONNX shape inference fully knows."""
    import onnx

    skeleton = _skeleton(model)
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton, data_prop=True)
    except Exception:  # noqa: BLE001 - folding is best effort
        try:
            inferred = onnx.shape_inference.infer_shapes(skeleton)
        except Exception:  # noqa: BLE001
            return None
    out = {}
    g = inferred.graph
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape"):
            continue
        dims = vi.type.tensor_type.shape.dim
        if all(d.HasField("dim_value") for d in dims):
            out[vi.name] = tuple(int(d.dim_value) for d in dims)
    for init in model.graph.initializer:
        out[init.name] = tuple(init.dims)
    return out


def _skeleton(model):
    """``model`` without its weights, for shape inference (which serializes the model it
    is given, once a round): an initializer of more than ``_SMALL`` elements becomes a graph
    input of its type and shape; small ones (shapes, indices: what data propagation reads)
    stay."""
    import onnx
    from onnx import helper

    g = model.graph
    big = [i for i in g.initializer if int(np.prod(i.dims, dtype=np.int64)) > _SMALL]
    big_names = {i.name for i in big}
    listed = {i.name for i in g.input}
    graph = helper.make_graph(
        list(g.node), g.name,
        list(g.input) + [helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
                         for i in big if i.name not in listed],
        list(g.output), [i for i in g.initializer if i.name not in big_names])
    skeleton = onnx.ModelProto()
    skeleton.ir_version = model.ir_version
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    skeleton.graph.CopyFrom(graph)
    return skeleton


def _fold_round(graph, shapes: dict, opset, max_elements: int) -> int:
    """Fold what can be folded now; the number of nodes folded."""
    from onnx import numpy_helper

    inits = {i.name: i for i in graph.initializer}
    constants = {n.output[0]: n for n in graph.node if n.op_type == "Constant" and n.output}
    graph_outputs = {o.name for o in graph.output}
    values: dict = {}

    def value(name):
        if name in values:
            return values[name]
        if name in inits:
            values[name] = numpy_helper.to_array(inits[name])
        elif name in constants:
            values[name] = _evaluate(constants[name], [], opset)[0]
        else:
            return None
        return values[name]

    keep, new_inits, folded = [], [], 0
    for node in graph.node:
        outs = _fold_node(node, shapes, value, opset, graph_outputs, max_elements)
        if outs is None:
            keep.append(node)
            continue
        folded += 1
        for name, arr in zip(node.output, outs):
            values[name] = arr
            new_inits.append(numpy_helper.from_array(arr, name))
    if folded:
        del graph.node[:]
        graph.node.extend(keep)
        graph.initializer.extend(new_inits)
        folded_names = {t.name for t in new_inits}
        kept_info = [vi for vi in graph.value_info if vi.name not in folded_names]
        del graph.value_info[:]
        graph.value_info.extend(kept_info)
    return folded


def _fold_node(node, shapes, value, opset, graph_outputs, max_elements):
    """The output arrays of ``node`` if it folds, else None."""
    if (node.domain not in ("", "ai.onnx") or node.op_type in _NEVER
            or any(o in graph_outputs for o in node.output)
            or any(a.type in (5, 10) for a in node.attribute)):  # GRAPH, GRAPHS
        return None
    if node.op_type in _SHAPE_OPS:
        shape = shapes.get(node.input[0])
        if shape is None:
            return None
        if node.op_type == "Size":
            return [np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)]
        attrs = {a.name: a.i for a in node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", len(shape))
        return [np.array(shape[start:end] if "end" in attrs else shape[start:],
                         dtype=np.int64)]
    inputs = []
    for name in node.input:
        if not name:  # an optional input left out
            inputs.append(None)
            continue
        arr = value(name)
        if arr is None:
            return None
        inputs.append(arr)
    if not any(a is not None for a in inputs):
        return None  # a generator with no inputs (ConstantOfShape needs one): leave it
    try:
        outs = _evaluate(node, inputs, opset)
    except Exception:  # noqa: BLE001 - the reference cannot evaluate it: keep the node
        return None
    if (len(outs) != len([o for o in node.output if o])
            or not all(isinstance(o, np.ndarray) and o.dtype != object for o in outs)
            or sum(o.size for o in outs) > max_elements):
        return None
    return outs


def _evaluate(node, inputs, opset) -> list:
    from onnx.reference import ReferenceEvaluator

    names = [n for n in node.input]
    feeds = {n: a for n, a in zip(names, inputs) if n and a is not None}
    ev = ReferenceEvaluator(node, opsets={"": opset} if opset else None)
    return [np.asarray(o) for o in ev.run(None, feeds)]


def _drop_dead_nodes(graph) -> None:
    """Nodes and initializers that nothing reads any more are removed."""
    used = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(o in used for o in node.output):
            kept.append(node)
            used.update(i for i in node.input if i)
            for g in _subgraphs(node):  # subgraphs read outer names
                used.update(_outer_names(g))
    kept.reverse()
    del graph.node[:]
    graph.node.extend(kept)
    inputs = {i.name for i in graph.input}  # an initializer listed as an input stays
    inits = [i for i in graph.initializer if i.name in used or i.name in inputs]
    del graph.initializer[:]
    graph.initializer.extend(inits)


def _outer_names(graph) -> set:
    names = set()
    for node in graph.node:
        names.update(i for i in node.input if i)
        for g in _subgraphs(node):
            names |= _outer_names(g)
    return names


def _subgraphs(node) -> list:
    return [g for a in node.attribute
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs)]
