"""Observed shapes with counts (issue #77, part 2: ``--shape-weights``): read from a file,
they widen the default ranges, put the optimum at the heaviest point, and weigh the
report's expected cost per call."""
import json

import pytest

import collage_tvm
from collage_tvm.dynamic import ShapeError, shape_ranges
from collage_tvm.dynamic.shapes import Axis
from collage_tvm.dynamic.weights import (ShapeWeights, expected_ms, observed_points,
                                         read_shape_weights, weighted_ranges)
from collage_tvm.options import SearchOptions

from test_dynamic import LIBS, _cnn, _tokens


def test_a_text_file_of_observed_shapes_with_counts_is_read_and_merged(tmp_path):
    f = tmp_path / "seen.txt"
    f.write_text("# what the server saw last week\ninput_ids=4x37 120\n"
                 "input_ids=1x128,attention_mask=1x128 900\ninput_ids=4x37 30\n"
                 "input_ids=2x16\n")
    w = read_shape_weights(str(f))
    got = dict(w.observed)
    assert got[(("input_ids", (4, 37)),)] == 150.0
    assert got[(("attention_mask", (1, 128)), ("input_ids", (1, 128)))] == 900.0
    assert got[(("input_ids", (2, 16)),)] == 1.0
    assert w.calls == 1051 and str(f) in w.describe() and "3 observed shapes" in w.describe()


def test_json_dicts_and_lists_are_observations_too(tmp_path):
    f = tmp_path / "seen.json"
    f.write_text(json.dumps({"input_ids=4x37": 3, "input_ids=1x8": 1}))
    assert dict(read_shape_weights(f).observed)[(("input_ids", (4, 37)),)] == 3
    listed = read_shape_weights(["input_ids=1x8", "input_ids=1x8", "input_ids=2x8"])
    assert dict(listed.observed)[(("input_ids", (1, 8)),)] == 2
    assert read_shape_weights(None) is None
    assert SearchOptions(shape_weights={"x=1x3": 2}).shape_weights.calls == 2


@pytest.mark.parametrize("text, match", [
    ("input_ids=4x37 many\n", r"line 1: the count 'many' is not a number"),
    ("input_ids=4x37 1 2\n", r"line 1: expected NAME=SHAPE"),
    ("\n\ninput_ids\n", r"line 3: 'input_ids' is not an observed shape"),
    ("input_ids=1x1:1x8:2x8\n", r"one shape, not a range"),
    ("input_ids=1x8 0\n", r"no observed shape with a count above 0"),
])
def test_a_bad_line_is_named(tmp_path, text, match):
    f = tmp_path / "seen.txt"
    f.write_text(text)
    with pytest.raises(ShapeError, match=match):
        read_shape_weights(str(f))
    with pytest.raises(ShapeError, match="cannot read it"):
        read_shape_weights(str(tmp_path / "missing.txt"))


def test_default_axes_widen_to_what_was_seen_and_the_optimum_is_the_heaviest(tmp_path):
    proto = _tokens(str(tmp_path / "t.onnx"), positions=64)
    ranges = shape_ranges(proto)  # batch 1..8 (opt 1), sequence 1..64 (opt 64)
    w = read_shape_weights({"input_ids=16x20": 5, "input_ids=2x32": 50, "input_ids=1x8": 10})
    out = weighted_ranges(ranges, w)
    assert out.axes["batch"] == Axis("batch", 1, 2, 16)
    assert out.axes["sequence"] == Axis("sequence", 1, 32, 64)
    # an axis the user gave stays; a size seen outside it is named
    given = shape_ranges(proto, {"input_ids": ((1, 1), (1, 8), (4, 64))})
    with pytest.raises(ShapeError, match=r"batch = 16 is outside the range given \(1..4\)"):
        weighted_ranges(given, w)
    with pytest.raises(ShapeError, match="has no input 'pixels'"):
        observed_points(ranges, read_shape_weights({"pixels=1x3": 1}))
    with pytest.raises(ShapeError, match="sequence is 9 and 8"):
        observed_points(ranges, read_shape_weights({"input_ids=1x8,attention_mask=1x9": 1}))
    # as optimize reads them
    from collage_tvm.build import _ranges

    _, _, ranges2 = _ranges(str(tmp_path / "t.onnx"), SearchOptions(shape_weights=w), None)
    assert ranges2.axes == out.axes


def test_the_expected_cost_weighs_each_observation_at_its_bucket(tmp_path):
    proto = _tokens(str(tmp_path / "t.onnx"), positions=64)
    ranges = shape_ranges(proto, {"input_ids": ((1, 8), (1, 8), (2, 8))})  # batch 1..2
    chosen = {"points": [{"point": {"batch": 1, "sequence": 8}, "chose": "collage",
                          "ms": {"onnxruntime": 1.0, "openvino": 2.0, "collage": 0.5}},
                         {"point": {"batch": 2, "sequence": 8}, "chose": "openvino",
                          "ms": {"onnxruntime": 4.0, "openvino": 3.0}}],
              "table": {"batch=1,sequence=8": "onnxruntime", "batch=2,sequence=8": "openvino"},
              "special": {"batch": 1, "sequence": 8}}
    plain = expected_ms(ranges, chosen, None)
    assert plain["over"] == "the 2 points, equally weighted"
    assert plain["ms"] == {"collage": 1.75, "onnxruntime": 2.5, "openvino": 2.5}
    w = ShapeWeights(((((("input_ids", (1, 8)),), 3.0), ((("input_ids", (2, 8)),), 1.0))))
    got = expected_ms(ranges, chosen, w)
    assert got["ms"] == {"collage": (3 * 0.5 + 3.0) / 4, "onnxruntime": (3 + 4) / 4,
                         "openvino": (6 + 3) / 4}
    assert "4 calls" in got["over"]


def test_optimize_with_observed_shapes_searches_at_the_heaviest_and_reports_the_expected_cost(
        tmp_path, capsys):
    from collage_tvm.cli import main

    path = str(tmp_path / "cnn.onnx")
    _cnn(path)
    seen = tmp_path / "seen.txt"
    seen.write_text("image=2x3x8x8 40\nimage=1x3x8x8 10\nimage=12x3x8x8 1\n")
    assert main(["optimize", path, "--backends", ",".join(LIBS), "--no-graph-level",
                 "--in-process", "--db", str(tmp_path / "c.db"), "--shape-weights",
                 str(seen), "--export", str(tmp_path / "cnn.collage")]) == 0
    text = capsys.readouterr().out
    assert "batch 1..12 (opt 2)" in text
    assert "the search at the optimum (image=2x3x8x8)" in text
    assert "expected per call over 3 observed shapes (51 calls" in text
    loaded = collage_tvm.load(tmp_path / "cnn.collage")
    import numpy as np

    assert loaded(np.zeros((12, 3, 8, 8), "float32")).shape == (12, 10)
