"""Quantized models (issue #78): an int8 model judged by its own precision, not f32 rounding."""
import numpy as np
import pytest

import collage_tvm
from collage_tvm.precision import (INT8_MODEL, INT8_MODEL_TOLERANCE, model_budget,
                                   parse_accuracy, quantized_ops)
from collage_tvm.tools.suites import matches
from collage_tvm.check.contender import records


def _qdq_cnn(folder) -> tuple:
    """(f32 file, int8 file) of a small CNN quantized as ONNX Runtime's docs show: QDQ,
    u8 activations, s8 weights, 8 calibration batches."""
    import torch
    import torch.nn as nn
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static)

    from collage_tvm.frontend.model_file import export_torch

    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
                      nn.ReLU(), nn.Flatten(), nn.Linear(8 * 7 * 7, 10)).eval()
    f32, int8 = str(folder / "m.onnx"), str(folder / "m_int8.onnx")
    export_torch(m, (torch.randn(1, 3, 16, 16),), f32, input_names=["x"], output_names=["y"])

    class Reader(CalibrationDataReader):
        def __init__(self):
            rng = np.random.default_rng(0)
            self.it = iter([{"x": rng.standard_normal((1, 3, 16, 16)).astype("float32")}
                            for _ in range(8)])

        def get_next(self):
            return next(self.it, None)

    quantize_static(f32, int8, Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return f32, int8


def test_a_quantized_file_is_judged_by_its_own_precision_and_a_float_one_is_not(tmp_path):
    import onnx

    f32, int8 = _qdq_cnn(tmp_path)
    ops = quantized_ops(onnx.load(int8))
    assert ops["QuantizeLinear"] >= 3 and ops["DequantizeLinear"] >= 6
    assert quantized_ops(onnx.load(f32)) == {}
    strict = parse_accuracy("f32")
    budget, why = model_budget(strict, onnx.load(int8))
    assert budget.name == INT8_MODEL and budget.tolerance == INT8_MODEL_TOLERANCE
    assert "the model is quantized" in why and "DequantizeLinear" in why
    assert model_budget(strict, onnx.load(f32)) == (strict, "")
    bf16 = parse_accuracy("bf16")
    assert model_budget(bf16, onnx.load(int8)) == (bf16, "")  # the user's own budget stands


def test_the_int8_budget_takes_two_int8_implementations_rounding_and_no_bf16_backend():
    budget = parse_accuracy(INT8_MODEL)
    assert budget == model_budget(parse_accuracy("f32"), _proto_with("QuantizeLinear"))[0]
    ref = [np.linspace(-4, 4, 100).astype("float32")]
    rounded = [ref[0] + 0.011 * 4 * np.sign(np.sin(np.arange(100)))]  # 1.1% of the scale
    assert budget.check(rounded, ref)["match"]
    assert not parse_accuracy("f32").check(rounded, ref)["match"]
    wrong = [ref[0] * 0.8]  # 20% of the scale: a wrong build, not rounding
    assert not budget.check(wrong, ref)["match"]
    assert not budget.allows("bf16") and budget.allows("f32")
    assert parse_accuracy(f"{INT8_MODEL_TOLERANCE:g}").allows("bf16")
    assert budget.key() != parse_accuracy(f"{INT8_MODEL_TOLERANCE:g}").key()


def _proto_with(op: str):
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.UINT8, [2])
    s = helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])
    return helper.make_model(helper.make_graph([helper.make_node(op, ["x", "s"], ["y"])],
                                               "g", [x], [y], [s]))


def test_optimize_on_a_qdq_file_ships_a_build_within_its_int8_budget_and_saves_it(tmp_path):
    import onnxruntime as ort

    _, int8 = _qdq_cnn(tmp_path)
    res = collage_tvm.optimize(int8, "llvm", ["tvm", "onnxruntime", "openvino"],
                               db=str(tmp_path / "c.db"), progress=False, graph_level=False,
                               isolate=False)
    rep = res.report
    assert rep.precision["accuracy"] == INT8_MODEL and "quantized" in rep.precision["why"]
    assert not any(b.endswith("_bf16") for b in rep.backends)
    comp = records(rep.comparison)
    assert comp and all(r.get("match") for n, r in comp.items() if n in ("collage", rep.shipped))
    m = collage_tvm.load(collage_tvm.save(res, tmp_path / "q.collage"))
    assert m.manifest["accuracy"] == INT8_MODEL
    x = np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype("float32")
    want = ort.InferenceSession(int8, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = m(x)
    assert parse_accuracy(INT8_MODEL).check([np.asarray(got)], want)["match"]
    assert matches([np.asarray(got)], want, 0.1, 0.1)


def test_the_cli_says_the_budget_a_quantized_model_is_judged_by(tmp_path, capsys):
    from collage_tvm.cli import main

    _, int8 = _qdq_cnn(tmp_path)
    import json

    report = tmp_path / "report.json"
    assert main(["optimize", int8, "--backends", "tvm,onnxruntime", "--no-graph-level",
                 "--in-process", "--db", str(tmp_path / "c.db"), "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert f"accuracy budget {INT8_MODEL}: the model is quantized" in out
    doc = json.loads(report.read_text())  # what docs' "optimize-report" block renders
    assert doc["precision"]["accuracy"] == INT8_MODEL and doc["shipped"] in doc["comparison"]
    assert doc["machine"]["cpu"] and doc["model"] == int8
    with pytest.raises(ValueError, match="expected f32, bf16, int8 or a tolerance"):
        parse_accuracy("int9")


def test_quantize_and_dequantize_reach_a_graph_library_as_qdq_nodes(tmp_path):
    """TVM's import keeps the file's Q/DQ as relax.quantize/dequantize; the exporter writes
    them back, so a library region holds the int8 subgraph it fuses, not float arithmetic."""
    import onnxruntime as ort

    from collage_tvm.export.onnx import export_function, unsupported_reason
    from collage_tvm.frontend import load_model, normalize_for_collage

    _, int8 = _qdq_cnn(tmp_path)
    mod = normalize_for_collage(load_model(int8))
    text = mod.script()
    assert "R.quantize(" in text and "R.dequantize(" in text
    exported = export_function(mod["main"])
    ops = {n.op_type for n in exported.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv"} <= ops
    # each weight as the file has it, int8 behind a DequantizeLinear (not folded to float),
    # and each Conv with its bias, as the libraries' int8 fusions look for them
    int8_weights = {t.name for t in exported.graph.initializer if t.data_type == 3}  # INT8
    convs = [n for n in exported.graph.node if n.op_type == "Conv"]
    producer = {o: n for n in exported.graph.node for o in n.output}
    assert len(convs) == 2 and all(len(c.input) == 3 for c in convs)
    assert all(producer[c.input[1]].op_type == "DequantizeLinear"
               and producer[c.input[1]].input[0] in int8_weights for c in convs)
    assert not any(n.op_type == "Add" and producer.get(i, n).op_type == "Conv"
                   for n in exported.graph.node for i in n.input)
    x = np.random.default_rng(2).standard_normal((1, 3, 16, 16)).astype("float32")
    got = ort.InferenceSession(exported.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(
        None, {exported.graph.input[0].name: x})
    want = ort.InferenceSession(int8, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    assert parse_accuracy(INT8_MODEL).check(got, want)["match"]
    from tvm import relax

    blocked = relax.BlockBuilder().normalize(relax.op.quantize(relax.Var("v", relax.TensorType((4, 4), "float32")),
                                relax.const(np.ones((4, 4), "float32")),
                                relax.const(np.zeros((4, 4), "int8")), axis=0,
                                out_dtype="int8"))
    assert "more than one dimension" in unsupported_reason(blocked)


def test_a_quantized_model_is_checked_against_onnx_runtime_s_run_of_its_file():
    """TVM computes the quantized operators in float; on timm's vit_tiny that landed 14% of
    the output scale from ONNX Runtime's run of the file, so every library build failed the
    check against TVM and TVM alone (30x slower) shipped. A quantized model's reference is
    the user's file on ONNX Runtime where that ran; another model's stays TVM alone."""
    from collage_tvm.check.contender import Contender
    from collage_tvm.check.floors import Floor
    from collage_tvm.check.reference import reference

    floors = {"openvino (model file)": Floor("openvino", lambda: None),
              "onnxruntime (model file)": Floor("onnxruntime", lambda: None)}
    results = {"tvm-only": Contender(ms=1000.0), "collage": Contender(ms=30.0),
               **{n: Contender(ms=12.0) for n in floors}}
    builds = {"tvm-only": [], "collage": [], **{n: None for n in floors}}
    assert reference(results, builds, floors) == "tvm-only"
    assert reference(results, builds, floors, quantized=True) == "onnxruntime (model file)"
    results["onnxruntime (model file)"] = Contender(error="it failed")
    assert reference(results, builds, floors, quantized=True) == "tvm-only"
