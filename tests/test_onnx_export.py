"""Relax -> ONNX exporter (collage_tvm.export.onnx): every supported op, checked by running.

Each case builds a tiny Relax function, exports it, checks the model with
``onnx.checker`` and compares onnxruntime's outputs (some cases: OpenVINO's too) with
TVM's. Whole models (ResNet-small from ONNX, a transformer encoder layer from torch) are
exported in one piece and node by node, as the graph-library backends do.
"""
import numpy as np
import pytest
import tvm
from tvm import relax

from collage_tvm.export.onnx import (ExportError, export_function, input_names, output_names,
                                     unsupported_reason)
from collage_tvm.graph.subgraph import random_inputs

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

RTOL, ATOL = 1e-4, 1e-5
F32 = "float32"
_RNG = np.random.default_rng(0)


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def function(specs, build):
    """A Relax function of params ``specs`` [(shape, dtype)]; ``build(*params)`` gives the
    result (an expression, or a list of them for a tuple result)."""
    params = [relax.Var(f"x{i}", relax.TensorType(shape, dtype))
              for i, (shape, dtype) in enumerate(specs)]
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = build(*params)
            if isinstance(out, (list, tuple)):
                out = relax.Tuple(list(out))
            gv = bb.emit_output(out)
        bb.emit_func_output(gv)
    return bb.get()["main"]


def const(shape, scale=1.0):
    return relax.const((_RNG.uniform(-1, 1, size=shape) * scale).astype(F32))


def _as_list(out):
    if hasattr(out, "numpy"):
        return [out.numpy()]
    return [x for item in out for x in _as_list(item)]


def run_tvm(func, inputs):
    ex = tvm.compile(tvm.IRModule({"main": func}), "llvm")
    vm = relax.VirtualMachine(ex, tvm.cpu())
    return _as_list(vm["main"](*[tvm.runtime.tensor(a) for a in inputs]))


def run_ort(model, inputs):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {i.name: a for i, a in zip(sess.get_inputs(), inputs)})


def run_openvino(model, inputs):
    ov = pytest.importorskip("openvino")
    core = ov.Core()
    compiled = core.compile_model(core.read_model(model=model.SerializeToString(), weights=b""),
                                  "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    result = compiled.create_infer_request().infer(list(inputs))
    return [np.asarray(result[o]) for o in compiled.outputs]


def assert_same(ref, got, rtol=RTOL, atol=ATOL, what=""):
    assert len(ref) == len(got), what
    for i, (r, g) in enumerate(zip(ref, got)):
        g = np.asarray(g)
        assert r.shape == g.shape, f"{what} output {i}: shape {g.shape} != {r.shape}"
        if r.dtype.kind == "f":
            np.testing.assert_allclose(g, r, rtol=rtol, atol=atol, err_msg=f"{what} output {i}")
        else:
            assert g.dtype == r.dtype, f"{what} output {i}: dtype {g.dtype} != {r.dtype}"
            np.testing.assert_array_equal(g, r, err_msg=f"{what} output {i}")


def check(func, openvino=False, opset=17, rtol=RTOL, atol=ATOL, inputs=None):
    """Export ``func``, check the model, compare onnxruntime (and OpenVINO) with TVM."""
    for block in func.body.blocks:
        for binding in block.bindings:
            assert unsupported_reason(binding.value) is None, unsupported_reason(binding.value)
    model = export_function(func, opset=opset)
    onnx.checker.check_model(model, full_check=True)
    assert len(input_names(model)) == len(func.params)
    inputs = random_inputs(func.params) if inputs is None else inputs
    ref = run_tvm(func, inputs)
    assert_same(ref, run_ort(model, inputs), rtol, atol, "onnxruntime")
    if openvino:
        assert_same(ref, run_openvino(model, inputs), rtol, atol, "openvino")
    return model


def pos(x):
    """|x| + 0.5: inputs for log, sqrt, rsqrt, power, division."""
    return relax.op.add(relax.op.abs(x), relax.const(0.5, F32))


op = relax.op
nn = relax.op.nn
X4 = [((2, 3, 6, 6), F32)]   # NCHW activations
X3 = [((2, 5, 8), F32)]


# ---------------------------------------------------------------------------------------
# operator cases: (id, param specs, build)
# ---------------------------------------------------------------------------------------
CASES = [
    # convolutions
    ("conv1d", [((1, 4, 16), F32)],
     lambda x: nn.conv1d(x, const((6, 4, 3)), strides=2, padding=(1, 2), dilation=1)),
    ("conv2d_groups_asym_pad_dilation", [((1, 4, 9, 9), F32)],
     lambda x: nn.conv2d(x, const((8, 2, 3, 3)), strides=(2, 1), padding=(1, 0, 2, 1),
                         dilation=(1, 2), groups=2)),
    ("conv2d_weight_param", [((1, 3, 7, 7), F32), ((5, 3, 3, 3), F32)],
     lambda x, w: nn.conv2d(x, w, padding=1)),
    ("conv2d_depthwise", [((1, 4, 8, 8), F32)],
     lambda x: nn.conv2d(x, const((4, 1, 3, 3)), padding=1, groups=4)),
    ("conv3d", [((1, 2, 5, 6, 6), F32)],
     lambda x: nn.conv3d(x, const((3, 2, 3, 3, 3)), padding=1, strides=(1, 2, 2))),
    ("conv1d_transpose", [((1, 4, 7), F32)],
     lambda x: nn.conv1d_transpose(x, const((4, 3, 3)), strides=2, padding=1,
                                   output_padding=1)),
    ("conv2d_transpose", [((1, 4, 5, 5), F32)],
     lambda x: nn.conv2d_transpose(x, const((4, 2, 3, 3)), strides=2, padding=(1, 1, 1, 1),
                                   output_padding=1, groups=2)),
    # matmul
    ("matmul_2d", [((4, 8), F32)], lambda x: op.matmul(x, const((8, 5)))),
    ("matmul_batch_broadcast", [((2, 1, 4, 8), F32), ((3, 8, 5), F32)],
     lambda x, y: op.matmul(x, y)),
    ("matmul_vector", [((8,), F32)], lambda x: op.matmul(x, const((8, 5)))),
    # binary elementwise with broadcasting and scalars
    ("add", [((2, 3, 4), F32), ((3, 1), F32)], lambda x, y: op.add(x, y)),
    ("subtract", [((2, 3, 4), F32)], lambda x: op.subtract(relax.const(1.5, F32), x)),
    ("multiply", [((2, 3, 4), F32), ((4,), F32)], lambda x, y: op.multiply(x, y)),
    ("divide", [((2, 3, 4), F32), ((2, 3, 4), F32)], lambda x, y: op.divide(x, pos(y))),
    ("floor_divide", [((2, 3, 4), F32)],
     lambda x: op.floor_divide(op.multiply(x, relax.const(5.0, F32)), relax.const(0.7, F32))),
    ("power", [((2, 3, 4), F32)], lambda x: op.power(pos(x), relax.const(2.5, F32))),
    ("maximum", [((2, 3, 4), F32), ((1, 4), F32)], lambda x, y: op.maximum(x, y)),
    ("minimum", [((2, 3, 4), F32), ((1, 4), F32)], lambda x, y: op.minimum(x, y)),
    ("add_int64", [((3, 4), "int64"), ((4,), "int64")], lambda x, y: op.add(x, y)),
    # comparisons, logic, where
    ("equal_not_equal_int", [((4, 5), "int64"), ((4, 5), "int64")],
     lambda x, y: [op.equal(x, y), op.not_equal(x, y)]),
    ("less_greater", [((4, 5), F32), ((5,), F32)],
     lambda x, y: [op.less(x, y), op.less_equal(x, y), op.greater(x, y),
                   op.greater_equal(x, y)]),
    ("logical", [((4, 5), F32)],
     lambda x: [op.logical_and(op.greater(x, relax.const(0.0, F32)),
                               op.less(x, relax.const(0.5, F32))),
                op.logical_or(op.greater(x, relax.const(0.5, F32)),
                              op.less(x, relax.const(-0.5, F32))),
                op.logical_xor(op.greater(x, relax.const(0.0, F32)),
                               op.greater(x, relax.const(0.3, F32))),
                op.logical_not(op.greater(x, relax.const(0.0, F32)))]),
    ("where", [((4, 5), F32), ((4, 5), F32)],
     lambda x, y: op.where(op.greater(x, relax.const(0.0, F32)), x, y)),
    # unary
    ("relu", X4, lambda x: nn.relu(x)),
    ("gelu", X4, lambda x: nn.gelu(op.multiply(x, relax.const(3.0, F32)))),
    ("gelu_tanh", X4, lambda x: nn.gelu_tanh(op.multiply(x, relax.const(3.0, F32)))),
    ("sigmoid", X4, lambda x: op.sigmoid(x)),
    ("tanh", X4, lambda x: op.tanh(x)),
    ("silu", X4, lambda x: nn.silu(x)),
    ("exp", X4, lambda x: op.exp(x)),
    ("log", X4, lambda x: op.log(pos(x))),
    ("sqrt", X4, lambda x: op.sqrt(pos(x))),
    ("rsqrt", X4, lambda x: op.rsqrt(pos(x))),
    ("erf", X4, lambda x: op.erf(x)),
    ("negative_abs_sign", X4, lambda x: [op.negative(x), op.abs(x), op.sign(x)]),
    ("floor_ceil", X4, lambda x: [op.floor(op.multiply(x, relax.const(3.0, F32))),
                                  op.ceil(op.multiply(x, relax.const(3.0, F32)))]),
    ("sin_cos_square", X4, lambda x: [op.sin(x), op.cos(x), op.square(x)]),
    ("leakyrelu", X4, lambda x: nn.leakyrelu(x, alpha=0.2)),
    ("clip", X4, lambda x: op.clip(x, -0.3, 0.4)),
    ("astype", X4, lambda x: [op.astype(op.astype(op.multiply(x, relax.const(4.0, F32)),
                                                  "int64"), F32),
                              op.astype(op.greater(x, relax.const(0.0, F32)), F32),
                              op.astype(x, "bool")]),
    ("astype_int", [((3, 4), "int64")], lambda x: op.astype(x, "int32")),
    # softmax, normalization
    ("softmax", X4, lambda x: nn.softmax(x, axis=-1)),
    ("log_softmax", X4, lambda x: nn.log_softmax(x, axis=1)),
    ("batch_norm_item0", X4,
     lambda x: relax.TupleGetItem(nn.batch_norm(x, const((3,)), const((3,)), const((3,)),
                                                pos(const((3,))), axis=1, epsilon=1e-3,
                                                training=False), 0)),
    ("batch_norm_tuple_no_scale_center", X4,
     lambda x: nn.batch_norm(x, const((3,)), const((3,)), const((3,)), pos(const((3,))),
                             axis=1, center=False, scale=False, training=False)),
    ("layer_norm_last", X3, lambda x: nn.layer_norm(x, const((8,)), const((8,)), axes=[-1])),
    ("layer_norm_two_axes", X3,
     lambda x: nn.layer_norm(x, const((5, 8)), const((5, 8)), axes=[1, 2], epsilon=1e-3)),
    # pooling
    ("max_pool2d", [((1, 3, 9, 9), F32)],
     lambda x: nn.max_pool2d(x, 3, strides=2, padding=1)),
    ("max_pool2d_ceil_dilation", [((1, 3, 10, 10), F32)],
     lambda x: nn.max_pool2d(x, 2, strides=3, dilation=2, ceil_mode=True)),
    ("max_pool1d", X3, lambda x: nn.max_pool1d(x, 3, strides=1, padding=1)),
    ("avg_pool2d_include_pad", [((1, 3, 9, 9), F32)],
     lambda x: nn.avg_pool2d(x, 3, strides=2, padding=1, count_include_pad=True)),
    ("avg_pool2d_exclude_pad_ceil", [((1, 3, 8, 8), F32)],
     lambda x: nn.avg_pool2d(x, 3, strides=2, padding=1, ceil_mode=True)),
    ("avg_pool1d", X3, lambda x: nn.avg_pool1d(x, 2, strides=2)),
    ("adaptive_avg_pool2d_global", X4, lambda x: nn.adaptive_avg_pool2d(x, (1, 1))),
    ("adaptive_avg_pool2d_divisible", X4, lambda x: nn.adaptive_avg_pool2d(x, (3, 2))),
    # shapes and data movement
    ("reshape", X4, lambda x: op.reshape(x, (6, -1))),
    ("permute_dims", X4, lambda x: [op.permute_dims(x, [0, 2, 3, 1]), op.permute_dims(x)]),
    ("concat", [((2, 3, 4), F32), ((2, 5, 4), F32)],
     lambda x, y: op.concat([x, y, x], axis=1)),
    ("split_sections", X4, lambda x: op.split(x, 3, axis=1)),
    ("split_indices", X4, lambda x: op.split(x, [1, 4], axis=-1)),
    ("split_item", X4, lambda x: relax.TupleGetItem(op.split(x, [2], axis=2), 1)),
    ("strided_slice", X4,
     lambda x: [op.strided_slice(x, axes=[2, 3], begin=[1, 0], end=[5, 6], strides=[2, 1]),
                op.strided_slice(x, axes=[1], begin=[1], end=[2 ** 63 - 1]),
                op.strided_slice(x, axes=[3, 1], begin=[-1, 2], end=[-100, 0],
                                 strides=[-2, -1])]),
    ("squeeze_expand_flatten", [((2, 1, 3, 1), F32)],
     lambda x: [op.squeeze(x), op.squeeze(x, axis=[3]), op.expand_dims(x, [0, -1]),
                op.flatten(x)]),
    ("take_param_indices", [((4, 6, 3), F32), ((2, 5), "int64")],
     lambda x, i: op.take(x, i, axis=1)),
    ("take_const_scalar_and_flat", [((4, 6), F32)],
     lambda x: [op.take(x, relax.const(2, "int64"), axis=0),
                op.take(op.reshape(x, (24,)), relax.const(np.array([0, 7, 23], "int64")))]),
    ("take_clip_wrap", [((4, 6), F32), ((3,), "int32")],
     lambda x, i: [op.take(x, op.add(i, relax.const(4, "int32")), axis=1, mode="clip"),
                   op.take(x, op.add(i, relax.const(5, "int32")), axis=1, mode="wrap"),
                   op.take(x, relax.const(np.array([-1, 9], "int64")), axis=1, mode="wrap")]),
    ("broadcast_to", [((3, 1), F32)], lambda x: op.broadcast_to(x, (2, 3, 4))),
    # repeats as many as, fewer than (left-padded with 1s) and more than the rank
    ("tile", [((2, 3), F32)],
     lambda x: [op.tile(x, [2, 3]), op.tile(x, [2]), op.tile(x, [2, 1, 2])]),
    ("tile_int64", [((2, 3), "int64")], lambda x: op.tile(x, [1, 2])),
    ("flip", X4, lambda x: [op.flip(x, 2), op.flip(x, -1), op.flip(x, 0)]),
    ("pad_constant", X4, lambda x: nn.pad(x, [0, 0, 0, 0, 1, 2, 0, 1], pad_value=0.5)),
    ("pad_reflect_replicate", X4,
     lambda x: [nn.pad(x, [0, 0, 0, 0, 2, 1, 1, 2], pad_mode="reflect"),
                nn.pad(x, [0, 0, 0, 0, 2, 1, 1, 2], pad_mode="replicate")]),
    # reductions
    ("sum_mean", X4, lambda x: [op.sum(x, axis=[2, 3]), op.mean(x, axis=[-1], keepdims=True),
                                op.sum(x), op.mean(x)]),
    ("max_min_prod", X4, lambda x: [op.max(x, axis=[1]), op.min(x, axis=[0, 2], keepdims=True),
                                    op.prod(pos(x), axis=[3])]),
    ("max_int8", [((3, 4), "int64")],
     lambda x: op.max(op.astype(x, "int8"), axis=[-1], keepdims=True)),
    ("variance_std", X4, lambda x: [op.variance(x, axis=[-1]),
                                    op.std(x, axis=[1, 2], keepdims=True)]),
    ("argmax_argmin", X4, lambda x: [op.argmax(x, axis=1), op.argmin(x, axis=-1, keepdims=True),
                                     op.argmax(x)]),
    ("topk", X3, lambda x: op.topk(x, 3, axis=-1)),
]


@pytest.mark.parametrize("name,specs,build", CASES, ids=[c[0] for c in CASES])
def test_op(name, specs, build):
    check(function(specs, build))


@pytest.mark.parametrize("name", ["conv2d_groups_asym_pad_dilation", "conv2d_transpose",
                                  "gelu", "layer_norm_last", "avg_pool2d_exclude_pad_ceil",
                                  "strided_slice", "sum_mean", "take_clip_wrap", "tile", "flip"])
def test_op_openvino(name):
    _, specs, build = next(c for c in CASES if c[0] == name)
    check(function(specs, build), openvino=True)


def test_opset_18_reductions_take_axes_as_inputs():
    func = function(X4, lambda x: [op.mean(x, axis=[1]), op.max(x, axis=[2, 3]),
                                   op.variance(x, axis=[-1])])
    model = check(func, opset=18)
    reduce_mean = next(n for n in model.graph.node if n.op_type == "ReduceMean")
    assert len(reduce_mean.input) == 2
    assert [a.name for a in reduce_mean.attribute] == ["keepdims"]
    with pytest.raises(ValueError, match="opset 13"):
        export_function(func, opset=13)


# ---------------------------------------------------------------------------------------
# function-level behaviour: names, outputs, constants
# ---------------------------------------------------------------------------------------
def test_inputs_outputs_names_and_order():
    a = relax.Var("x.in", relax.TensorType((2, 3), F32))
    b = relax.Var("x.in", relax.TensorType((3,), F32))
    c = relax.Var("1st", relax.TensorType((2, 3), F32))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b, c]):
        with bb.dataflow():
            s = bb.emit(op.add(a, b))
            t = bb.emit(op.multiply(s, c))
            gv = bb.emit_output(relax.Tuple([t, s, t, c]))  # repeats and a bare param
        bb.emit_func_output(gv)
    func = bb.get()["main"]
    model = check(func, openvino=True)
    ins, outs = input_names(model), output_names(model)
    assert len(ins) == 3 and len(set(ins)) == 3
    assert all(n.replace("_", "a").isalnum() and not n[0].isdigit() for n in ins)
    assert len(outs) == 4 and len(set(outs)) == 4 and not set(outs) & set(ins)


def test_constants_are_deduplicated_initializers():
    w = const((4, 4))
    func = function([((2, 4), F32)],
                    lambda x: op.add(op.matmul(op.matmul(x, w), w),
                                     op.multiply(x, relax.const(2.0, F32))))
    model = check(func)
    big = [t for t in model.graph.initializer if list(t.dims) == [4, 4]]
    assert len(big) == 1
    scalars = [t for t in model.graph.initializer if list(t.dims) == []]
    assert len(scalars) == 1


def test_extracted_subgraph_exports():
    """A group cut out by extract_function (escaping values = several outputs)."""
    from collage_tvm.graph.dataflow import DataflowGraph
    from collage_tvm.graph.subgraph import extract_function

    func = function([((1, 3, 8, 8), F32)],
                    lambda x: nn.relu(op.add(nn.conv2d(x, const((4, 3, 3, 3)), padding=1),
                                             const((1, 4, 1, 1)))))
    graph = DataflowGraph(func)
    sub, _, outputs, _ = extract_function(graph, [0, 1])
    assert len(outputs) == 1
    check(sub, openvino=True)


# ---------------------------------------------------------------------------------------
# unsupported operators and attributes
# ---------------------------------------------------------------------------------------
def _binding_value(func, op_name):
    return next(b.value for b in func.body.blocks[0].bindings
                if isinstance(b.value, relax.Call) and b.value.op.name == op_name)


def test_unsupported_layout_raises_naming_the_op():
    func = function([((1, 8, 8, 3), F32)],
                    lambda x: nn.conv2d(x, const((4, 3, 3, 3)), data_layout="NHWC",
                                        kernel_layout="OIHW"))
    call = _binding_value(func, "relax.nn.conv2d")
    reason = unsupported_reason(call)
    assert reason and reason.startswith("relax.nn.conv2d:") and "NHWC" in reason
    with pytest.raises(ExportError, match=r"relax\.nn\.conv2d: data_layout NHWC"):
        export_function(func)


def test_unsupported_op_raises():
    func = function([((2, 6), F32)], lambda x: op.cumsum(nn.relu(x), axis=1))
    assert unsupported_reason(_binding_value(func, "relax.nn.relu")) is None
    assert "relax.cumsum" in unsupported_reason(_binding_value(func, "relax.cumsum"))
    with pytest.raises(ExportError, match=r"relax\.cumsum"):
        export_function(func)


@pytest.mark.parametrize("name,specs,build,fragment", [
    ("float16", [((2, 3), "float16")], lambda x: op.add(x, x), "float16"),
    ("float64", [((2, 3), "float64")], lambda x: nn.relu(x), "float64"),
    ("adaptive_not_divisible", X4, lambda x: nn.adaptive_avg_pool2d(x, (4, 4)), "divide"),
    ("batch_norm_training", X4,
     lambda x: nn.batch_norm(x, const((3,)), const((3,)), const((3,)), pos(const((3,))),
                             axis=1, training=True), "training"),
    ("batch_norm_axis", X4,
     lambda x: nn.batch_norm(x, const((6,)), const((6,)), const((6,)), pos(const((6,))),
                             axis=3, training=False), "axis"),
    ("layer_norm_leading_axes", X3,
     lambda x: nn.layer_norm(x, const((2,)), const((2,)), axes=[0]), "trailing"),
    ("layer_norm_no_scale", X3,
     lambda x: nn.layer_norm(x, const((8,)), const((8,)), axes=[-1], scale=False), "scale"),
    ("max_pool_ceil_window_in_padding", [((1, 1, 8, 8), F32)],
     lambda x: nn.max_pool2d(x, 1, strides=3, dilation=2, ceil_mode=True), "ceil_mode"),
    ("avg_pool_ceil_count_include_pad", [((1, 1, 8, 8), F32)],
     lambda x: nn.avg_pool2d(x, 3, strides=2, padding=1, ceil_mode=True,
                             count_include_pad=True), "count_include_pad"),
    ("empty_slice", X4,
     lambda x: op.strided_slice(x, axes=[2], begin=[4], end=[2]), "empty shape"),
    ("avg_pool_nhwc", [((1, 8, 8, 3), F32)],
     lambda x: nn.avg_pool2d(x, 2, layout="NHWC"), "NHWC"),
    ("matmul_int", [((2, 3), "int64"), ((3, 2), "int64")], lambda x, y: op.matmul(x, y),
     "int64"),
])
def test_unsupported_reasons(name, specs, build, fragment):
    func = function(specs, build)
    value = func.body.blocks[0].bindings[-1].value
    if isinstance(value, relax.TupleGetItem) or not isinstance(value, relax.Call):
        value = func.body.blocks[0].bindings[-2].value
    reason = unsupported_reason(value)
    assert reason and fragment in reason, reason
    with pytest.raises(ExportError, match=fragment):
        export_function(func)


def test_dynamic_shape_is_unsupported():
    n = tvm.tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType((n, 4), F32))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            gv = bb.emit_output(nn.relu(x))
        bb.emit_func_output(gv)
    func = bb.get()["main"]
    assert "static shape" in unsupported_reason(func.body.blocks[0].bindings[0].value)
    with pytest.raises(ExportError, match="static shape"):
        export_function(func)


# ---------------------------------------------------------------------------------------
# whole models
# ---------------------------------------------------------------------------------------
def _assert_every_node_exports(func):
    """What the pattern rule and the lowering see: single nodes cut out of the model."""
    from collage_tvm.graph.dataflow import DataflowGraph
    from collage_tvm.graph.subgraph import extract_function

    graph = DataflowGraph(func)
    for node in graph.nodes:
        assert unsupported_reason(node.value) is None, (node, unsupported_reason(node.value))
        if node.call is not None:
            sub = extract_function(graph, [node.index])[0]
            onnx.checker.check_model(export_function(sub))


def test_resnet_small_from_onnx(tmp_path):
    from collage_tvm.frontend.load import load_model, normalize_for_collage
    from collage_tvm.tools.zoo import export_onnx

    path = export_onnx("resnet_small", str(tmp_path / "resnet_small.onnx"))
    func = normalize_for_collage(load_model(path))["main"]
    model = check(func, openvino=True, rtol=1e-4, atol=1e-4)
    assert {"Conv", "MaxPool", "MatMul"} <= {n.op_type for n in model.graph.node}
    _assert_every_node_exports(func)


def test_transformer_encoder_layer_from_torch():
    torch = pytest.importorskip("torch")
    from collage_tvm.frontend.load import load_model, normalize_for_collage

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, batch_first=True,
                                             dropout=0.0).eval()
    x = torch.randn(1, 16, 64)
    func = normalize_for_collage(load_model(layer, (x,)))["main"]
    model = check(func, openvino=True, rtol=1e-4, atol=1e-4, inputs=[x.numpy()])
    assert {"LayerNormalization", "Softmax", "MatMul"} <= {n.op_type for n in model.graph.node}
    with torch.no_grad():
        np.testing.assert_allclose(run_ort(model, [x.numpy()])[0], layer(x).numpy(),
                                   rtol=1e-4, atol=1e-4)
    _assert_every_node_exports(func)
