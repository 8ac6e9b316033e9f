"""Models with dynamic dimensions (issue #77): one build serves every shape of a range."""
import importlib
import json
import math

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import tvm
from onnx import TensorProto, helper
from tvm import relax

import collage_tvm
from collage_tvm.dynamic import ShapeError, dynamic_model, parse_shapes, shape_ranges
from collage_tvm.dynamic.dispatch import Dispatch, point_key
from collage_tvm.dynamic.shapes import Axis, ShapeRanges, symbol_points
from collage_tvm.options import SearchOptions
from collage_tvm.tools.suites import matches
from collage_tvm.check.contender import records

LIBS = ["tvm", "onnxruntime", "openvino"]


def _cnn(path):
    """A small CNN exported as PyTorch's tutorial exports it: a dynamic batch axis."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 3),
                      nn.Flatten(), nn.Linear(4 * 6 * 6, 10)).eval()
    torch.onnx.export(m, (torch.randn(1, 3, 8, 8),), path, dynamo=False, opset_version=17,
                      input_names=["image"], dynamic_axes={"image": {0: "batch"}})
    return m


def _tokens(path, positions=64):
    """A transformer-shaped ONNX graph: input_ids and a mask sharing (batch, sequence), an
    embedding with a position table of ``positions`` rows."""
    rng = np.random.default_rng(0)
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT,
                                         ["batch", "sequence"])
    out = helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", "sequence", 16])
    inits = [onnx.numpy_helper.from_array(rng.standard_normal((50, 16)).astype("float32"),
                                          "word_embeddings.weight"),
             onnx.numpy_helper.from_array(rng.standard_normal((positions, 16)).astype("float32"),
                                          "position_embeddings.weight"),
             onnx.numpy_helper.from_array(rng.standard_normal((16, 16)).astype("float32"), "w"),
             onnx.numpy_helper.from_array(np.array([-1], "int64"), "axes")]
    nodes = [helper.make_node("Gather", ["word_embeddings.weight", "input_ids"], ["e"]),
             helper.make_node("MatMul", ["e", "w"], ["h"]),
             helper.make_node("Unsqueeze", ["attention_mask", "axes"], ["m"]),
             helper.make_node("Mul", ["h", "m"], ["hm"]),
             helper.make_node("Relu", ["hm"], ["hidden"])]
    proto = helper.make_model(helper.make_graph(nodes, "g", [ids, mask], [out], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 9
    onnx.save(proto, path)
    return proto


def _decoder(path):
    """A decoder step as Hugging Face optimum exports one: input_ids (batch, 1), an
    attention mask of ``past + 1`` positions and a cache of ``past``; the mask must be one
    longer than the cache or the model fails (the Mul's broadcast)."""
    rng = np.random.default_rng(0)
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", 1])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT,
                                         ["batch_size", "past_sequence_length + 1"])
    past = helper.make_tensor_value_info("past_key", TensorProto.FLOAT,
                                         ["batch_size", "past_sequence_length", 8])
    outs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch_size", 8]),
            helper.make_tensor_value_info("present_key", TensorProto.FLOAT,
                                          ["batch_size", "past_sequence_length + 1", 8])]
    inits = [onnx.numpy_helper.from_array(rng.standard_normal((50, 8)).astype("float32"),
                                          "wte"),
             onnx.numpy_helper.from_array(np.array([-1], "int64"), "last"),
             onnx.numpy_helper.from_array(np.array([1], "int64"), "seq")]
    nodes = [helper.make_node("Gather", ["wte", "input_ids"], ["e"]),
             helper.make_node("Concat", ["past_key", "e"], ["present_key"], axis=1),
             helper.make_node("Unsqueeze", ["attention_mask", "last"], ["m"]),
             helper.make_node("Mul", ["present_key", "m"], ["km"]),
             helper.make_node("ReduceSum", ["km", "seq"], ["logits"], keepdims=0)]
    proto = helper.make_model(helper.make_graph(nodes, "g", [ids, mask, past], outs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 9
    onnx.save(proto, path)
    return proto


# ---------------------------------------------------------------------------- ranges

def test_ranges_default_to_a_batch_of_1_to_8_and_a_sequence_up_to_the_positions(tmp_path):
    proto = _tokens(str(tmp_path / "t.onnx"), positions=64)
    ranges = shape_ranges(proto)
    assert ranges.axes["batch"] == Axis("batch", 1, 1, 8)
    assert ranges.axes["sequence"] == Axis("sequence", 1, 64, 64)  # 128 > its 64 positions
    assert ranges.given == set()
    assert ranges.opt_shapes() == {"input_ids": (1, 64), "attention_mask": (1, 64)}
    assert "[default]" in ranges.describe()
    assert "--shapes input_ids=1x1:1x64:8x64" in ranges.flags()
    proto.graph.initializer[1].name = "transformer.wpe.weight"  # (GPT-2's name for it)
    assert shape_ranges(proto).axes["sequence"] == Axis("sequence", 1, 64, 64)
    proto.graph.initializer[1].name = "transformer.wpet"
    assert shape_ranges(proto).axes["sequence"] == Axis("sequence", 1, 128, 512)
    path = str(tmp_path / "cnn.onnx")
    _cnn(path)
    cnn = shape_ranges(onnx.load(path))
    assert cnn.axes == {"batch": Axis("batch", 1, 1, 8)}
    assert cnn.opt_shapes() == {"image": (1, 3, 8, 8)}


def test_a_sequence_first_export_gets_a_sequence_range_on_axis_0():
    """nn.Transformer without batch_first exports (sequence, batch, width): axis 0 named as a
    length is a sequence, not a batch of 1 to 8."""
    x = helper.make_tensor_value_info("src", TensorProto.FLOAT, ["src_len", "batch", 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["src_len", "batch", 16])
    proto = helper.make_model(helper.make_graph([helper.make_node("Relu", ["src"], ["y"])],
                                                "g", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    ranges = shape_ranges(proto)
    assert ranges.axes["src_len"] == Axis("src_len", 1, 128, 512)
    assert ranges.axes["batch"] == Axis("batch", 1, 1, 8)
    # torch's names for a dynamic axis given by index: axis 0 the batch
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "src_dynamic_axes_1"
    assert shape_ranges(proto).axes["src_dynamic_axes_1"] == Axis("src_dynamic_axes_1", 1, 1, 8)


def test_a_dimension_named_by_an_expression_over_axes_follows_them(tmp_path):
    from collage_tvm.dynamic.shapes import derived_dims

    proto = _decoder(str(tmp_path / "d.onnx"))
    r = shape_ranges(proto)
    assert set(r.axes) == {"batch_size", "past_sequence_length"}  # not an axis of its own
    assert r.axes["past_sequence_length"] == Axis("past_sequence_length", 0, 128, 512)
    assert r.opt_shapes() == {"input_ids": (1, 1), "attention_mask": (1, 129),
                              "past_key": (1, 128, 8)}
    assert all(s["attention_mask"][1] == s["past_key"][1] + 1
               for s in map(r.shapes, r.points()))
    assert r.point_of([(2, 1), (2, 9), (2, 8, 8)]) == {"batch_size": 2,
                                                       "past_sequence_length": 8}
    with pytest.raises(ShapeError, match=r"attention_mask: dimension 1 is past_sequence_len"
                                         r"gth \+ 1, 9 with the other inputs' sizes"):
        r.point_of([(2, 1), (2, 8), (2, 8, 8)])
    assert "attention_mask=1x1:1x129:8x513" in r.flags()
    assert set(ShapeRanges.from_json(r.to_json()).derived) == {"past_sequence_length + 1"}
    given = shape_ranges(proto, parse_shapes(["past_key=1x1x8:1x16x8:2x64x8"]))
    assert given.opt_shapes()["attention_mask"] == (1, 17)
    assert shape_ranges(proto, parse_shapes(["attention_mask=1x2:1x17:2x65",
                                             "past_key=1x1x8:1x16x8:2x64x8"])).axes == given.axes
    with pytest.raises(ShapeError, match="give the range of past_sequence_length"):
        shape_ranges(proto, parse_shapes(["attention_mask=1x2:1x17:2x65"]))
    # the dynamo exporter's sympy names; a name that is no symbol leaves the dim its own axis
    dims = derived_dims([("a", "f", ["s0", "s1"]),
                         ("b", "f", ["s0 + s1", "2*s0", "floor(s1/2)", "Max(1, s0 - 3)",
                                     "batch-size", "s0 + t", "s0", 4])])
    assert set(dims) == {"s0 + s1", "2*s0", "floor(s1/2)", "Max(1, s0 - 3)"}
    assert [dims[t]({"s0": 5, "s1": 7}) for t in ("s0 + s1", "2*s0", "floor(s1/2)",
                                                  "Max(1, s0 - 3)")] == [12, 10, 3, 2]


def test_given_ranges_are_checked_against_the_model(tmp_path):
    proto = _tokens(str(tmp_path / "t.onnx"))
    given = parse_shapes(["input_ids=1x8:2x32:4x64"])
    ranges = shape_ranges(proto, given)
    assert ranges.axes["sequence"] == Axis("sequence", 8, 32, 64)
    assert ranges.shapes({"batch": 3, "sequence": 9})["attention_mask"] == (3, 9)
    assert ranges.given == {"batch", "sequence"}
    with pytest.raises(ShapeError, match="names no input of the model: ids; its inputs: "
                                         "input_ids, attention_mask"):
        shape_ranges(proto, parse_shapes(["ids=1x8"]))
    with pytest.raises(ShapeError, match="needs min <= opt <= max, got 4:2:8"):
        shape_ranges(proto, parse_shapes(["input_ids=4x8:2x8:8x8"]))
    with pytest.raises(ShapeError, match="sequence is 1:8:8 here but 8:8:8 for another"):
        shape_ranges(proto, parse_shapes(["input_ids=1x8", "attention_mask=1x1:1x8:1x8"]))
    with pytest.raises(ShapeError, match="expected NAME=MIN:OPT:MAX"):
        parse_shapes(["input_ids=1x8:2x8"])
    path = str(tmp_path / "cnn.onnx")
    _cnn(path)
    with pytest.raises(ShapeError, match="dimension 1 is fixed at 3 in the model, got 4:4:4"):
        shape_ranges(onnx.load(path), parse_shapes(["image=1x4x8x8"]))
    assert SearchOptions(shapes=["image=1x3x8x8:2x3x8x8:4x3x8x8"]).shapes == (
        ("image", ((1, 3, 8, 8), (2, 3, 8, 8), (4, 3, 8, 8))),)
    assert SearchOptions(shapes={"image": (2, 3, 8, 8)}).shapes == (
        ("image", ((2, 3, 8, 8),) * 3),)


def test_an_images_dynamic_height_and_width_are_timed_at_224_and_serve_any_size(tmp_path):
    """A detector's or segmenter's export (dynamic batch, height and width): the file serves
    any image size, so the build does too; only the batch has a range it refuses beyond."""
    path = str(tmp_path / "hw.onnx")
    torch.onnx.export(nn.Conv2d(3, 4, 3, padding=1).eval(), (torch.randn(1, 3, 8, 8),), path,
                      dynamo=False, opset_version=17, input_names=["x"],
                      dynamic_axes={"x": {0: "batch", 2: "height", 3: "width"}})
    ranges = shape_ranges(onnx.load(path))
    assert ranges.axes["height"] == Axis("height", 224, 224, 224, open=True)
    assert "height any size (timed at 224) [default]" in ranges.describe()
    assert ranges.point_of([(2, 3, 640, 17)]) == {"batch": 2, "height": 640, "width": 17}
    values = {"batch": [1, 2, 4, 8], "height": [224], "width": [224]}
    assert ranges.bucket({"batch": 3, "height": 640, "width": 17}, values) == {
        "batch": 4, "height": 224, "width": 224}
    with pytest.raises(ShapeError, match=r"batch = 9 is outside.*--shapes x=1x3x224x224:"
                                         r"1x3x224x224:9x3x224x224"):
        ranges.point_of([(9, 3, 64, 64)])
    # the flag that refusal names keeps height and width open; a saved build keeps them open
    wider = shape_ranges(onnx.load(path), parse_shapes(["x=1x3x224x224:1x3x224x224:9x3x224x224"]))
    assert wider.axes["width"].open and wider.axes["batch"] == Axis("batch", 1, 1, 9)
    back = ShapeRanges.from_json(json.loads(json.dumps(ranges.to_json())))
    assert back.axes == ranges.axes
    # a size the user gives closes the axis to it
    given = shape_ranges(onnx.load(path), parse_shapes(["x=1x3x320x320:1x3x512x512:4x3x640x640"]))
    assert given.axes["height"] == Axis("height", 320, 512, 640)
    with pytest.raises(ShapeError, match="height = 1024 is outside"):
        given.point_of([(1, 3, 1024, 512)])


def test_points_cover_the_range_and_a_shape_goes_to_the_least_point_above_it():
    assert symbol_points(Axis("batch", 1, 1, 8)) == [1, 2, 4, 8]
    assert symbol_points(Axis("sequence", 1, 128, 512)) == [1, 2, 8, 32, 128, 512]
    ranges = ShapeRanges([("x", "float32", ["batch", 4])], {"batch": Axis("batch", 1, 2, 8)})
    points = ranges.points()
    assert points[0] == {"batch": 2} and len(points) == 4  # the optimum first
    values = {"batch": [1, 2, 4, 8]}
    assert [ranges.bucket({"batch": b}, values)["batch"] for b in (1, 2, 3, 5, 8)] == [
        1, 2, 4, 8, 8]
    with pytest.raises(ShapeError, match=r"batch = 9 is outside the range this build serves "
                                         r"\(1..8\).*--shapes x=1x4:2x4:9x4"):
        ranges.point_of([(9, 4)])
    with pytest.raises(ShapeError, match="dimension 1 is 4, got"):
        ranges.point_of([(2, 5)])


def test_three_axes_thin_to_the_grid_limit_keeping_each_axis_ends_and_optimum(monkeypatch):
    from collage_tvm.dynamic import search
    from collage_tvm.dynamic.shapes import MAX_GRID_POINTS, grid_values, key_point

    two = {"batch": Axis("batch", 1, 1, 8), "sequence": Axis("sequence", 1, 128, 512)}
    assert grid_values(two) == {s: symbol_points(a) for s, a in two.items()}  # (24: fits)
    # an optimum-style decoder with a cache: batch x past x sequence, 120 points in full
    axes = {"batch": Axis("batch", 1, 1, 8), "past": Axis("past", 0, 128, 256),
            "sequence": Axis("sequence", 1, 1, 256)}
    full = {s: symbol_points(a) for s, a in axes.items()}
    assert math.prod(len(v) for v in full.values()) == 120
    grid = grid_values(axes)
    assert math.prod(len(v) for v in grid.values()) <= MAX_GRID_POINTS
    for s, a in axes.items():
        assert set(grid[s]) <= set(full[s]) and {a.min, a.opt, a.max} <= set(grid[s])
        assert len(grid[s]) > 3 or s == "batch"  # (thinned, not cut to the anchors)
    ranges = ShapeRanges([("ids", "int64", ["batch", "sequence"]),
                          ("cache", "float32", ["batch", 2, "past", 4])], axes)
    points = ranges.points()
    assert len(points) == math.prod(len(v) for v in grid.values())
    assert points[0] == ranges.opt()
    # the search's boxes and the dispatch's buckets follow the same grid: a shape between
    # its points goes to the least point above it
    seen = []

    def at(point, contenders, args, accuracy):
        seen.append(point_key(point))
        lead = point["sequence"] * (point["past"] + 1) >= 64
        return {"point": point, "chose": "b" if lead else "a", "left_out": {},
                "ms": {"a": 1.3, "b": 1.0} if lead else {"a": 1.0, "b": 1.3}}

    monkeypatch.setattr(search, "_choose_at", at)

    def lib(x):
        return [x]
    lib.numpy_call = lib
    chosen = search.choose(ranges, {"a": lib, "b": lib}, collage_tvm.precision.parse_accuracy(
        "f32"))
    assert set(chosen["table"]) == {point_key(p) for p in points}
    assert len(set(seen)) == len(seen) < len(points)
    values = {s: sorted({key_point(k)[s] for k in chosen["table"]}) for s in axes}
    assert values == grid
    assert ranges.bucket({"batch": 3, "past": 5, "sequence": 1}, values) == {
        "batch": 8, "past": grid["past"][next(i for i, v in enumerate(grid["past"]) if v >= 5)],
        "sequence": 1}


def test_the_dispatch_sends_each_shape_to_its_points_choice_and_the_optimum_to_the_special():
    ranges = ShapeRanges([("x", "float32", ["batch", 2])], {"batch": Axis("batch", 1, 2, 8)})
    calls = []

    def fn(label):
        def call(*args):
            calls.append(label)
            return label
        call.numpy_call = call
        return call

    table = {"batch=1": "a", "batch=2": "a", "batch=4": "b", "batch=8": "b"}
    d = Dispatch(ranges, table, {"a": fn("a"), "b": fn("b")}, special=({"batch": 2}, fn("s")))
    got = [d.numpy_call(np.zeros((b, 2), "float32")) for b in (1, 2, 3, 4, 7, 8)]
    assert got == ["a", "s", "b", "b", "b", "b"]
    assert d.label_for([(2, 2)]) == "collage" and d.label_for([(5, 2)]) == "b"
    with pytest.raises(ShapeError, match="outside the range"):
        d.numpy_call(np.zeros((9, 2), "float32"))


def test_a_calls_exact_shapes_go_to_the_fixed_contender_once_it_is_made():
    from collage_tvm.check.race import Making

    ranges = ShapeRanges([("x", "float32", ["batch", 2])], {"batch": Axis("batch", 1, 1, 8)})

    def fn(label):
        def call(*args):
            return label
        call.numpy_call = call
        return call

    gate = __import__("threading").Event()

    def make():
        gate.wait(30)
        return fn("fixed4")

    table = {"batch=1": "a", "batch=2": "a", "batch=4": "b", "batch=8": "b"}
    fixed = Making(make)
    d = Dispatch(ranges, table, {"a": fn("a"), "b": fn("b")},
                 exact={"batch=4": ("openvino", fixed), "batch=1": ("openvino", fn("fixed1"))})
    assert d.making_at([(4, 2)]) is fixed and d.making_at([(3, 2)]) is None
    # while it is made, the table's choice serves its point (and nothing is kept)
    assert d.numpy_call(np.zeros((4, 2), "float32")) == "b"
    gate.set()
    fixed.wait(30)
    got = [d.numpy_call(np.zeros((b, 2), "float32")) for b in (1, 2, 3, 4, 5, 8)]
    assert got == ["fixed1", "a", "b", "fixed4", "b", "b"]  # exact shapes only
    assert d.label_for([(4, 2)]) == "openvino@fixed" and d.label_for([(3, 2)]) == "b"
    assert d.making_at([(4, 2)]) is None
    # one its library failed to make: the table's choice serves, from then on
    broken = Making(lambda: 1 / 0)
    broken.wait(30)
    d = Dispatch(ranges, table, {"a": fn("a"), "b": fn("b")}, exact={"batch=8": ("ov", broken)})
    assert d.numpy_call(np.zeros((8, 2), "float32")) == "b" and not d.exact


def test_fixed_contenders_serve_the_points_they_win_and_are_dropped_where_they_never_pay(
        monkeypatch):
    from collage_tvm.dynamic import search

    ranges = ShapeRanges([("x", "float32", ["batch", 2])], {"batch": Axis("batch", 1, 1, 8)})
    figures = {}  # point key -> label -> ms

    def at(point, contenders, args, accuracy):
        ms = {n: figures[point_key(point)][n] for n in contenders}
        return {"point": point, "chose": min(ms, key=ms.get), "ms": ms, "left_out": {}}

    monkeypatch.setattr(search, "_choose_at", at)
    made = []

    def maker(lib):
        def make(point):
            made.append((lib, point_key(point)))
            f = (lambda *a: [a[0]])
            f.numpy_call = f
            return f
        return make

    def lib(*a):
        return [a[0]]
    lib.numpy_call = lib
    f32 = collage_tvm.precision.parse_accuracy("f32")
    # "ov@fixed" 20% ahead at batch 1 and 8, 1% at batch 4 (too close: the session serves);
    # "slow@fixed" never ahead: tried at the first two points only
    for b, gain in ((1, 0.2), (2, 0.2), (4, 0.01), (8, 0.2)):
        figures[f"batch={b}"] = {"ort": 1.0, "ov": 1.1, "ov@fixed": 1.0 - gain,
                                 "slow@fixed": 1.5}
    chosen = search.choose(ranges, {"ort": lib, "ov": lib}, f32,
                           fixed={"ov": maker("ov"), "slow": maker("slow")})
    assert chosen["exact"] == {"batch=1": "ov", "batch=2": "ov", "batch=8": "ov"}
    assert set(chosen["table"].values()) == {"ort"}  # (every other shape: the best session)
    assert [k for lib_, k in made if lib_ == "slow"] == ["batch=1", "batch=2"]
    assert len([k for lib_, k in made if lib_ == "ov"]) == 4
    record = next(r for r in chosen["points"] if point_key(r["point"]) == "batch=4")
    assert record["chose"] == "ort"
    # at most ``max_fixed`` points keep one: those it saved most time at
    figures["batch=2"]["ov@fixed"] = 0.9
    chosen = search.choose(ranges, {"ort": lib, "ov": lib}, f32, fixed={"ov": maker("ov")},
                           max_fixed=2)
    assert chosen["exact"] == {"batch=1": "ov", "batch=8": "ov"}
    assert chosen["table"]["batch=2"] == "ort"
    # the time saved per call ranks them, not the share: 30% of 0.1 ms at batch 1 is less
    # than 15% of 1 ms at batch 8
    figures["batch=1"].update({"ort": 0.1, "ov": 0.11, "ov@fixed": 0.07})
    figures["batch=8"]["ov@fixed"] = 0.85
    chosen = search.choose(ranges, {"ort": lib, "ov": lib}, f32, fixed={"ov": maker("ov")},
                           max_fixed=1)
    assert chosen["exact"] == {"batch=8": "ov"}
    # a big model keeps fewer (each point is one more compiled copy of its weights)
    proto = helper.make_model(helper.make_graph([], "g", [], [], [onnx.numpy_helper.from_array(
        np.zeros(1000, "float32"), "w")]))
    monkeypatch.setattr(search, "FIXED_BYTES", 3 * proto.ByteSize())
    assert search._max_fixed(proto, None) == 3


# ---------------------------------------------------------------------------- builds

def _vm_run(res, *arrays):
    vm = relax.VirtualMachine(res.executable, tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
    return out.numpy() if isinstance(out, tvm.runtime.Tensor) else [o.numpy() for o in out]


def test_a_dynamic_batch_model_is_searched_and_serves_every_batch_in_its_range(tmp_path, capsys):
    path = str(tmp_path / "cnn.onnx")
    m = _cnn(path)
    db = str(tmp_path / "c.db")
    kw = dict(db=db, progress=False, graph_level=False, isolate=False,
              shapes=["image=1x3x8x8:2x3x8x8:4x3x8x8"])
    res = collage_tvm.optimize(path, "llvm", LIBS, **kw)
    d = res.report.dynamic
    assert d["ranges"]["axes"] == {"batch": [1, 2, 4]} and not d["from_log"]
    assert [p["point"]["batch"] for p in d["points"]] == [2, 1, 4]
    assert res.report.shipped.startswith("dynamic: the model file per shape")
    assert records(res.report.comparison)  # the search at the optimum ran its final check
    for b in (1, 2, 3, 4):
        x = torch.randn(b, 3, 8, 8)
        with torch.no_grad():
            assert matches([_vm_run(res, x.numpy())], [m(x).numpy()], 1e-3, 1e-4), b
    saved = collage_tvm.save(res, tmp_path / "cnn.collage")
    loaded = collage_tvm.load(saved)
    assert loaded.calls_library_directly and loaded.dispatch is not None
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        want = m(x).numpy()
    assert matches([loaded(x.numpy())], [want], 1e-3, 1e-4)
    assert matches([loaded(x).numpy()], [want], 1e-3, 1e-4)  # torch in, torch out
    with pytest.raises(ValueError, match=r"batch = 5 is outside the range this build serves "
                                         r"\(1..4\).*--shapes image=1x3x8x8:2x3x8x8:5x3x8x8"):
        loaded(np.zeros((5, 3, 8, 8), "float32"))
    with pytest.raises(ValueError, match="outside the range"):
        loaded(torch.zeros(5, 3, 8, 8))
    # where the libraries ran a point close, the first calls of each shape race them (here
    # every point said close, the manifest edited): both libraries run, the outputs stay right
    manifest = json.loads((saved / "manifest.json").read_text())
    entry = manifest["regions"][0]
    entry["close"] = {key: ["onnxruntime", "openvino"] for key in entry["table"]}
    (saved / "manifest.json").write_text(json.dumps(manifest))
    raced = collage_tvm.load(saved)
    assert raced.races == []  # nothing raced before a call
    record, = raced.settle(x.numpy())
    assert set(record["ms"]) == {"onnxruntime", "openvino"} and record["chose"] in record["ms"]
    assert raced.dispatch.label_for([x.shape]) == record["chose"]
    assert matches([raced(x.numpy())], [want], 1e-3, 1e-4)
    # decided, a numpy call of that shape goes to the chosen library's own call
    chosen = raced.dispatch.fns[record["chose"]].numpy_call
    assert raced.dispatch._numpy_by_shapes[(tuple(x.shape),)] == chosen
    assert collage_tvm.load(saved, decide=False).dispatch.race_at([x.shape]) is None
    # a point served by the file compiled for its exact shapes (OpenVINO; the manifest
    # edited): made in a thread at load, right outputs, the other shapes as before
    entry.pop("close")
    entry["exact"] = {"batch=4": "openvino"}
    manifest["backends"].setdefault("openvino", {**manifest["backends"][entry["libraries"][0]],
                                                 "version": collage_tvm.registry.get_backend(
                                                     "openvino").version()})
    (saved / "manifest.json").write_text(json.dumps(manifest))
    # ``collage-tvm show DIR``: what the saved build serves at each shape, from its manifest
    from collage_tvm.cli import main
    assert main(["show", str(saved)]) == 0
    shown = capsys.readouterr().out
    assert "ranges: batch 1..4 (opt 2)" in shown and "inputs: image float32[batch, 3, 8, 8]" in shown
    for key in entry["table"]:
        assert f"  {key}  {entry['table'][key]}" in shown
    assert "exactly batch=4: the file compiled by openvino for those shapes" in shown
    assert main(["show", str(tmp_path)]) == 2
    assert "is not a collage-tvm artifact: it has no manifest.json" in capsys.readouterr().err
    fixed = collage_tvm.load(saved)
    x4 = torch.randn(4, 3, 8, 8)
    fixed.settle(x4.numpy())
    assert fixed.dispatch.label_for([x4.shape]) == "openvino@fixed"
    assert fixed.dispatch.label_for([x.shape]) in entry["libraries"]
    with torch.no_grad():
        assert matches([fixed(x4.numpy())], [m(x4).numpy()], 1e-3, 1e-4)
        assert matches([fixed(x.numpy())], [want], 1e-3, 1e-4)
    again = collage_tvm.optimize(path, "llvm", LIBS, **kw)  # a warm rebuild
    assert again.report.placement_from_log
    if not again.report.rechecked:  # (a verdict timed beside other work is checked again)
        assert again.report.dynamic["from_log"]
        assert again.report.dynamic["points"] == d["points"]


def test_a_model_with_a_shared_batch_and_sequence_builds_and_its_saved_build_serves_them(
        tmp_path, capsys):
    import onnxruntime as ort

    from collage_tvm.cli import main

    path = str(tmp_path / "tok.onnx")
    _tokens(path, positions=32)
    out = tmp_path / "tok.collage"
    assert main(["optimize", path, "--backends", ",".join(LIBS), "--no-graph-level",
                 "--in-process", "--db", str(tmp_path / "c.db"), "--export", str(out),
                 "--shapes", "input_ids=1x1:1x8:2x32"]) == 0
    text = capsys.readouterr().out
    assert "the search at the optimum (input_ids=1x8, attention_mask=1x8)" in text
    assert "dynamic shapes: built for batch 1..2 (opt 1); sequence 1..32 (opt 8)" in text
    assert "batch=2,sequence=32" in text and "shipped: dynamic: the model file per shape" in text
    loaded = collage_tvm.load(out)
    assert loaded.input_names == ["input_ids", "attention_mask"]
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for b, s in ((1, 1), (1, 8), (2, 5), (2, 32)):
        feed = {"input_ids": rng.integers(0, 50, (b, s)).astype("int64"),
                "attention_mask": np.ones((b, s), "float32")}
        assert matches([loaded(**feed)], sess.run(None, feed), 1e-3, 1e-4), (b, s)
    with pytest.raises(ValueError, match="sequence = 33 is outside"):
        loaded(np.zeros((1, 33), "int64"), np.ones((1, 33), "float32"))
    with pytest.raises(ValueError, match="another input has sequence = 4"):
        loaded(np.zeros((1, 4), "int64"), np.ones((1, 5), "float32"))
    assert main(["run", str(out), "--bench", "2", "--warmup", "1"]) == 0
    text = capsys.readouterr().out
    assert text.count("latency over 2 runs") == len(loaded.dispatch.ranges.points())
    assert "shape batch=2,sequence=32 (served by " in text


def test_a_decoder_whose_mask_is_one_longer_than_its_cache_builds_and_serves_its_range(
        tmp_path, capsys):
    import onnxruntime as ort

    from collage_tvm.cli import main

    path = str(tmp_path / "dec.onnx")
    _decoder(path)
    out = tmp_path / "dec.collage"
    assert main(["optimize", path, "--backends", ",".join(LIBS), "--no-graph-level",
                 "--in-process", "--db", str(tmp_path / "c.db"), "--export", str(out),
                 "--shapes", "past_key=1x1x8:1x8x8:2x32x8"]) == 0
    text = capsys.readouterr().out
    assert ("the search at the optimum (input_ids=1x1, attention_mask=1x9, past_key=1x8x8)"
            in text)
    loaded = collage_tvm.load(out)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for b, p in ((1, 1), (1, 8), (2, 5), (2, 32)):
        feed = {"input_ids": rng.integers(0, 50, (b, 1)).astype("int64"),
                "attention_mask": rng.random((b, p + 1)).astype("float32"),
                "past_key": rng.standard_normal((b, p, 8)).astype("float32")}
        assert matches(list(loaded(**feed)), sess.run(None, feed), 1e-3, 1e-4), (b, p)
    with pytest.raises(ValueError, match="dimension 1 is past_sequence_length \\+ 1, 6"):
        loaded(np.zeros((1, 1), "int64"), np.ones((1, 5), "float32"),
               np.zeros((1, 5, 8), "float32"))
    assert main(["run", str(out), "--bench", "2", "--warmup", "1"]) == 0
    assert capsys.readouterr().out.count("latency over 2 runs") == len(
        loaded.dispatch.ranges.points())
    assert main(["show", str(out)]) == 0
    assert ("attention_mask float32[batch_size, past_sequence_length + 1]"
            in capsys.readouterr().out)


def test_a_dynamic_model_stays_on_tvm_only_where_no_graph_library_is_among_the_backends(
        tmp_path):
    path = str(tmp_path / "cnn.onnx")
    m = _cnn(path)
    assert dynamic_model(path) is not None
    assert dynamic_model(path, input_shapes={"image": (2, 3, 8, 8)}) is None  # static now
    res = collage_tvm.optimize(path, "llvm", ["tvm"], db=str(tmp_path / "c.db"),
                               progress=False, graph_level=False, compare=False)
    assert not res.report.dynamic and res.graph is None
    x = torch.randn(3, 3, 8, 8)
    with torch.no_grad():
        assert matches([_vm_run(res, x.numpy())], [m(x).numpy()], 1e-3, 1e-4)


def test_a_default_range_the_model_cannot_run_to_its_end_narrows_and_a_given_one_says_so(
        monkeypatch):
    from collage_tvm.dynamic import search

    monkeypatch.setattr(search, "POINT_BATCH_MS", 1.0)
    monkeypatch.setattr(search, "POINT_RUNOFF_ROUNDS", 3)

    def lib(limit):
        def call(x):
            if x.shape[0] > limit:
                raise RuntimeError(f"index {x.shape[0]} out of range")
            return [x * 2]
        call.numpy_call = call
        return call

    default = ShapeRanges([("x", "float32", ["past", 2])], {"past": Axis("past", 1, 2, 9)})
    fns = {"a": lib(8), "b": lib(3)}  # b fails from 4 on: left out there
    with pytest.raises(search.Unservable, match="at past=9 every library failed"):
        search.choose(default, fns, collage_tvm.precision.parse_accuracy("f32"))
    done = {}
    with pytest.raises(search.Unservable) as err:
        search.choose(default, fns, collage_tvm.precision.parse_accuracy("f32"), done=done)
    narrow = search.narrowed(default, err.value)
    assert narrow.axes["past"] == Axis("past", 1, 2, 8)
    timed = set(done)
    chosen = search.choose(narrow, fns, collage_tvm.precision.parse_accuracy("f32"), done=done)
    assert set(chosen["table"]) == {"past=1", "past=2", "past=4", "past=8"} <= timed | set(done)
    assert chosen["table"]["past=8"] == "a" and "b" in chosen["points"][-1]["left_out"]
    assert chosen["ranges"]["axes"]["past"] == [1, 2, 8]
    given = ShapeRanges(default.inputs, default.axes, {"past"})
    with pytest.raises(ShapeError, match="past=9 every library failed.*give the range it "
                                         "runs in with --shapes"):
        search.narrowed(given, err.value)
    # a cache's default range starts empty; where no library runs an empty one, at 1
    cache = ShapeRanges([("x", "float32", ["past", 2])], {"past": Axis("past", 0, 2, 8)})
    with pytest.raises(search.Unservable, match="at past=0 every library failed") as err:
        search.choose(cache, {"a": lib_from(1)}, collage_tvm.precision.parse_accuracy("f32"))
    assert search.narrowed(cache, err.value).axes["past"] == Axis("past", 1, 2, 8)


def test_where_the_reference_fails_as_the_model_does_another_librarys_outputs_do_not_serve(
        monkeypatch):
    from collage_tvm.dynamic import search

    monkeypatch.setattr(search, "POINT_BATCH_MS", 1.0)
    monkeypatch.setattr(search, "POINT_RUNOFF_ROUNDS", 3)

    def ort(code, limit=4):
        def call(x):
            if x.shape[0] > limit:  # (ONNX Runtime's own words, as pybind raises them)
                raise RuntimeError(f"[ONNXRuntimeError] : {code} : indices element out of "
                                   "data bounds, idx=8 must be within [-4,3]")
            return [x * 2]
        call.numpy_call = call
        return call

    ranges = ShapeRanges([("x", "float32", ["sequence", 2])],
                         {"sequence": Axis("sequence", 1, 2, 8)})
    f32 = collage_tvm.precision.parse_accuracy("f32")
    ov = lib_from(0)  # (an index past the table: zeros, no error)
    with pytest.raises(search.Unservable, match="at sequence=8 the model fails on the "
                                                "reference .ONNX Runtime.: onnxruntime"):
        search.choose(ranges, {"onnxruntime": ort("2 : INVALID_ARGUMENT"), "openvino": ov}, f32)
    # a library's own limit (not implemented there) leaves it out; the other serves
    chosen = search.choose(ranges, {"onnxruntime": ort("9 : NOT_IMPLEMENTED"), "openvino": ov},
                           f32)
    assert chosen["table"]["sequence=8"] == "openvino"


def lib_from(least):
    def call(x):
        if x.shape[0] < least:
            raise RuntimeError(f"empty: {x.shape[0]} rows")
        return [x * 2]
    call.numpy_call = call
    return call


def test_the_dynamic_suites_summary_counts_wins_and_each_frameworks_mean_over_shapes():
    from collage_tvm.tools import dynamic_suite

    def row(shape, collage, ort, ov, served):
        fws = {"collage": {"ms": collage, "match": True},
               "onnxruntime": {"ms": ort, "match": True},
               "openvino": {"ms": ov, "match": True}}
        best = min(("onnxruntime", ort), ("openvino", ov), key=lambda kv: kv[1])
        return {"model": "bert", "shape": shape, "served_by": served, "frameworks": fws,
                "best_f32": best, "vs_best_f32": best[1] / collage, "search_s": 30.0,
                "static_s": 20.0, "cold_db": True, "rebuild_s": 4.0, "rebuild_measured": False}

    rows = [row("1x8", 1.0, 1.0, 2.0, "onnxruntime"), row("1x512", 10.0, 20.0, 10.0, "openvino"),
            row("8x32", 1.0, 1.1, 1.05, "openvino"), {"model": "gpt2", "error": "export: x"}]
    s = dynamic_suite.summary(rows)
    assert s["timed"] == 3 and s["errors"] == 1 and s["below_goal"] == 0
    assert s["clear_wins"] == [("bert", "8x32", 1.05)]
    # ONNX Runtime: 1x, 2x, 1.1x Collage's time; OpenVINO 2x, 1x, 1.05x: each loses on average
    assert s["framework_mean_over_collage"]["onnxruntime"] == pytest.approx(2.2 ** (1 / 3))
    assert s["framework_mean_over_collage"]["openvino"] == pytest.approx(2.1 ** (1 / 3))
    assert s["search_over_static"] == {"bert": 1.5}
    assert s["rebuild"] == {"models": 1, "max_s": 4.0, "measured": []}
    text = dynamic_suite.markdown("transformers", rows)
    assert "inside it (from an empty cost DB): bert 1.50x" in text
    assert "took at most 4 s and measured nothing for 1 of 1 models." in text
    assert "| bert | 1x512 | openvino | 10.000 | 20.000 | 10.000 |" in text
    assert "error: export: x" in text and "1 rows beat every f32 framework by 3%" in text
    assert "OpenVINO at its default precision" not in text  # (f32 rows)
    assert "between" not in s and "between points" not in text
    # a shape between the search's points: marked, and its own line
    between = dict(row("3x100", 1.0, 0.95, 1.2, "onnxruntime"), between=True)
    s = dynamic_suite.summary(rows + [between])
    assert s["between"] == {"rows": 1, "median": 0.95, "worst": ("bert", "3x100", 0.95),
                            "below_goal": 1}
    text = dynamic_suite.markdown("transformers", rows + [between])
    assert "| bert | 3x100 (between points) | onnxruntime |" in text
    assert "next point above it), 1 rows: median 0.950x, worst 0.950x (bert 3x100)" in text
    # under a reduced budget: the rows against OpenVINO at its default precision too
    for r, default in zip(rows[:3], (0.9, 1.2, 1.0)):
        r["frameworks"]["collage"]["precision"] = "bf16"
        r["vs_openvino_default"] = default
    d = dynamic_suite.summary(rows)["vs_openvino_default"]
    assert d["rows"] == 3 and d["median"] == 1.0 and d["below_goal"] == 1
    assert d["worst"] == ("bert", "1x8", 0.9)
    assert ("Collage / OpenVINO at its default precision over 3 rows: median 1.000x, worst "
            "0.900x (bert 1x8), 1 below 0.97x.") in dynamic_suite.markdown("transformers", rows)


def test_the_decode_step_takes_eight_caches_of_one_past_length_and_batch():
    from collage_tvm.tools.dynamic_suite import dynamic_case

    case = dynamic_case("transformers", "gpt2_decode_step")
    assert len(case["names"]) == 9 and case["axes"]["past_3_value"] == {0: "batch", 2: "past"}
    assert len(case["shapes"]) == 12 and case["shapes"][-1][0] == (8, 1)
    assert {s[2] for s in case["shapes"][-1][1:]} == {512}
    # the shape between the search's points: batch 3, 100 cached positions
    assert case["between"][0] == (3, 1) and {s[:3] for s in case["between"][1:]} == {
        (3, 4, 100)}
    out = case["model"](*case["inputs"])
    assert out[0].shape == (1, 1, 1000) and out[1].shape[2] == 17  # the cache, one longer


def test_a_points_runoff_ends_once_the_rounds_settle_and_runs_on_while_they_do_not(
        monkeypatch):
    from collage_tvm.dynamic import search

    assert search.runoff_settled([1.0] * 10, [1.1] * 10)  # b slower in every round
    assert search.runoff_settled([1.0] * 10, [1.005] * 10)  # a tie: either will do
    assert not search.runoff_settled([1.0] * 4, [1.1] * 4)  # too few rounds to pair
    swing = [1.0, 1.1] * 5  # each ahead in half the rounds, 5% apart by the median
    assert not search.runoff_settled(swing, [1.05] * 10)

    def timed(batches):
        """An ``interleaved`` whose batches come from ``batches`` (name -> ms, a round)."""
        def interleaved(calls, rounds, min_ms, samples):
            for _ in range(rounds):
                for name in calls:
                    samples.setdefault(name, []).append(batches[name][len(samples[name])])
        return interleaved

    timing = importlib.import_module("collage_tvm.measure.timing")
    pair = {"ref": lambda: None, "other": lambda: None}
    monkeypatch.setattr(timing, "interleaved", timed({"ref": [2.0] * 25, "other": [1.0] * 25}))
    chose, record = search.runoff(pair, [])
    assert (chose, record["rounds"]) == ("other", search.RUNOFF_MIN)
    unsure = {"ref": [1.0, 1.1] * 13, "other": [1.05] * 26}
    monkeypatch.setattr(timing, "interleaved", timed(unsure))
    chose, record = search.runoff(pair, [])
    assert record["rounds"] == search.POINT_RUNOFF_ROUNDS
    assert chose == "ref"  # no lead beyond the margin: the first stays


def test_points_inside_a_box_one_library_won_clearly_go_to_it_untimed(monkeypatch):
    from collage_tvm.dynamic import search
    from collage_tvm.dynamic.weights import expected_ms

    ranges = ShapeRanges([("x", "float32", ["batch", "seq"])],
                         {"batch": Axis("batch", 1, 1, 8), "seq": Axis("seq", 1, 16, 64)})
    todo = ranges.points()
    assert len(todo) == 16 > search.CORNERS_FROM
    corner_keys = {"batch=1,seq=16", "batch=1,seq=1", "batch=1,seq=64", "batch=8,seq=1",
                   "batch=8,seq=64"}
    timed = []

    def at(point, contenders, args, accuracy, lead, load):
        timed.append(point_key(point))
        slow = 1.0 + lead(point)
        return {"point": point, "chose": "a" if slow > 1 else "b",
                "ms": {"a": 1.0, "b": slow} if slow > 1 else {"a": 2.0 - slow, "b": 1.0},
                "left_out": {}, "other_load": load(point)}

    def lib(x):
        return [x]
    lib.numpy_call = lib
    fns = {"a": lib, "b": lib}
    f32 = collage_tvm.precision.parse_accuracy("f32")

    def run(lead, load=lambda q: 0.0, **kw):
        timed.clear()
        monkeypatch.setattr(search, "_choose_at",
                            lambda p, c, a, acc: at(p, c, a, acc, lead, load))
        return search.choose(ranges, fns, f32, **kw)

    # "a" leads by 30% at every corner: the 11 points between are its, untimed
    chosen = run(lambda q: 0.3)
    assert timed[0] == "batch=1,seq=16"  # (the optimum first: the static build is timed there)
    assert set(timed) == corner_keys and len(timed) == len(corner_keys)
    assert [point_key(r["point"]) for r in chosen["points"]] == [point_key(p) for p in todo]
    assert set(chosen["table"].values()) == {"a"}
    assert sum(bool(r.get("inferred")) for r in chosen["points"]) == len(todo) - len(timed)
    over = expected_ms(ranges, chosen, None)
    assert over["over"] == f"the {len(timed)} points timed, equally weighted"
    assert over["ms"]["collage"] == 1.0
    # a lead under CORNER_LEAD at one corner: the boxes around it are timed, not the rest
    chosen = run(lambda q: 0.05 if q == {"batch": 8, "seq": 64} else 0.3)
    assert "batch=8,seq=64" in timed and corner_keys < set(timed)
    assert len(set(timed)) == len(timed) < len(todo)  # (none timed twice)
    assert set(chosen["table"].values()) == {"a"}
    # a corner timed while other processes took the CPU vouches for nothing: its boxes are
    # timed, as where its lead was small
    from collage_tvm.measure.other_load import BUSY_SHARE
    chosen = run(lambda q: 0.3,
                 load=lambda q: 2 * BUSY_SHARE if q == {"batch": 1, "seq": 1} else 0.01)
    assert corner_keys < set(timed) and len(set(timed)) == len(timed) < len(todo)
    assert "batch=2,seq=1" in timed and "batch=8,seq=16" not in timed
    run(lambda q: 0.3, load=lambda q: None)  # (no figure: /proc/stat unread)
    assert set(timed) == corner_keys
    # one crossover (b ahead from batch x seq = T on, a below it): every point gets the
    # library that is faster there, most of them untimed
    for threshold in (2, 16, 64, 128, 256, 512):
        chosen = run(lambda q: -0.3 if q["batch"] * q["seq"] >= threshold else 0.3)
        truth = {point_key(p): "b" if p["batch"] * p["seq"] >= threshold else "a"
                 for p in todo}
        assert chosen["table"] == truth, threshold
        assert len(set(timed)) == len(timed) < len(todo), threshold
        for r in chosen["points"]:
            assert bool(r.get("inferred")) == (point_key(r["point"]) not in timed)
    # observed shape weights: nothing inferred
    run(lambda q: 0.3, infer=False)
    assert len(timed) == len(todo)


def test_a_point_timed_beside_other_work_is_timed_again(monkeypatch):
    from collage_tvm.dynamic import search
    from collage_tvm.measure import other_load

    shares = iter([0.6, 0.02])

    def exit_(self, *exc):
        self.share = next(shares)

    monkeypatch.setattr(other_load.OtherLoad, "__exit__", exit_)
    monkeypatch.setattr(search, "BUSY_WAIT_S", 0.0)
    timed = []

    def at(point, contenders, args, accuracy):
        timed.append(dict(contenders))
        contenders.pop("b")  # (a contender left out at the first timing is back at the next)
        return {"point": point, "chose": "a", "ms": {"a": 1.0}, "left_out": {}}

    monkeypatch.setattr(search, "_timed_at", at)
    record = search._choose_at({"batch": 1}, {"a": 1, "b": 2}, [], "f32")
    assert len(timed) == 2 and set(timed[1]) == {"a", "b"}
    assert record["busy_before"] == 0.6 and record["other_load"] == 0.02
