"""raise_call_tir: the importer's call_tir PrimFuncs of ordinary ONNX ops become Relax ops
(issue #33), so graph libraries can take every node of a ReLU6 network."""
import numpy as np
import pytest
import tvm
from tvm import relax, te, topi

from collage_tvm.frontend import load_model, normalize_for_collage
from collage_tvm.frontend.raise_tir import raise_call_tir
from collage_tvm.graph import DataflowGraph
from collage_tvm.placement import valid_nodes
from collage_tvm.registry import get_backend

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

_RNG = np.random.default_rng(0)


def _model(nodes, shape, out_shape, inits=()):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(out_shape))
    inits = [numpy_helper.from_array(np.asarray(a), name) for name, a in inits]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10  # what onnxruntime reads
    return model


def _import(model):
    return normalize_for_collage(load_model(model))


def _bindings(mod):
    (block,) = mod["main"].body.blocks  # still one dataflow block
    return [b.value for b in block.bindings]


def _ops(mod):
    """Op names of main's bindings; a call_tir as "call_tir <PrimFunc>"."""
    return [f"call_tir {v.args[0].name_hint}" if v.op.name == "relax.call_tir" else v.op.name
            for v in _bindings(mod)]


def _run_tvm(mod, x):
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def _run_ort(model, x):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def _bounds(lo, hi):
    return [("lo", np.array(lo, "float32")), ("hi", np.array(hi, "float32"))]


def test_relu6_clip_becomes_one_clip_equal_to_onnxruntime():
    model = _model([helper.make_node("Clip", ["x", "lo", "hi"], ["y"])], (2, 3, 8, 8),
                   (2, 3, 8, 8), _bounds(0.0, 6.0))
    mod = _import(model)
    assert _ops(mod) == ["relax.clip"]
    clip = _bindings(mod)[0]
    assert [float(clip.args[i].value) for i in (1, 2)] == [0.0, 6.0]
    assert [gv.name_hint for gv in mod.get_global_vars()] == ["main"]  # PrimFuncs dropped
    x = (_RNG.standard_normal((2, 3, 8, 8)) * 8).astype("float32")  # both bounds crossed
    np.testing.assert_array_equal(_run_tvm(mod, x), _run_ort(model, x))


def test_clip_with_only_a_min_bound_becomes_maximum():
    model = _model([helper.make_node("Clip", ["x", "lo", ""], ["y"])], (4, 5), (4, 5),
                   [("lo", np.array(-0.5, "float32"))])
    mod = _import(model)
    assert _ops(mod) == ["relax.maximum"]
    assert get_backend("onnxruntime").rules[0].valid_op(DataflowGraph.from_module(mod).nodes[0])
    x = _RNG.standard_normal((4, 5)).astype("float32")
    np.testing.assert_array_equal(_run_tvm(mod, x), _run_ort(model, x))


def test_clip_with_min_above_max_is_not_one_clip():
    # ONNX Clip gives max there, R.clip its min: the two ops stay, and agree with onnxruntime
    model = _model([helper.make_node("Clip", ["x", "lo", "hi"], ["y"])], (3, 4), (3, 4),
                   _bounds(1.0, -1.0))
    mod = _import(model)
    assert _ops(mod) == ["relax.maximum", "relax.minimum"]
    x = _RNG.standard_normal((3, 4)).astype("float32")
    np.testing.assert_array_equal(_run_tvm(mod, x), _run_ort(model, x))


def test_pads_and_tile_become_relax_ops_equal_to_onnxruntime():
    shape = (1, 2, 5, 5)
    nodes = [helper.make_node("Pad", ["x", "pads", "value"], ["p"], mode="constant"),
             helper.make_node("Pad", ["p", "zero"], ["e"], mode="edge"),
             helper.make_node("Pad", ["e", "none"], ["n"]),  # pads nothing: a copy
             helper.make_node("Tile", ["n", "reps"], ["y"])]
    model = _model(nodes, shape, (1, 4, 8, 9), [
        ("pads", np.array([0, 0, 1, 2, 0, 0, 2, 1], "int64")),
        ("value", np.array(0.5, "float32")),
        ("zero", np.array([0, 0, 0, 1, 0, 0, 0, 0], "int64")),
        ("none", np.zeros(8, "int64")),
        ("reps", np.array([1, 2, 1, 1], "int64"))])
    mod = _import(model)
    assert _ops(mod) == ["relax.nn.pad"] * 3 + ["relax.tile"]
    assert [b.attrs.pad_mode for b in _bindings(mod)[:3]] == ["constant", "replicate",
                                                               "constant"]
    x = _RNG.standard_normal(shape).astype("float32")
    np.testing.assert_array_equal(_run_tvm(mod, x), _run_ort(model, x))


def _custom_call_tir_module(name, compute):
    """main(x) = call_tir of a PrimFunc ``name`` computing ``compute(x, c)`` (c a constant
    scalar), the way the importer's ``emit_te`` writes one."""
    x = relax.Var("x", relax.TensorType((2, 3), "float32"))
    c = relax.const(np.array(2.0, "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.call_te(compute, x, c, primfunc_name_hint=name))
        bb.emit_func_output(out)
    return bb.get()


def test_call_tir_named_maximum_computing_something_else_is_left_and_builds():
    add = lambda a, b: te.compute(a.shape, lambda i, j: a[i, j] + b[()], name="T_maximum")
    mod = normalize_for_collage(_custom_call_tir_module("maximum", add))
    assert _ops(mod) == ["call_tir maximum"]  # the name alone does not raise it
    x = _RNG.standard_normal((2, 3)).astype("float32")
    np.testing.assert_allclose(_run_tvm(mod, x), x + 2.0)


def test_unknown_call_tir_is_left_untouched():
    mod = _custom_call_tir_module("einsum", lambda a, b: topi.einsum("ij,->ij", a, b))
    tvm.ir.assert_structural_equal(raise_call_tir(mod), mod)
    x = _RNG.standard_normal((2, 3)).astype("float32")
    np.testing.assert_allclose(_run_tvm(normalize_for_collage(mod), x), x * 2.0, rtol=1e-6)


def test_mobilenet_like_conv_relu6_block_is_valid_for_onnxruntime_everywhere():
    """An inverted-residual block as torchvision's MobileNetV2 exports it: 1x1 expand conv,
    ReLU6 (Clip), 3x3 depthwise conv, ReLU6, 1x1 project conv, residual add."""
    c, e = 4, 8
    w = lambda *s: (_RNG.standard_normal(s) * 0.3).astype("float32")
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"]),
             helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], group=e, pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c2", "lo", "hi"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"]),
             helper.make_node("Add", ["x", "c3"], ["y"])]
    model = _model(nodes, (1, c, 8, 8), (1, c, 8, 8), [
        ("w1", w(e, c, 1, 1)), ("b1", w(e)), ("w2", w(e, 1, 3, 3)), ("b2", w(e)),
        ("w3", w(c, e, 1, 1)), ("b3", w(c)), *_bounds(0.0, 6.0)])
    mod = _import(model)
    assert not [op for op in _ops(mod) if "call_tir" in op]
    assert _ops(mod).count("relax.clip") == 2
    graph = DataflowGraph.from_module(mod)
    assert valid_nodes(graph, get_backend("onnxruntime")) == set(range(len(graph)))
