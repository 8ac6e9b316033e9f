"""The floor (issue #33): the user's own model file, run whole by each graph library, is a
contender in the final check; it ships when it is the fastest correct build, and the
placement log remembers that verdict. Which build is fastest is the machine's call, so the
tests that need a winner fix the timings (a fake clock); the builds and outputs are real."""
import importlib
import importlib.util
import json
import statistics
from dataclasses import replace

import numpy as np
import onnx
import pytest
import torch
import tvm
from onnx import TensorProto, helper
from tvm import relax

import collage_tvm
from collage_tvm.precision import cpu_precisions
from collage_tvm.registry import get_backend
from collage_tvm.check.contender import from_records, records
from collage_tvm.options import FinalCheck

ns = importlib.import_module("collage_tvm.check.never_slower")  # the module, not the function
runoff = importlib.import_module("collage_tvm.check.runoff")
memory = importlib.import_module("collage_tvm.check.memory")
# the final check's settings the tests run under (tests/conftest.py makes them the default)
TESTS = FinalCheck(runoff_rounds=7, runoff_max_rounds=7, busy_retry_s=0.5)


def _on_records(step, results: dict, *args, **kw):
    """``step`` (a ``check.runoff`` function) run on the contenders ``results`` (name ->
    record) describe; the records then hold what it wrote."""
    contenders = from_records(results)
    out = step(contenders, *args, **kw)
    for name, c in contenders.items():
        results[name].clear()
        results[name].update(c.record())
    return out


def _conv_relu6_onnx(path) -> str:
    """conv -> Clip(0, 6) -> conv -> Clip(0, 6): a MobileNetV2 block as torch exports it."""
    rng = np.random.default_rng(0)
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [8, 3, 3, 3],
                            rng.standard_normal(8 * 27).astype("float32") * 0.3)
    w2 = helper.make_tensor("w2", TensorProto.FLOAT, [8, 8, 1, 1],
                            rng.standard_normal(64).astype("float32") * 0.3)
    lo = helper.make_tensor("lo", TensorProto.FLOAT, [], [0.0])
    hi = helper.make_tensor("hi", TensorProto.FLOAT, [], [6.0])
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c1", "lo", "hi"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"]),
             helper.make_node("Clip", ["c2", "lo", "hi"], ["y"])]
    graph = helper.make_graph(nodes, "block",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])],
                              initializer=[w1, w2, lo, hi])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return str(path)


@pytest.fixture
def model_path(tmp_path):
    return _conv_relu6_onnx(tmp_path / "block.onnx")


def _fixed_clock(monkeypatch, fastest: str):
    """Every build times 1 ms, ``fastest`` 0.1 ms: the real builds run, the clock is fixed."""
    real = ns.evaluate

    def evaluate(*args, **kwargs):
        return {**real(*args, **kwargs), "ms": 1.0}

    monkeypatch.setattr(ns, "evaluate", evaluate)
    monkeypatch.setattr(runoff, "interleaved", lambda runs, **kw: {
        n: (0.1 if n == fastest else 1.0) for n in runs})


def _machine_busy(monkeypatch, share: float):
    """Other processes took ``share`` of the CPU while the final check timed its builds."""
    timing = importlib.import_module("collage_tvm.measure.timing")

    def exit_(self, *exc):
        self.share = share

    monkeypatch.setattr(timing.OtherLoad, "__exit__", exit_)


def _record_compiles(monkeypatch, lowering) -> list:
    """Every model ``lowering.compile`` is handed from now on, in order (it still compiles)."""
    real, seen = lowering.compile, []

    def compile_(model, specs, sole=False):
        seen.append(model)
        return real(model, specs, sole)

    monkeypatch.setattr(lowering, "compile", compile_)
    return seen


def _assert_runs_like_the_file(mod, path, x):
    """``mod`` built with TVM gives, on ``x``, what ONNX Runtime gives on the file."""
    import onnxruntime as ort

    from collage_tvm.byoc import compile_module

    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    vm = relax.VirtualMachine(compile_module(mod, tvm.target.Target("llvm")), tvm.cpu())
    np.testing.assert_allclose(vm["main"](tvm.runtime.tensor(x)).numpy(), want,
                               rtol=1e-4, atol=1e-4)


def _search(path, tmp_path, backends=("tvm", "onnxruntime"), **kw):
    return collage_tvm.optimize(path, "llvm", list(backends), db=str(tmp_path / "c.db"),
                                progress=False, isolate=False, graph_level=False,
                                calibrate_rounds=0, refine_rounds=0, **kw)


def test_the_model_file_whole_on_each_graph_library_is_a_contender(model_path, tmp_path):
    res = _search(model_path, tmp_path, ("tvm", "onnxruntime", "openvino"))
    comp = records(res.report.comparison)
    for lib in ("onnxruntime", "openvino"):
        row = comp[f"{lib} (model file)"]
        assert row["match"] and row["ms"] > 0, row
    assert res.report.no_floor == ""
    # builds of Collage's own placements say what runs where (the model file's do not)
    assert set(comp["tvm-only"]["ops"]) == {"tvm"} and "ops" not in comp["onnxruntime (model file)"]


def test_a_hopeless_tvm_alone_is_not_built_and_a_library_build_is_the_reference(
        model_path, tmp_path, monkeypatch):
    # The search found TVM alone takes at least far past what a build must beat to be timed
    # (an untuned ResNet-50: seconds to build and to run once): tvm-only is not built, and
    # the outputs are checked against a whole-model library build instead.
    lean = importlib.import_module("collage_tvm.placer.lean")
    monkeypatch.setattr(lean, "_alone", lambda *a, **kw: 1e9)
    res = _search(model_path, tmp_path, ("tvm", "dnnl", "onnxruntime"))
    comp = records(res.report.comparison)
    assert set(res.report.lean["alone_ms"]) == {"tvm-only", "dnnl+tvm"}
    for name in ("tvm-only", "dnnl+tvm"):  # an op library's build alike
        assert comp[name]["skipped"] and "not built" in comp[name]["error"], comp
    refs = [n for n, r in comp.items() if r.get("reference") and "same_as" not in r]
    assert refs and refs[0] in ("onnxruntime", "onnxruntime (model file)"), comp
    assert comp["collage"]["match"] and comp["onnxruntime (model file)"]["match"], comp
    # a TVM alone that can come near: built, and the reference
    monkeypatch.setattr(lean, "_alone", lambda *a, **kw: 0.0)
    again = _search(model_path, tmp_path / "again")
    comp = records(again.report.comparison)
    assert comp["tvm-only"].get("reference"), comp


def test_the_model_file_ships_when_it_is_the_fastest_and_the_log_remembers(model_path, tmp_path,
                                                                            monkeypatch):
    import onnxruntime as ort

    _fixed_clock(monkeypatch, "onnxruntime (model file)")
    _machine_busy(monkeypatch, 0.0)  # a sure verdict (a busy one is checked again)
    res = _search(model_path, tmp_path)
    assert res.report.shipped == "onnxruntime (model file)"
    assert res.report.shipped_floor == "onnxruntime" and not res.report.whole_model
    assert res.graph is None and res.report.ops_per_backend.get("onnxruntime", 0) > 0
    x = np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype("float32")
    got = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    session = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(got, session.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
    monkeypatch.undo()  # the second build times nothing: the log's verdict stands
    again = _search(model_path, tmp_path)
    assert again.report.placement_from_log and again.report.distinct_measured == 0
    assert again.report.shipped == "onnxruntime (model file)" and again.graph is None


def test_a_verdict_timed_beside_other_work_is_checked_again_at_the_next_build(
        model_path, tmp_path, monkeypatch):
    # Timed on a busy machine, the model file on onnxruntime looked fastest and shipped ...
    _fixed_clock(monkeypatch, "onnxruntime (model file)")
    _machine_busy(monkeypatch, 0.6)
    res = _search(model_path, tmp_path)
    assert res.report.shipped == "onnxruntime (model file)" and res.report.other_load == 0.6
    monkeypatch.undo()
    # ... the next build, on a quiet machine, times them again: Collage's placement wins.
    _fixed_clock(monkeypatch, "collage")
    _machine_busy(monkeypatch, 0.0)
    again = _search(model_path, tmp_path)
    assert again.report.placement_from_log and again.report.rechecked
    assert again.report.distinct_measured == 0  # the search itself is not run again
    assert again.report.shipped == "collage" and again.graph is not None
    # That verdict was sure: the build after it takes the log's answer as it is.
    third = _search(model_path, tmp_path)
    assert third.report.placement_from_log and not third.report.rechecked
    assert third.report.shipped == "collage"


def test_a_logged_verdict_that_shipped_a_dropped_build_is_checked_again(model_path, tmp_path,
                                                                         monkeypatch):
    from collage_tvm.stages import shipped_dropped

    _fixed_clock(monkeypatch, "onnxruntime (model file)")
    first = _search(model_path, tmp_path)
    assert first.report.shipped == "onnxruntime (model file)" and not first.report.rechecked
    # a log written before dropped builds were tied to the leader: the one shipped was dropped
    log = tmp_path / "c.db.placements.json"
    doc = json.loads(log.read_text())
    (key, record), = doc["placements"].items()
    assert not shipped_dropped(record)
    record["comparison"]["onnxruntime (model file)"]["dropped"] = True
    assert shipped_dropped(record)
    log.write_text(json.dumps(doc))
    monkeypatch.undo()
    _fixed_clock(monkeypatch, "collage")
    again = _search(model_path, tmp_path)
    assert again.report.placement_from_log and again.report.rechecked
    assert again.report.shipped == "collage"
    assert not _search(model_path, tmp_path).report.rechecked  # the new verdict stands


def test_a_final_check_short_of_memory_keeps_the_fastest_build_so_far_and_frees_the_rest(
        model_path, tmp_path, monkeypatch):
    # A model of gigabytes of weights (torchvision's ViT-L/32 at 224x224: 21.7 GB of 24 in
    # its final check, 1.2 GB of weights): when one more build may not fit, the builds held
    # so far meet side by side and only the fastest correct one stays for the next.
    monkeypatch.setattr(memory, "_available", lambda: 0)
    monkeypatch.setattr(memory, "room_beside_one", lambda weights, s: True)  # (else: set aside)
    _fixed_clock(monkeypatch, "onnxruntime (model file)")
    _machine_busy(monkeypatch, 0.0)
    res = _search(model_path, tmp_path)
    comp = records(res.report.comparison)
    lost = {n: r["lost_to"] for n, r in comp.items() if "lost_to" in r}
    # builds 3 and 4 each found memory short: the two before the 3rd met, one was kept...
    assert len(lost) >= 2 and len(set(lost.values())) == 1, comp
    (kept,) = set(lost.values())
    assert kept not in lost and comp[kept]["match"]
    assert all(comp[n]["ms"] > 0 for n in lost)  # a freed build keeps its figures
    # ...and the one kept met the last build, the fastest, which ships
    assert "onnxruntime (model file)" not in lost
    assert res.report.shipped == "onnxruntime (model file)"
    x = np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype("float32")
    got = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()
    assert np.isfinite(got).all() and got.shape == (1, 8, 16, 16)


def test_a_model_file_that_is_slower_does_not_ship(model_path, tmp_path, monkeypatch):
    _fixed_clock(monkeypatch, "collage")
    res = _search(model_path, tmp_path)
    assert res.report.shipped == "collage"
    assert not res.report.shipped_floor and not res.report.whole_model
    assert res.graph is not None and "onnxruntime (model file)" in records(res.report.comparison)


@pytest.mark.skipif(not cpu_precisions()["bf16"][0] or not get_backend("openvino").available()[0],
                    reason="needs OpenVINO and a CPU with bf16 instructions")
def test_a_faster_build_outside_the_f32_budget_is_reported_with_its_flag_never_shipped(
        model_path, tmp_path, monkeypatch):
    _fixed_clock(monkeypatch, "openvino_bf16 (model file)")
    res = _search(model_path, tmp_path, ("tvm", "openvino"))
    row = records(res.report.comparison)["openvino_bf16 (model file)"]
    assert row["outside_budget"] == "bf16"
    assert res.report.shipped != "openvino_bf16 (model file)"
    assert "--accuracy bf16" in row["advice"] and "faster than the shipped build" in row["advice"]


def test_a_torch_module_is_judged_against_its_own_onnx_export(tmp_path):
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)

        def forward(self, x):
            return torch.nn.functional.relu6(self.conv(x))

    res = collage_tvm.optimize(Block().eval(), "llvm", ["tvm", "onnxruntime"],
                               example_inputs=(torch.randn(1, 3, 16, 16),),
                               db=str(tmp_path / "c.db"), progress=False, isolate=False,
                               graph_level=False, calibrate_rounds=0, refine_rounds=0)
    assert records(res.report.comparison)["onnxruntime (model file)"]["match"]


def test_without_a_model_file_the_report_says_why_there_is_no_floor(tmp_path):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.relu(x))
        bb.emit_func_output(out)
    res = collage_tvm.optimize(bb.get(), "llvm", ["tvm", "onnxruntime"],
                               db=str(tmp_path / "c.db"), progress=False, isolate=False,
                               graph_level=False, calibrate_rounds=0, refine_rounds=0)
    assert "Relax module" in res.report.no_floor
    assert not any("(model file)" in n for n in records(res.report.comparison))


@pytest.mark.skipif(not cpu_precisions()["bf16"][0] or not get_backend("openvino").available()[0],
                    reason="needs OpenVINO and a CPU with bf16 instructions")
def test_under_the_bf16_budget_the_model_file_at_openvinos_default_precision_can_ship(
        model_path, tmp_path, monkeypatch):
    _fixed_clock(monkeypatch, "openvino_bf16 (model file)")
    res = _search(model_path, tmp_path, ("tvm", "openvino"), accuracy="bf16")
    row = records(res.report.comparison)["openvino_bf16 (model file)"]
    assert "outside_budget" not in row and row["match"]
    assert res.report.shipped == "openvino_bf16 (model file)"
    assert res.report.shipped_floor == "openvino_bf16"


def test_close_builds_meet_again_in_more_rounds_and_the_runoff_decides(monkeypatch):
    """After the re-timing, the builds within ``runoff_margin`` of the fastest are timed
    again in ``runoff_rounds`` rounds, and those figures decide; a build far behind, one
    with wrong outputs and one outside the budget stay out of it."""
    calls = []
    s = replace(TESTS, runoff_rounds=15)  # (tests/conftest.py's default: 7)

    def clock(fns, rounds=7, **kw):
        calls.append((set(fns), rounds))
        return {"a": 1.00, "b": 1.05}

    monkeypatch.setattr(runoff, "interleaved", clock)
    results = {"a": {"ms": 1.04, "match": True}, "b": {"ms": 1.0, "match": True},
               "far": {"ms": 1.5, "match": True}, "wrong": {"ms": 0.5, "match": False},
               "bf16": {"ms": 0.6, "match": True}}
    _on_records(runoff.runoff, results, {n: None for n in results}, {"bf16"},
                tvm.target.Target("llvm"), s)
    assert calls == [({"a", "b"}, s.runoff_rounds)]
    assert results["a"] == {"ms": 1.0, "first_ms": 1.04, "match": True, "runoff": True}
    assert results["b"]["ms"] == 1.05 and results["b"]["first_ms"] == 1.0
    # "far" lost to "b" by over the margin: whatever the runoff's rounds do to the close
    # builds' figures, it cannot ship (the verdict leaves out what is "outrun_by" another)
    assert results["far"] == {"ms": 1.5, "match": True, "outrun_by": "b"}
    assert "outrun_by" not in results["wrong"] and "outrun_by" not in results["bf16"]
    # the runoff's rounds fell on a slow stretch: both close builds rose past the one left
    # out (timm's hardcorenas_a on a host at two speeds); it stays out
    monkeypatch.setattr(runoff, "interleaved", lambda fns, **kw: {"a": 1.6, "b": 1.65})
    slow = {"a": {"ms": 1.04, "match": True}, "b": {"ms": 1.0, "match": True},
            "left": {"ms": 1.12, "match": True}}
    _on_records(runoff.runoff, slow, {n: None for n in slow}, set(), tvm.target.Target("llvm"), s)
    assert slow["left"]["ms"] < slow["a"]["ms"] and slow["left"]["outrun_by"] == "b"
    # a runoff again (a busy machine's second timing) decides afresh
    monkeypatch.setattr(runoff, "interleaved", clock)
    slow["left"]["ms"] = 1.01
    _on_records(runoff.runoff, slow, {n: None for n in slow}, set(), tvm.target.Target("llvm"), s)
    assert "outrun_by" not in slow["left"]
    # the batches the re-timing took count: only the rounds missing are timed
    calls.clear()
    _on_records(runoff.runoff, {"a": {"ms": 1.0, "match": True}, "b": {"ms": 1.01, "match": True}},
               {"a": None, "b": None}, set(), tvm.target.Target("llvm"), s,
               {"a": [1.0] * 7, "b": [1.01] * 7})
    assert calls == [({"a", "b"}, s.runoff_rounds - 7)]
    # one close build alone: nothing to run off
    calls.clear()
    _on_records(runoff.runoff, {"a": {"ms": 1.0, "match": True}, "far": {"ms": 1.5, "match": True}},
               {"a": None, "far": None}, set(), tvm.target.Target("llvm"), s)
    assert calls == []


def test_the_runoff_ranks_close_builds_round_by_round(monkeypatch):
    """The close builds' figures are taken round by round (``_by_round``): a build faster
    in most rounds ranks first though its plain median landed on the slower rounds; the
    plain median is kept as "median_ms". Too few rounds, or one build: left as they are."""
    s = replace(TESTS, runoff_rounds=7)
    monkeypatch.setattr(runoff, "interleaved", lambda *a, **k: pytest.fail("nothing to time"))
    # the machine's load drifting from 100 to 116 ms a call; "b" 3% ahead of "a" in each
    # round but the last two (a slow stretch for it alone, a quick one for "a"): "a" has
    # the lower plain median (104 against 108.6)
    level = [100.0, 104.0, 108.0, 112.0, 116.0]
    a = level + [90.0, 90.0]
    b = [0.97 * x for x in level] + [130.0, 130.0]
    results = {"a": {"ms": statistics.median(a), "match": True},
               "b": {"ms": statistics.median(b), "match": True}}
    assert results["a"]["ms"] < results["b"]["ms"]
    _on_records(runoff.runoff, results, {"a": None, "b": None}, set(), tvm.target.Target("llvm"), s,
               {"a": list(a), "b": list(b)})
    assert results["b"]["ms"] < results["a"]["ms"]
    assert results["a"]["median_ms"] == statistics.median(a)
    assert results["b"]["median_ms"] == statistics.median(b)
    assert abs(results["a"]["ms"] / results["b"]["ms"] - 1 / 0.97) < 0.01
    # fewer rounds than PAIRED_MIN_ROUNDS: the plain medians stay
    short = {"a": {"ms": 104.0, "match": True}, "b": {"ms": 108.6, "match": True}}
    k = importlib.import_module("collage_tvm.measure.timing").PAIRED_MIN_ROUNDS - 1
    _on_records(runoff._by_round, short, {"a": a[:k], "b": b[:k]})
    assert short == {"a": {"ms": 104.0, "match": True}, "b": {"ms": 108.6, "match": True}}


def test_a_build_matched_round_for_round_enters_the_runoff(monkeypatch):
    """The re-timing's few rounds on a noisy machine: "b" took what "a" took in every round
    but one, where it met a slow stretch alone, and its plain median (the slow rounds)
    lands 50% behind. Round by round the two are equal, so "b" enters the runoff with
    "a" instead of being left out on its plain median."""
    s = replace(TESTS, runoff_rounds=15)
    calls = []

    def clock(fns, rounds=7, samples=None, **kw):
        calls.append((set(fns), rounds))
        if len(calls) == 1:
            samples["a"] = [100.0, 100.0, 100.0, 100.0, 150.0, 150.0, 150.0]
            samples["b"] = [100.0, 100.0, 100.0, 150.0, 150.0, 150.0, 150.0]
        else:
            for n in fns:
                samples[n].extend([100.0] * rounds)
        return {n: statistics.median(samples[n]) for n in fns}

    monkeypatch.setattr(runoff, "interleaved", clock)
    results = {"a": {"ms": 100.0, "match": True}, "b": {"ms": 101.0, "match": True}}
    _on_records(runoff.retime, results, {"a": None, "b": None}, set(), tvm.target.Target("llvm"), s)
    assert calls[0] == ({"a", "b"}, 7)
    assert calls[1] == ({"a", "b"}, s.runoff_rounds - 7)
    assert results["b"]["runoff"] and results["a"]["runoff"]
    assert results["b"]["median_ms"] == 100.0 and results["a"]["ms"] == results["b"]["ms"]
    # the plain medians alone would have left "b" out (150 against 100)
    assert statistics.median([100.0] * 3 + [150.0] * 4) > (1 + s.runoff_margin) * 100.0


@pytest.mark.parametrize("noise,b_factor,rounds", [
    (0.10, 1.00, 45),   # equal builds, 10% a round: open to the cap
    (0.01, 1.00, 15),   # equal within 1% a round: surely within SAME_SHARE, settled
    (0.01, 1.06, 15),   # "b" surely behind: settled
])
def test_an_open_close_call_is_timed_on_up_to_the_cap(monkeypatch, noise, b_factor, rounds):
    """After the runoff's rounds, two close builds whose ranking the rounds leave open
    (``_open_calls``) are timed on, ``runoff_step`` rounds at a time, up to
    ``runoff_max_rounds``; a call already settled either way is not."""
    import random

    s = replace(TESTS, runoff_rounds=15, runoff_max_rounds=45, runoff_step=10)
    rng = random.Random(1)
    factor = {"a": 1.0, "b": b_factor}

    def clock(fns, rounds=7, samples=None, **kw):
        for _ in range(rounds):
            for n in fns:
                samples.setdefault(n, []).append(100.0 * factor[n] * (1 + noise * rng.gauss(0, 1)))
        return {n: statistics.median(samples[n]) for n in fns}

    monkeypatch.setattr(runoff, "interleaved", clock)
    results = {"a": {"ms": 100.0, "match": True}, "b": {"ms": 100.0 * b_factor, "match": True}}
    samples = {"a": [], "b": []}
    _on_records(runoff.runoff, results, {"a": None, "b": None}, set(),
                tvm.target.Target("llvm"), s, samples)
    assert results["a"]["rounds"] == results["b"]["rounds"] == rounds
    if b_factor > 1:
        assert results["a"]["ms"] < results["b"]["ms"]


def test_a_build_settled_as_slower_stays_behind_the_leader_timed_on(monkeypatch):
    """Three close builds: "c" is surely 6% behind "a" after the runoff's rounds, "a" and
    "b" are open and timed on, and the host turns twice as slow for those rounds. "c" is
    timed no more, and its figure follows the leader's ("settled_against"): it stays 6%
    behind instead of keeping the fast rounds' figure and shipping."""
    s = replace(TESTS, runoff_rounds=15, runoff_max_rounds=45, runoff_step=10)
    import random

    rng = random.Random(1)
    base = {"a": 100.0, "b": 100.0, "c": 106.0}
    calls = []

    def clock(fns, rounds=7, samples=None, **kw):
        calls.append(set(fns))
        for _ in range(rounds):
            i = len(samples["a"])
            speed = 1.0 if i < 15 else 2.0
            wobble = {"a": 1 + 0.001 * (i % 3), "b": 1 + 0.1 * rng.gauss(0, 1),
                      "c": 1 + 0.001 * (i % 2)}
            for n in fns:
                samples[n].append(base[n] * speed * wobble[n])
        return {n: statistics.median(samples[n]) for n in fns}

    monkeypatch.setattr(runoff, "interleaved", clock)
    results = {n: {"ms": ms, "match": True} for n, ms in base.items()}
    samples = {n: [] for n in base}
    _on_records(runoff.runoff, results, {n: None for n in base}, set(),
                tvm.target.Target("llvm"), s, samples)
    assert calls[0] == {"a", "b", "c"} and calls[1:] and all(c == {"a", "b"} for c in calls[1:])
    assert results["c"]["rounds"] == 15 and results["a"]["rounds"] > 15
    assert results["c"]["settled_against"] == "a" and "settled_against" not in results["a"]
    leader = min(("a", "b"), key=lambda n: results[n]["ms"])
    assert results["a"]["ms"] > 150  # the leader's figure moved with the slow rounds
    assert min(results, key=lambda n: results[n]["ms"]) == leader
    assert abs(results["c"]["ms"] / results["a"]["ms"] - 1.06) < 0.01


@pytest.mark.parametrize("library", ["onnxruntime", "openvino"])
def test_the_model_file_whole_is_read_by_the_library_from_the_users_file(model_path,
                                                                         monkeypatch, library):
    """The floor's library loads the user's file itself (as the user's own session does) when
    the input shapes leave the model as it is; shapes that change it hand the library the
    rewritten model. Either build runs the file's outputs."""
    from collage_tvm.byoc.whole import whole_model_module
    from collage_tvm.export.onnx import OnnxFile

    backend = get_backend(library)
    if not backend.available()[0]:
        pytest.skip(f"{library} is not installed")
    seen = _record_compiles(monkeypatch, backend.get_lowering())
    proto = onnx.load(model_path)
    x = np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype("float32")
    for shapes in ({}, {"x": (1, 3, 16, 16)}):  # the shape the file declares
        seen.clear()
        mod = whole_model_module(proto, backend, shapes, path=model_path)
        assert isinstance(seen[0], OnnxFile)
        assert seen[0].path == model_path and list(seen[0].inputs) == ["x"]
        _assert_runs_like_the_file(mod, model_path, x)
    # no path, or a shape the file does not declare: the library gets the model itself
    seen.clear()
    whole_model_module(proto, backend, None)
    assert isinstance(seen[0], onnx.ModelProto)
    dynamic = onnx.load(model_path)
    dynamic.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    seen.clear()
    whole_model_module(dynamic, backend, {"x": (1, 3, 16, 16)}, path=model_path)
    assert isinstance(seen[0], onnx.ModelProto)
    assert seen[0].graph.input[0].type.tensor_type.shape.dim[0].dim_value == 1


def test_the_final_check_s_batches_hold_a_thousand_calls_of_a_microsecond_model(monkeypatch):
    """A round's batch lasts 200 ms, shorter where the fastest build's call takes
    microseconds (BATCH_CALLS of its calls, at least 50 ms): the rounds stay, the seconds
    a tiny model's check spends on batches of tens of thousands of calls go."""
    from collage_tvm.target import make_target

    seen = []
    monkeypatch.setattr(runoff, "interleaved", lambda fns, **kw: (seen.append(kw["min_ms"]),
                                                                  {n: 1.0 for n in fns})[1])
    for ms, want in ((0.006, TESTS.short_batch_ms), (0.1, 100.0), (0.7, TESTS.batch_ms),
                     (300.0, TESTS.batch_ms)):
        results = {"a": {"ms": 3 * ms}, "b": {"ms": ms}}
        _on_records(runoff.time_again, results, {"a": None, "b": None}, make_target("llvm"),
                    TESTS)
        assert seen[-1] == pytest.approx(want), ms
    _on_records(runoff.time_again, {"a": {"ms": 0.006}}, {"a": None}, make_target("llvm"),
                TESTS, min_ms=7.0)
    assert seen[-1] == 7.0  # a caller's own batch length is kept


def test_a_library_that_reads_no_files_is_handed_the_model_not_the_users_file(model_path,
                                                                            monkeypatch):
    """inductor translates a ModelProto (onnx2torch); handing it the user's file as an
    ``OnnxFile`` broke the floor's "inductor (model file)" on the H200 (TypeError from
    onnx2torch). A lowering without ``reads_files`` gets the proto, and the build runs."""
    from types import SimpleNamespace

    from collage_tvm.byoc.whole import whole_model_module

    if importlib.util.find_spec("onnx2torch") is None:
        pytest.skip("onnx2torch is not installed (the test extra)")
    from tests.test_gpu_backends import _InductorOnCpu

    lowering = _InductorOnCpu()
    seen = _record_compiles(monkeypatch, lowering)
    assert not lowering.reads_files
    backend = SimpleNamespace(name="inductor", get_lowering=lambda: lowering)
    mod = whole_model_module(onnx.load(model_path), backend, {}, path=model_path)
    assert isinstance(seen[0], onnx.ModelProto)
    x = np.random.default_rng(2).standard_normal((1, 3, 16, 16)).astype("float32")
    _assert_runs_like_the_file(mod, model_path, x)


def test_a_build_dropped_at_its_best_cannot_undercut_a_leader_timed_on_into_a_slow_stretch(
        monkeypatch):
    """timm's repvgg_a0 int8 file on the Zen 4: "ov" was faster than "ort" in each of the
    four rounds both were timed in, and "ort" was dropped; "ov" and its twin were timed on
    while the host turned twice as slow. "ort"'s figure follows the leader's (its ratio to
    it in the rounds they shared) instead of the median of its own fast rounds, so "ov"
    stays the fastest."""
    def clock(fns, rounds=7, samples=None, dropped=None, **kw):
        samples.update({"ov": [4.33, 4.37, 4.51, 4.50, 11.9, 10.6, 9.5],
                        "ov2": [4.43, 4.41, 4.62, 9.15, 9.35, 10.3, 9.13],
                        "ort": [5.39, 5.82, 5.70, 10.4]})
        dropped.add("ort")
        return {n: statistics.median(samples[n]) for n in fns}

    monkeypatch.setattr(runoff, "interleaved", clock)
    results = {n: {"ms": 5.0, "match": True} for n in ("ov", "ov2", "ort")}
    _on_records(runoff.retime, results, {n: None for n in results}, set(),
                tvm.target.Target("llvm"), TESTS)
    assert results["ort"]["settled_against"] in ("ov", "ov2")
    assert min(results, key=lambda n: results[n]["ms"]) != "ort"
    leader = results[results["ort"]["settled_against"]]["ms"]
    assert results["ort"]["ms"] > 1.2 * leader  # ~1.29x it in the rounds they shared
    # with no drop the figures are the medians as before
    assert statistics.median([5.39, 5.82, 5.70, 10.4]) < leader


def test_the_fastest_of_a_few_is_never_one_dropped_at_its_best(monkeypatch):
    from collage_tvm.check import fastest

    def clock(fns, rounds, min_ms, samples, drop, dropped):
        samples.update({"a": [4.3, 4.4, 4.5, 9.5, 10.6, 11.9], "b": [5.4, 5.8, 5.7, 5.9]})
        dropped.add("b")
        return {n: statistics.median(s) for n, s in samples.items()}

    monkeypatch.setattr(fastest, "interleaved", clock)
    one = lambda: np.zeros(2, "float32")  # noqa: E731
    chose, record = fastest.decide({"b": one, "a": one}, [])
    assert chose == "a" and record["ms"]["b"] < record["ms"]["a"]  # (b's own median is lower)
