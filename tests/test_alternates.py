"""The alternates decided where the build runs (issues #33, #77): when the user's model file
ran whole on two graph libraries within a few percent of each other in the final check, the
saved build holds both and the loaded build's first calls race them in the serving process
(``check.race``), keeping the faster. Which library wins is the machine's call, so the tests
that need a winner fix the clock; the builds, sessions and outputs are real."""
import importlib
import json

import numpy as np
import pytest
import tvm
from tvm import relax

import collage_tvm
from collage_tvm.check.fastest import decide
from collage_tvm.check.floors import alternates
from collage_tvm.registry import get_backend

from test_artifact import X, _block_onnx

ns = importlib.import_module("collage_tvm.check.never_slower")
runoff = importlib.import_module("collage_tvm.check.runoff")
fastest = importlib.import_module("collage_tvm.check.fastest")
race_module = importlib.import_module("collage_tvm.check.race")

pytestmark = pytest.mark.skipif(
    not (get_backend("onnxruntime").available()[0] and get_backend("openvino").available()[0]),
    reason="needs onnxruntime and openvino")


def _clock(monkeypatch, figures: dict):
    """The final check's builds time ``figures[name]`` ms (1 ms for the rest): the builds run,
    the clock is fixed. The search's TVM kernels cost at most 2 us, so its placement stays
    on TVM: measured for real, a slow sample of the TVM kernels could make it the whole
    model on ONNX Runtime (one build in three on a busy 2-vCPU machine), and then that
    contender is "collage", not the "onnxruntime" the figures name."""
    measurer = importlib.import_module("collage_tvm.measure.measurer")
    cached = measurer.Measurer._cached

    def capped(self, name, version, key, label, measure):
        cost = cached(self, name, version, key, label, measure)
        return min(cost, 0.002) if name == "tvm" and not key.startswith("__") else cost

    monkeypatch.setattr(measurer.Measurer, "_cached", capped)
    real = ns.evaluate
    monkeypatch.setattr(ns, "evaluate", lambda *a, **k: {**real(*a, **k), "ms": 1.0})
    monkeypatch.setattr(runoff, "interleaved", lambda runs, **kw: {
        n: figures.get(n, 1.0) for n in runs})
    timing = importlib.import_module("collage_tvm.measure.timing")
    monkeypatch.setattr(timing.OtherLoad, "__exit__", lambda self, *exc: setattr(self, "share", 0.0))


def _optimize(path, tmp_path):
    return collage_tvm.optimize(path, "llvm", ["tvm", "onnxruntime", "openvino"],
                                db=str(tmp_path / "c.db"), progress=False, isolate=False,
                                graph_level=False, calibrate_rounds=0, refine_rounds=0)


def _saved(res, tmp_path, monkeypatch):
    """The clock put back, ``res`` saved: (its outputs on X, the saved build's path, the
    manifest's first region entry)."""
    monkeypatch.undo()
    ref = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(X)).numpy()
    saved = collage_tvm.save(res, tmp_path / "art")
    return ref, saved, json.loads((saved / "manifest.json").read_text())["regions"][0]


def _load_choosing(saved, monkeypatch, winner: str):
    """``saved`` loaded, its race settled by calls on X with ``winner`` the fastest (each
    call runs; the clock says 0.5 ms for the winner's, 1 ms for the others')."""
    real = race_module.Race._timed

    def timed(self, name, args, numpy):
        return real(self, name, args, numpy)[0], (0.5 if name == winner else 1.0)

    monkeypatch.setattr(race_module.Race, "_timed", timed)
    monkeypatch.setattr(race_module.Race, "_busy", lambda self: False)  # (a busy CI: quiet)
    module = collage_tvm.load(saved)
    module.settle(X)
    return module


@pytest.fixture(scope="module")
def close_call(tmp_path_factory):
    """The model file on ONNX Runtime won by 2% over OpenVINO: (result, saved path)."""
    tmp = tmp_path_factory.mktemp("close")
    path = _block_onnx(tmp / "block.onnx")
    mp = pytest.MonkeyPatch()
    try:
        _clock(mp, {"onnxruntime (model file)": 0.100, "openvino (model file)": 0.102})
        res = _optimize(path, tmp)
    finally:
        mp.undo()
    return res, collage_tvm.save(res, tmp / "art")


def test_a_close_floor_is_kept_beside_the_winner_and_saved(close_call):
    res, path = close_call
    assert res.report.shipped == "onnxruntime (model file)"
    assert res.report.alternates == [{"backend": "openvino", "ms": 0.102}]
    manifest = json.loads((path / "manifest.json").read_text())
    entry = manifest["regions"][0]
    assert entry["backend"] == "onnxruntime"
    assert [a["backend"] for a in entry["alternates"]] == ["openvino"]
    # the alternate's library is what the decision may need, not what loading needs
    assert set(manifest["backends"]) == {"onnxruntime"}
    assert manifest["alternate_backends"]["openvino"]["version"] == \
        get_backend("openvino").version()


def test_a_floor_past_the_margin_is_no_alternate(tmp_path, monkeypatch):
    path = _block_onnx(tmp_path / "block.onnx")
    _clock(monkeypatch, {"onnxruntime (model file)": 0.100, "openvino (model file)": 0.2})
    res = _optimize(path, tmp_path)
    assert res.report.shipped == "onnxruntime (model file)"
    assert res.report.alternates == []


def test_the_model_as_one_exported_region_carries_its_close_libraries_too(tmp_path,
                                                                         monkeypatch):
    # TVM's import whole on ONNX Runtime won by 2% over the same on OpenVINO (the user's file
    # was slower on both): the region the build exports is what either library runs
    path = _block_onnx(tmp_path / "block.onnx")
    _clock(monkeypatch, {"onnxruntime": 0.100, "openvino": 0.102})
    res = _optimize(path, tmp_path)
    assert res.report.shipped == "onnxruntime"
    assert not res.report.shipped_floor and not res.report.whole_model
    assert res.report.alternates == [{"backend": "openvino", "ms": 0.102}]
    ref, saved, entry = _saved(res, tmp_path, monkeypatch)
    assert entry["sole"] and entry["label"] != "the model file, whole"
    assert [a["backend"] for a in entry["alternates"]] == ["openvino"]
    module = _load_choosing(saved, monkeypatch, "openvino")
    assert module.decided["chose"] == "openvino", str(module.decided)
    np.testing.assert_allclose(module(X), ref, rtol=1e-4, atol=1e-5)
    # the placement log keeps the alternates: the next build ships them again
    again = _optimize(path, tmp_path)
    assert again.report.placement_from_log
    assert again.report.alternates == [{"backend": "openvino", "ms": 0.102}]


def test_load_times_the_close_libraries_here_and_keeps_the_faster(close_call, monkeypatch):
    res, path = close_call
    ref = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(X)).numpy()
    # here OpenVINO is the faster: the loaded build runs the file on it
    module = _load_choosing(path, monkeypatch, "openvino")
    assert module.decided["shipped"] == "onnxruntime" and module.decided["chose"] == "openvino", \
        module.decided
    assert module.decided["ms"] == {"onnxruntime": 1.0, "openvino": 0.5}
    assert "ops: openvino" in repr(module)
    np.testing.assert_allclose(module(X), ref, rtol=1e-4, atol=1e-5)
    call = module.race.fns[module.race.chose]
    assert hasattr(call, "compiled") and not hasattr(call, "session")  # OpenVINO's, not ORT's
    # decide=False: the final check's verdict, nothing raced
    plain = collage_tvm.load(path, decide=False)
    assert plain.decided is None and plain.race is None and plain.races == []
    assert hasattr(next(iter(plain._callables.values())), "session")  # ONNX Runtime's
    np.testing.assert_allclose(plain(X), ref, rtol=1e-5, atol=1e-6)


def test_the_first_calls_really_race_both(close_call):
    res, path = close_call
    ref = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(X)).numpy()
    module = collage_tvm.load(path)
    assert module.decided["chose"] is None  # nothing decided at load: the calls decide
    for _ in range(3):  # racing or not, every call gives the model's outputs
        np.testing.assert_allclose(module(X), ref, rtol=1e-4, atol=1e-5)
    d = module.settle(X)[0]
    assert d == module.decided and d["chose"] in d["ms"]
    assert set(d["ms"]) == {"onnxruntime", "openvino"} and all(ms > 0 for ms in d["ms"].values())
    assert d["rounds"] >= 4 and d["calls"] > 8 and d["seconds"] > 0 and d["left_out"] == {}
    np.testing.assert_allclose(module(X), ref, rtol=1e-4, atol=1e-5)


def test_an_alternate_that_cannot_load_here_is_left_out_with_the_reason(close_call, tmp_path):
    import shutil

    _, path = close_call
    copy = tmp_path / "art"
    shutil.copytree(path, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["regions"][0]["alternates"].append({"backend": "no_such_library", "ms": 0.1})
    manifest["alternate_backends"]["openvino"]["version"] = "openvino-0.0"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    module = collage_tvm.load(copy)  # loads all the same, on the shipped library
    d = module.decided  # (no contender left to race: decided at once)
    assert d["chose"] == "onnxruntime" and d["ms"] == {}
    assert "no_such_library" in d["left_out"] and "openvino-0.0" in d["left_out"]["openvino"]
    assert module(X).shape == (1, 8, 16, 16)


def test_an_alternate_whose_outputs_differ_is_left_out():
    args = [tvm.runtime.tensor(np.arange(6, dtype="float32").reshape(2, 3))]
    right = lambda x: tvm.runtime.tensor(x.numpy() * 2)  # noqa: E731
    wrong = lambda x: tvm.runtime.tensor(x.numpy() * 2 + 0.5)  # noqa: E731
    broken = lambda x: 1 / 0  # noqa: E731
    chose, record = decide({"a": right, "b": wrong, "c": broken}, args)
    assert chose == "a" and record["ms"] == {}
    assert "differ" in record["left_out"]["b"] and "ZeroDivisionError" in record["left_out"]["c"]


@pytest.mark.parametrize("other_ms, chose", [(0.998, "a"), (0.995, "a"), (0.97, "b")])
def test_another_replaces_the_shipped_one_only_past_the_margin(monkeypatch, other_ms, chose):
    args = [tvm.runtime.tensor(np.arange(6, dtype="float32").reshape(2, 3))]
    same = lambda x: tvm.runtime.tensor(x.numpy() * 2)  # noqa: E731
    monkeypatch.setattr(fastest, "interleaved", lambda fns, **kw: {"a": 1.0, "b": other_ms})
    got, record = decide({"a": same, "b": same}, args)
    assert got == chose == record["chose"] and record["ms"] == {"a": 1.0, "b": other_ms}


def test_run_prints_the_close_call_and_no_decide_keeps_the_search_choice(close_call, capsys):
    from collage_tvm import cli

    _, path = close_call
    assert cli.main(["run", str(path), "--bench", "5"]) == 0  # (settled before the timing)
    out = capsys.readouterr().out
    assert "decided by the first " in out and "runs on " in out and "latency over 5" in out
    assert cli.main(["run", str(path), "--no-decide", "--bench", "5"]) == 0
    assert "decided by" not in capsys.readouterr().out


def test_beside_an_exported_region_the_user_s_own_file_is_an_alternate_too(tmp_path,
                                                                          monkeypatch):
    # TVM's import whole on OpenVINO won by 2% over the user's file on ONNX Runtime (the
    # transformers suite's vit on the AMX Xeon, the other way round in the row): the saved
    # build holds the user's file too, and the decision at load may run it instead
    path = _block_onnx(tmp_path / "block.onnx")
    _clock(monkeypatch, {"openvino": 0.100, "onnxruntime (model file)": 0.102})
    res = _optimize(path, tmp_path)
    assert res.report.shipped == "openvino"
    assert not res.report.shipped_floor and not res.report.whole_model
    assert res.report.alternates == [{"backend": "onnxruntime", "ms": 0.102,
                                      "source": "model file"}]
    assert res.model_file is not None
    ref, saved, entry = _saved(res, tmp_path, monkeypatch)
    assert entry["backend"] == "openvino" and entry["label"] != "the model file, whole"
    alt = entry["alternates"][0]
    assert alt["backend"] == "onnxruntime" and alt["file"] == "regions/model_file.onnx"
    assert (saved / alt["file"]).stat().st_size > 0 and alt["inputs"]
    module = _load_choosing(saved, monkeypatch, "onnxruntime (model file)")
    assert module.decided["chose"] == "onnxruntime (model file)"
    assert module.decided["left_out"] == {}
    call = module.race.fns[module.race.chose]
    assert hasattr(call, "session")  # ONNX Runtime's, on the user's file
    np.testing.assert_allclose(module(X), ref, rtol=1e-4, atol=1e-5)
    _direct_as_the_vm(module, entry)
    # the placement log keeps it: the next build (nothing measured) saves the file again
    again = _optimize(path, tmp_path)
    assert again.report.placement_from_log and again.report.alternates == res.report.alternates
    assert again.model_file is not None
    # a result without the file saves the other alternates only
    again.model_file = None
    bare = json.loads((collage_tvm.save(again, tmp_path / "bare") / "manifest.json")
                      .read_text())["regions"][0]
    assert "alternates" not in bare


def test_alternates_take_the_user_s_file_beside_a_region_not_a_region_beside_the_file():
    ok = {"collage": 1.0, "openvino": 1.0, "onnxruntime (model file)": 1.03,
          "openvino (model file)": 1.01, "onnxruntime": 1.2}
    runs = {"openvino": (1, "openvino"), "onnxruntime": (1, "onnxruntime"),
            "onnxruntime (model file)": ("model file", "onnxruntime"),
            "openvino (model file)": ("model file", "openvino")}
    # beside OpenVINO's region, the user's file on OpenVINO and on ONNX Runtime; ONNX
    # Runtime's region is past 10%
    assert alternates("openvino", ok, runs, 0.10) == [("openvino", 1.01, "model file"),
                                                      ("onnxruntime", 1.03, "model file")]
    # shipping the user's file: the regions are no alternates
    assert alternates("openvino (model file)", ok, runs, 0.10) == \
        [("onnxruntime", 1.03, "")]


def test_the_user_s_file_on_the_shipped_region_s_own_library_is_decided_at_load(tmp_path,
                                                                               monkeypatch):
    # TVM's import whole on ONNX Runtime won by 2% over the user's file on ONNX Runtime (the
    # transformers suite's vit on the AMX Xeon ran the file faster in the row): both are kept,
    # told apart by the file, and the load may run the user's file on the same library
    path = _block_onnx(tmp_path / "block.onnx")
    _clock(monkeypatch, {"onnxruntime": 0.100, "onnxruntime (model file)": 0.102})
    res = _optimize(path, tmp_path)
    assert res.report.shipped == "onnxruntime"
    assert not res.report.shipped_floor and not res.report.whole_model
    assert {"backend": "onnxruntime", "ms": 0.102, "source": "model file"} \
        in res.report.alternates
    ref, saved, entry = _saved(res, tmp_path, monkeypatch)
    assert entry["backend"] == "onnxruntime"
    mine = [a for a in entry["alternates"] if a["backend"] == "onnxruntime"]
    assert len(mine) == 1 and mine[0]["file"] == "regions/model_file.onnx"
    assert mine[0]["file"] != entry["file"]
    module = _load_choosing(saved, monkeypatch, "onnxruntime (model file)")
    assert module.decided["shipped"] == "onnxruntime"
    assert module.decided["chose"] == "onnxruntime (model file)"
    assert "onnxruntime" in module.decided["ms"] and module.decided["left_out"] == {}
    np.testing.assert_allclose(module(X), ref, rtol=1e-4, atol=1e-5)
    _direct_as_the_vm(module, entry)


def _direct_as_the_vm(module, entry):
    """The region the VM's main only calls (TVM's import exported whole), the user's file in
    its place: a numpy call is that file's library call itself, and gives the VM's outputs."""
    assert entry["passes_through"] is True and module.calls_library_directly
    on_vm = module.run_tvm([module.to_device(X, module.inputs[0])])[0].numpy()
    np.testing.assert_array_equal(module(X), on_vm)
