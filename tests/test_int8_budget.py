"""int8 as a precision under the user's budget (issue #78, part 3: ``--accuracy int8``):
Collage quantizes the f32 model itself (ONNX Runtime's ``quantize_static``, QDQ), leaves
the operators that break the budget in float, and ships the quantized build only where it
is within the budget and faster than the float one."""
import re

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn

from collage_tvm import quantize as q
from collage_tvm.precision import parse_accuracy, quantized_ops


def _cnn(path, seed=0):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                      nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 3),
                      nn.Flatten(), nn.Linear(8 * 14 * 14, 10)).eval()
    torch.onnx.export(m, (torch.randn(1, 3, 16, 16),), path, dynamo=False, opset_version=17,
                      input_names=["x"])
    return m


def test_int8_budgets_parse_and_allow_bf16_regions_too():
    a = parse_accuracy("int8")
    assert a.quantizes and a.tolerance == q.INT8_TOLERANCE and a.allows("bf16")
    b = parse_accuracy("int8:0.02")
    assert b.quantizes and b.tolerance == 0.02 and str(b) == "int8:0.02"
    assert not parse_accuracy("bf16").quantizes and not parse_accuracy("int8-model").quantizes


def test_the_model_collage_quantized_may_run_its_float_parts_in_bf16_a_users_file_not():
    from collage_tvm.build import int8_contender_budget
    from collage_tvm.precision import INT8_MODEL, int8_model_budget

    ours = int8_contender_budget(parse_accuracy("int8"))
    assert ours.name == INT8_MODEL and ours.allows("bf16") and "bf16" in ours.why
    users = int8_model_budget()  # a QDQ file built with no flags: f32 beyond its int8 layers
    assert users.name == INT8_MODEL and not users.allows("bf16")
    assert ours.key() != users.key()  # (their placements are logged apart)
    tight = int8_contender_budget(parse_accuracy("int8:0.005"))  # below bf16's floor
    assert not tight.allows("bf16") and "bf16" not in tight.why
    with pytest.raises(ValueError, match="int8:TOL, TOL in"):
        parse_accuracy("int8:2")


def test_calibration_inputs_are_read_stacked_or_single_and_checked(tmp_path):
    specs = [("x", "float32", (1, 3, 16, 16))]
    feeds, source = q.calibration_feeds(specs)
    assert len(feeds) == q.CALIBRATION_SAMPLES and "random inputs" in source
    stacked = tmp_path / "c.npz"
    np.savez(stacked, x=np.ones((5, 1, 3, 16, 16), "float32"))
    feeds, source = q.calibration_feeds(specs, stacked)
    assert len(feeds) == 5 and feeds[0]["x"].shape == (1, 3, 16, 16) and "5 inputs" in source
    single = tmp_path / "one.npz"
    np.savez(single, x=np.ones((1, 3, 16, 16), "float32"))
    assert len(q.calibration_feeds(specs, single)[0]) == 1
    np.savez(tmp_path / "other.npz", y=np.ones((1, 3, 16, 16), "float32"))
    with pytest.raises(q.QuantizeError, match=r"no array for input\(s\) x \(it has y\)"):
        q.calibration_feeds(specs, tmp_path / "other.npz")
    np.savez(tmp_path / "bad.npz", x=np.ones((2, 3, 8, 8), "float32"))
    with pytest.raises(q.QuantizeError, match=r"input x is \[2, 3, 8, 8\], expected"):
        q.calibration_feeds(specs, tmp_path / "bad.npz")


def test_the_accuracy_control_leaves_the_worst_operators_in_float_until_within_budget(tmp_path):
    path = str(tmp_path / "cnn.onnx")
    _cnn(path)
    proto = onnx.load(path)
    specs = q.input_specs(proto)
    feeds, _ = q.calibration_feeds(specs)
    validation = feeds + q.random_feeds(specs, q.VALIDATION_SEEDS)
    whole = q.controlled(proto, feeds, validation, 0.5, hint=False)  # wide: all int8
    assert whole["excluded"] == [] and whole["quantizable"] == 4
    assert quantized_ops(whole["model"]).get("QuantizeLinear")
    full_err = whole["error"]
    assert 0 < full_err < 0.5
    # a budget below the whole model's error: operators go back to float, worst first, and
    # the result is within it (the fewest that fit, found by halving)
    tight = q.controlled(proto, feeds, validation, full_err * 0.9, hint=False)
    assert tight["error"] <= full_err * 0.9 and 1 <= len(tight["excluded"]) <= 4
    assert [k for k, _ in tight["tries"]][:2] == [0, 1]
    names = {n.name for n in q.named(proto).graph.node}
    assert set(tight["excluded"]) <= names
    got = q.outputs_on(tight["model"], validation)
    assert q.error(got, q.outputs_on(q.named(proto), validation)) == pytest.approx(
        tight["error"])
    ranked = q.local_errors(q.named(proto), whole["model"], validation[:2])
    assert len(ranked) == 4 and ranked[0][1] >= ranked[-1][1]


def test_where_the_error_is_outside_the_convolutions_only_they_are_quantized(tmp_path):
    """Products of activations (a SiLU, a square) quantized break the budget whatever the
    convolutions do: the control then quantizes the convolutions alone, and leaving them in
    float reaches the f32 model (efficientnet_b0 stayed 1e-1 off with all 82 in float)."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.d = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 1)

        def forward(self, x):
            y = self.c(x)
            z = y * torch.sigmoid(y)
            return self.d(z * z)

    torch.manual_seed(0)
    path = str(tmp_path / "silu.onnx")
    torch.onnx.export(Model().eval(), (torch.randn(1, 3, 16, 16),), path, dynamo=False,
                      opset_version=17, input_names=["x"])
    proto = onnx.load(path)
    specs = q.input_specs(proto)
    feeds, _ = q.calibration_feeds(specs)
    validation = feeds + q.random_feeds(specs, q.VALIDATION_SEEDS)
    first = q.controlled(proto, feeds, validation, 0.5, hint=False)
    assert not first["compute_only"] and first["excluded"] == []
    out = q.controlled(proto, feeds, validation, 1e-9, hint=False)
    assert out["compute_only"] and out["model"] is not None and out["error"] <= 1e-9
    # every convolution in float did not fit while the products were quantized
    assert any(k == 2 and err > 1e-9 for k, err in out["tries"][:3])
    assert {n.op_type for n in out["model"].graph.node} & {"QuantizeLinear"} == set()


def test_optimize_under_int8_ships_a_build_within_budget_and_says_what_it_did(tmp_path, capsys):
    from collage_tvm.cli import main

    path = str(tmp_path / "cnn.onnx")
    m = _cnn(path)
    calibration = tmp_path / "calib.npz"
    np.savez(calibration, x=np.random.default_rng(3).standard_normal((4, 1, 3, 16, 16))
             .astype("float32"))
    out = tmp_path / "cnn.collage"
    assert main(["optimize", path, "--backends", "tvm,onnxruntime,openvino", "--no-graph-level",
                 "--in-process", "--db", str(tmp_path / "c.db"), "--accuracy", "int8",
                 "--calibration", str(calibration), "--export", str(out)]) == 0
    text = capsys.readouterr().out
    assert "int8 (budget 0.05 of the output scale; calibrated on 4 inputs from" in text
    assert "int8 (ONNX Runtime's quantize_static, " in text and "of 4 operators int8" in text
    assert re.search(r"float +build: error", text) and re.search(r"int8 +build: error", text)
    assert "shipped: the " in text
    if q.quantizers()["nncf"][0]:  # NNCF's int8 file competes too
        assert "int8-nncf (NNCF, " in text and re.search(r"int8-nncf +build: error", text)
    import collage_tvm

    loaded = collage_tvm.load(out)
    x = np.random.default_rng(9).standard_normal((1, 3, 16, 16)).astype("float32")
    with torch.no_grad():
        want = m(torch.from_numpy(x)).numpy()
    got = loaded(x)
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max() * 1.5  # (an unseen input)


def test_an_int8_budget_refuses_what_it_cannot_quantize(tmp_path):
    import collage_tvm

    path = str(tmp_path / "cnn.onnx")
    _cnn(path)
    whole = q.controlled(onnx.load(path), *([q.calibration_feeds(q.input_specs(
        onnx.load(path)))[0]] * 2), 0.5, hint=False)["model"]
    with pytest.raises(q.QuantizeError, match="quantized already"):
        collage_tvm.optimize(whole, "llvm", ["tvm"], accuracy="int8", progress=False,
                             db=str(tmp_path / "c.db"))
    with pytest.raises(q.QuantizeError, match="export the model to ONNX first"):
        collage_tvm.optimize(nn.Linear(2, 2), "llvm", ["tvm"], accuracy="int8",
                             example_inputs=(torch.randn(1, 2),), db=str(tmp_path / "c.db"))


def test_the_int8_suite_summary_counts_each_kind_and_the_float_left_in():
    from collage_tvm.tools import int8_suite

    def fw(ms, match=True):
        return {"ms": ms, "match": match, "error": 0.01}

    qdq = int8_suite._versus({"model": "a", "kind": "qdq file", "shipped": "openvino",
                              "frameworks": {"collage": fw(1.0), "onnxruntime": fw(3.0),
                                             "openvino": fw(0.98)}},
                             ("onnxruntime", "openvino"))
    assert qdq["best"] == "openvino" and qdq["vs_best"] == 0.98
    mixed = int8_suite._versus({
        "model": "b", "kind": "f32, --accuracy int8", "chose": "int8", "in_float": ["/0/Conv"],
        "quantizable": 20, "frameworks": {
            "collage": fw(1.0), "openvino (default)": fw(2.0),
            "onnxruntime (int8 file)": fw(1.5), "openvino (int8 file)": fw(0.8, match=False),
            "onnxruntime (f32)": fw(4.0)}},
        ("openvino (default)", "onnxruntime (int8 file)", "openvino (int8 file)",
         "onnxruntime (f32)"))
    assert mixed["best"] == "onnxruntime (int8 file)" and mixed["vs_best"] == 1.5
    assert "openvino (int8 file)" not in mixed["vs"]  # (outside the budget: no contender)
    s = int8_suite.summary([qdq, mixed, {"model": "c", "kind": "qdq file", "error": "x"}])
    assert s["qdq file"]["rows"] == 2 and s["qdq file"]["timed"] == 1
    assert s["qdq file"]["below_goal"] == 0 and s["qdq file"]["worst"] == ("a", 0.98)
    f = s["f32, --accuracy int8"]
    assert f["in_float"] == 1 and f["beats_whole_int8"] == 1
    text = int8_suite.markdown("torchvision", [qdq, mixed])
    assert "| b | f32, --accuracy int8 | int8 build, 1 of 20 in float | 1.000 |" in text
    assert "0.800 (err 1.0e-02)" in text and "Operators left in float (int8 shipped) in 1" in text
    # the best framework's A/A (its second instance): a row below the goal within it
    # cannot tell Collage from that framework; one below by more is counted apart
    near = int8_suite._versus({"model": "d", "kind": "qdq file", "frameworks": {
        "collage": fw(1.0), "onnxruntime": fw(0.95), "onnxruntime (A/A)": fw(0.9),
        "openvino": fw(2.0), "openvino (A/A)": fw(2.1)}}, ("onnxruntime", "openvino"))
    assert near["best"] == "onnxruntime" and "onnxruntime (A/A)" not in near["vs"]
    assert abs(near["aa_spread"] - (1 - 0.9 / 0.95)) < 1e-4
    far = int8_suite._versus({"model": "e", "kind": "qdq file", "frameworks": {
        "collage": fw(1.0), "onnxruntime": fw(0.8), "onnxruntime (A/A)": fw(0.81)}},
        ("onnxruntime", "openvino"))
    s = int8_suite.summary([qdq, near, far])["qdq file"]
    assert s["below_goal"] == 2 and s["below_beyond_aa"] == 1
    text = int8_suite.markdown("torchvision", [near, far])
    assert "0.950x (A/A 5%)" in text and "2 below 0.97x (1 by more than the row's A/A)" in text


@pytest.mark.skipif(not q.quantizers()["nncf"][0], reason="NNCF is not installed")
def test_nncf_quantizes_leaves_named_operators_in_float_and_is_ranked_by_the_control(tmp_path):
    path = str(tmp_path / "cnn.onnx")
    _cnn(path)
    proto = q.named(onnx.load(path))
    specs = q.input_specs(proto)
    feeds, _ = q.calibration_feeds(specs)
    convs = [n.name for n in proto.graph.node if n.op_type == "Conv"]

    def float_weights(model):
        """The Conv/Gemm nodes whose weight is read as a float initializer (not int8)."""
        inits = {i.name for i in model.graph.initializer}
        return {n.name for n in model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul")
                and n.input[1] in inits}

    whole = q.quantize(proto, feeds, method="nncf")
    assert quantized_ops(whole).get("QuantizeLinear") and not float_weights(whole) & set(convs)
    kept = q.quantize(proto, feeds, exclude=[convs[1]], method="nncf")
    assert convs[1] in float_weights(kept) and convs[0] not in float_weights(kept)
    # the control's ranking reads NNCF's tensors too (its own names for the Q/DQ pairs)
    ranked = dict(q.local_errors(proto, whole, feeds[:2]))
    assert set(convs) <= set(ranked) and any(v != 0.0 for v in ranked.values())
    validation = feeds + q.random_feeds(specs, q.VALIDATION_SEEDS)
    whole_err = q.error(q.outputs_on(whole, validation), q.outputs_on(proto, validation))
    tight = q.controlled(proto, feeds, validation, whole_err * 0.5, method="nncf",
                         hint=False)
    assert tight["model"] is None or tight["error"] <= whole_err * 0.5
    assert tight["excluded"]  # (the budget below the whole model's error: some in float)


def test_the_file_with_every_operator_int8_competes_where_within_the_whole_budget(
        tmp_path, monkeypatch):
    """The control aims each file at a share of the budget; the file it started from, every
    operator int8, competes as a build of its own where its error is within the whole
    budget (its build judged against the f32 model like the others)."""
    import collage_tvm

    path = str(tmp_path / "cnn.onnx")
    _cnn(path)
    monkeypatch.setattr(q, "CONTROL_SHARE", 0.05)  # aim far below the whole file's error
    monkeypatch.setattr(q, "quantizers", lambda: {"ort": (True, "")})
    res = collage_tvm.optimize(path, "llvm", ["tvm", "onnxruntime"], db=str(tmp_path / "c.db"),
                               progress=False, graph_level=False, accuracy="int8")
    info = res.report.precision["int8"]
    assert info["quantized"]["int8"]["in_float"]  # the control left some in float ...
    whole = info["quantized"]["int8-whole"]  # ... and the whole file competed beside it
    assert whole["in_float"] == [] and whole["error_file"] <= 0.05
    assert "int8-whole" in info["error"] and info["chose"] in info["error"]
    assert info["error"][info["chose"]] <= 0.05


def test_operators_left_in_float_go_back_to_int8_the_costliest_first_while_within_budget():
    """The error ranking's guess (a fake error: only 'e' in float keeps it within budget)
    is trimmed: the costliest operators are tried back in int8 first, in halving chunks,
    within RETURN_TRIES tries."""
    excluded = list("abcdefgh")
    costs = {n: float(c) for n, c in zip(excluded, (1, 2, 3, 4, 5, 6, 7, 8))}
    tried = []

    def attempt(trial):
        tried.append(list(trial))
        return f"model{len(tried)}", 0.01 if "e" in trial else 0.09

    kept, best = q._back_to_int8(excluded, costs, attempt, 0.05)
    fitting = [k for k, t in enumerate(tried, 1) if "e" in t]
    assert kept == ["e"] and best == (f"model{fitting[-1]}", 0.01)
    assert len(tried) <= q.RETURN_TRIES
    assert set(tried[0]) == set("abcd")  # (h, g, f, e back first: the costliest half)
    # two operators both needed in float: neither goes back, and no try fit
    kept, best = q._back_to_int8(["a", "b"], costs,
                                 lambda t: ("m", 0.01 if set(t) >= {"a", "b"} else 0.09), 0.05)
    assert kept == ["a", "b"] and best is None


def test_each_node_of_the_f32_model_has_its_measured_cost(tmp_path):
    path = str(tmp_path / "cnn.onnx")
    _cnn(path)
    proto = q.named(onnx.load(path))
    feeds, _ = q.calibration_feeds(q.input_specs(proto))
    costs = q.node_costs(proto, feeds[:1])
    assert set(costs) == {n.name for n in proto.graph.node}
    assert all(ms > 0 for ms in costs.values())
    # the control reports what went back to int8 (nothing where one operator fits)
    validation = feeds + q.random_feeds(q.input_specs(proto), q.VALIDATION_SEEDS)
    whole = q.controlled(proto, feeds, validation, 0.5, hint=False)
    tight = q.controlled(proto, feeds, validation, whole["error"] * 0.9, hint=False)
    assert not set(tight["returned"]) & set(tight["excluded"])


def test_openvino_s_profile_is_read_per_onnx_node_with_its_input_quantization(tmp_path):
    """``int8_gain``: OpenVINO's layers map back to the ONNX nodes they came from (a layer
    named after the node, or the node's name and "/..."); a QuantizeLinear's own layer is
    shared among the operators that read it; the real profile of a quantized file (in a
    child process) names its convolutions."""
    from collage_tvm import int8_gain

    path = str(tmp_path / "cnn.onnx")
    _cnn(path)
    f32 = q.named(onnx.load(path))
    feeds, _ = q.calibration_feeds(q.input_specs(f32))
    int8 = q.quantize(f32, feeds)
    qname = next(n.name for n in int8.graph.node if n.op_type == "QuantizeLinear"
                 and n.input[0] == "x")
    layers = {"/0/Conv/WithoutBiases": [0.5, "brgconv_avx512_I8"], "/0/Conv": [0.1, "x"],
              qname: [0.2, "jit_avx512_f32"], "unrelated_u8_f32_layer": [9.0, "reorder"]}
    times = int8_gain.node_times(layers, int8)
    assert times["/0/Conv"] == pytest.approx(0.8)  # its layers and the input's quantization
    assert "unrelated_u8_f32_layer" not in times
    real = int8_gain.layer_times(int8, feeds[0])
    assert real and {"/0/Conv", "/2/Conv", "/4/Conv"} <= set(int8_gain.node_times(real, int8))
    slow = {"a": (1.0, 3.0), "b": (1.0, 0.5), "c": (0.001, 0.005), "d": (1.0, 1.1)}
    assert int8_gain.unpaid(slow) == ["a"]  # (c: too small to tell, d: within the margin)
    assert int8_gain.saved(slow) == {"b": 0.5}


def test_operators_int8_makes_slower_where_it_runs_stay_in_float(tmp_path, monkeypatch):
    """The control leaves in float from the start the operators OpenVINO ran slower
    quantized (a fake table of per-operator times): they are "unpaid", not quantized, and
    the rest stays int8 where the budget holds."""
    from collage_tvm import int8_gain

    path = str(tmp_path / "cnn.onnx")
    _cnn(path)
    proto = q.named(onnx.load(path))
    feeds, _ = q.calibration_feeds(q.input_specs(proto))
    validation = feeds + q.random_feeds(q.input_specs(proto), q.VALIDATION_SEEDS)
    table = {"/0/Conv": (1.0, 0.4), "/2/Conv": (1.0, 2.5), "/4/Conv": (1.0, 0.5),
             "/6/Gemm": (1.0, 0.9)}
    monkeypatch.setattr(int8_gain, "layer_times", lambda proto, feed, hint=None: {})
    monkeypatch.setattr(int8_gain, "timed", lambda f32, f32_layers, int8, feed, nodes, hint: {
        n: t for n, t in table.items() if n in nodes})
    out = q.controlled(proto, feeds, validation, 0.5)
    assert out["unpaid"] == ["/2/Conv"] and out["excluded"] == ["/2/Conv"]
    assert out["timed_on"] == "openvino"
    conv_inputs = {n.name: n.input for n in out["model"].graph.node if n.op_type == "Conv"}
    made = {o: n.op_type for n in out["model"].graph.node for o in n.output}
    assert made.get(conv_inputs["/0/Conv"][1]) == "DequantizeLinear"  # (int8 weights)
    assert made.get(conv_inputs["/2/Conv"][1]) != "DequantizeLinear"  # (f32 weights)
    assert out["error"] <= 0.5 and out["whole_error"] <= 0.5
