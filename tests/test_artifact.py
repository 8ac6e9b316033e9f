"""A build taken away (issue #36): ``collage_tvm.save`` writes a directory that
``collage_tvm.load`` runs in a fresh process, bit-identical to the build, without searching,
measuring or compiling; every refusal names its cause; ``collage-tvm run`` runs and times it.

Which backend wins a group of these tiny models is the machine's call, so the builds that
need a library's region have the op-level search favour it (``_favour``); the regions, their
files, the builds and the outputs are real."""
import importlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
import torch
import tvm
from onnx import TensorProto, helper
from tvm import relax

import collage_tvm
from collage_tvm import ArtifactError, cli
from collage_tvm.registry import get_backend

artifact = importlib.import_module("collage_tvm.artifact")
# where ``load`` looks up ``host_cpu_features`` (the package's ``load`` is the function)
artifact_load = importlib.import_module("collage_tvm.artifact.load")
ns = importlib.import_module("collage_tvm.check.never_slower")

X = np.random.default_rng(3).standard_normal((1, 3, 16, 16)).astype("float32")


def _available(name):
    return get_backend(name).available()[0]


def _block_onnx(path) -> str:
    """conv -> Clip(0, 6) -> conv -> relu, input "x", output "y"."""
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
             helper.make_node("Relu", ["c2"], ["y"])]
    graph = helper.make_graph(nodes, "block",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])],
                              initializer=[w1, w2, lo, hi])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return str(path)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return _block_onnx(tmp_path_factory.mktemp("m") / "block.onnx")


def _favour(mp, backend: str) -> None:
    """The op-level search answers with ``backend`` wherever it has a candidate (cost 1e-3
    against 1 for TVM's, no per-call overhead), measuring nothing."""
    from collage_tvm.placer.op_stage import OpLevel
    from collage_tvm.candidates import generate_candidates
    from collage_tvm.placer.op_level import place

    def op_level(p):
        cands = generate_candidates(p.graph, p.backends.values())
        costs = {c: (1e-3 if c.backend == backend else 1.0) for c in cands}
        eps = {b: 0.0 for b in p.backends}
        return OpLevel(place(p.graph.producers, cands, costs, eps), cands, costs, eps, {})

    mp.setattr(importlib.import_module("collage_tvm.placing"), "_op_level", op_level)


def _build(model, db, backend: str | None, **kw):
    backends = ["tvm"] + ([backend] if backend else [])
    with pytest.MonkeyPatch.context() as mp:
        if backend:
            _favour(mp, backend)
        return collage_tvm.optimize(model, "llvm", backends, db=str(db), progress=False,
                                    isolate=False, graph_level=False, compare=False,
                                    calibrate_rounds=0, refine_rounds=0, switching=False, **kw)


def _run_build(res, x=X):
    return relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


# A fresh process: loads the artifact with every way to search, measure or compile TVM
# code made to fail, runs it on the numpy input and on a torch tensor, saves the outputs.
FRESH = r"""
import importlib, sys, numpy as np, torch, tvm
from tvm import relax
import collage_tvm
from collage_tvm.measure import measurer
build = importlib.import_module("collage_tvm.build")
stages = importlib.import_module("collage_tvm.stages")
lower = importlib.import_module("collage_tvm.byoc")

def refuse(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"load called {what}")
    return fail

tvm.compile = refuse("tvm.compile")
relax.build = refuse("relax.build")
build.search = stages.search = refuse("search")
build.optimize = refuse("optimize")
lower.compile_module = refuse("collage's TVM compile")
measurer.Measurer.__init__ = refuse("the measurer")
import onnx
onnx.load = refuse("onnx.load: a graph library reads its region's file itself")
module = collage_tvm.load(sys.argv[1])
x = np.load(sys.argv[2])
out = module(x)
out_torch = module(torch.from_numpy(x))
assert isinstance(out, np.ndarray) and isinstance(out_torch, torch.Tensor), (type(out), type(out_torch))
np.save(sys.argv[3], out)
np.save(sys.argv[4], out_torch.numpy())
print("load_seconds", module.load_seconds)
print("direct", module.calls_library_directly)
"""


def _fresh_process(path, tmp_path):
    np.save(tmp_path / "x.npy", X)
    script = tmp_path / "fresh.py"
    script.write_text(FRESH)
    proc = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / "x.npy"),
                           str(tmp_path / "out.npy"), str(tmp_path / "out_torch.npy")],
                          capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-3000:]
    _fresh_process.direct = "direct True" in proc.stdout
    return np.load(tmp_path / "out.npy"), np.load(tmp_path / "out_torch.npy")


@pytest.mark.parametrize("backend", ["onnxruntime", "openvino", "dnnl"])
def test_saved_build_runs_bit_identical_in_a_fresh_process_without_searching(
        backend, model_path, tmp_path):
    if not _available(backend):
        pytest.skip(f"{backend} is not available here")
    res = _build(model_path, tmp_path / "c.db", backend)
    assert res.report.ops_per_backend.get(backend), res.placement.groups
    ref = _run_build(res)
    path = collage_tvm.save(res, tmp_path / "art")
    manifest = json.loads((path / "manifest.json").read_text())
    region = manifest["regions"][0]
    assert region["backend"] == backend
    # a graph library's region is the ONNX file it loads; an operator library's, Relax
    assert region["format"] == ("relax" if backend == "dnnl" else "onnx")
    if region["format"] == "onnx":  # its input names: bound without parsing the file
        assert region["inputs"] == [i.name for i in onnx.load(str(path / region["file"])).graph.input]
    assert manifest["backends"][backend]["version"] == get_backend(backend).version()
    assert manifest["inputs"] == [{"name": "x", "shape": [1, 3, 16, 16], "dtype": "float32"}]
    assert manifest["placement"]["ops_per_backend"][backend] >= 1
    assert (path / "kernels.so").is_file() and (path / "placement.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".art.")]  # no leftovers
    out, out_torch = _fresh_process(path, tmp_path)
    assert np.array_equal(out, ref) and np.array_equal(out_torch, ref)
    # TVM's import whole on one graph library: main only calls the region, so a numpy call
    # goes to the library's own call (no VM, no copies), and gives the VM's outputs
    if backend != "dnnl":
        assert region["sole"] and region["passes_through"] is True, region
    assert _fresh_process.direct == (backend != "dnnl")


@pytest.mark.skipif(not _available("openvino_bf16"),
                    reason="needs OpenVINO and a CPU with bf16 instructions")
def test_a_bf16_region_records_the_cpu_features_it_needs(model_path, tmp_path):
    res = _build(model_path, tmp_path / "c.db", "openvino_bf16", accuracy="bf16")
    assert res.report.ops_per_backend.get("openvino_bf16"), res.placement.groups
    path = collage_tvm.save(res, tmp_path / "art")
    module = collage_tvm.load(path)
    assert {"any_of": list(artifact.BF16_FEATURES), "for": "the bf16 regions on openvino_bf16"
            } in module.manifest["cpu_needs"]
    assert module.manifest["accuracy"] == "bf16"
    assert np.array_equal(module(X), _run_build(res))


def test_a_build_all_on_tvm_saves_and_loads(tmp_path):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    y = relax.Var("y", relax.TensorType((4, 8), "float32"))
    with bb.function("main", [x, y]):
        with bb.dataflow():
            a = bb.emit(relax.op.add(x, y))
            out = bb.emit_output(relax.Tuple([relax.op.nn.relu(a), a]))
        bb.emit_func_output(out)
    res = _build(bb.get(), tmp_path / "c.db", None)
    path = collage_tvm.save(res, tmp_path / "art", output_names=["relu", "sum"])
    module = collage_tvm.load(path)
    assert module.manifest["regions"] == [] and module.output_names == ["relu", "sum"]
    a, b = (np.random.default_rng(k).standard_normal((4, 8)).astype("float32") for k in (0, 1))
    relu, total = module(y=b, x=a)  # by name, in any order
    np.testing.assert_array_equal(total, a + b)
    np.testing.assert_array_equal(relu, np.maximum(a + b, 0))
    with pytest.raises(ValueError, match=r"input x: expected float32\[4, 8\], got float64"):
        module(a.astype("float64"), b)
    with pytest.raises(TypeError, match="takes 2 input"):
        module(a)
    _timed_as_a_user_calls_it(module, [a, b], [np.maximum(a + b, 0), a + b], "numpy")


@pytest.mark.parametrize("library", ["onnxruntime", "openvino"])
def test_the_model_file_that_won_the_final_check_saves_and_loads(model_path, tmp_path,
                                                                  monkeypatch, library):
    if not _available(library):
        pytest.skip(f"{library} is not available here")
    real = ns.evaluate
    monkeypatch.setattr(ns, "evaluate", lambda *a, **k: {**real(*a, **k), "ms": 1.0})
    monkeypatch.setattr(importlib.import_module("collage_tvm.check.runoff"), "interleaved",
                        lambda runs, **kw: {
        n: (0.1 if n == f"{library} (model file)" else 1.0) for n in runs})
    res = collage_tvm.optimize(model_path, "llvm", ["tvm", library],
                               db=str(tmp_path / "c.db"), progress=False, isolate=False,
                               graph_level=False, calibrate_rounds=0, refine_rounds=0)
    monkeypatch.undo()
    assert res.graph is None and res.report.shipped_floor
    ref = _run_build(res)
    path = collage_tvm.save(res, tmp_path / "art")
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["regions"][0]["label"] == "the model file, whole"
    assert manifest["placement"]["whole_model"]["backend"] == library
    # the model file's own names, not the Relax parameters' (in0)
    assert [i["name"] for i in manifest["inputs"]] == ["x"]
    assert [o["name"] for o in manifest["outputs"]] == ["y"]
    # OpenVINO's region also in its own form (IR), which the load reads instead of the ONNX
    native = sorted(f for f in manifest["files"] if ".ov." in f)
    assert native == (["regions/r0.ov.bin", "regions/r0.ov.xml"] if library == "openvino"
                      else [])
    module = collage_tvm.load(path)
    assert np.array_equal(module(X), ref)
    assert np.array_equal(_run_build(res), ref)  # the build's own callable is still registered
    if native:  # (the IR alone serves: the region's ONNX file is not read)
        lowering = get_backend("openvino").get_lowering()
        moved = tmp_path / "ir"
        moved.mkdir()
        for f in ("r0.ov.xml", "r0.ov.bin"):
            shutil.copy(path / "regions" / f, moved / f)
        compiled = lowering.compile_source(str(moved / "r0.onnx"))
        assert len(compiled.outputs) == 1
    # numpy goes straight to the library's own call (no copy into a TVM tensor, no VM), and
    # gives what the VM gives, for a read-only or strided array too
    assert manifest["regions"][0]["model_file"] is True and module.calls_library_directly
    assert np.array_equal(module.run_tvm([module.to_device(X, module.inputs[0])])[0].numpy(),
                          ref)
    frozen = X.copy()
    frozen.flags.writeable = False
    strided = np.repeat(X, 2, axis=-1)[..., ::2]
    assert not strided.flags.c_contiguous
    for x in (frozen, strided):
        assert np.array_equal(module(x), ref)
    with pytest.raises(ValueError, match=r"input x: expected float32.*got float64"):
        module(X.astype("float64"))
    # the suites time it as a user calls it (numpy in, numpy out: here the library's own
    # call), its VM on TVM tensors beside it
    _timed_as_a_user_calls_it(module, [X], [ref], "numpy, the library's own call")


def test_the_direct_call_takes_the_short_way_only_with_arrays_it_can_hand_over():
    from collage_tvm.artifact.loaded import _fast_direct

    calls = []

    def direct(*arrays):
        calls.append(arrays)
        return ["out"]

    f32 = np.dtype("float32")
    fast = _fast_direct(direct, [(f32, (2, 3))], False)
    x = np.zeros((2, 3), "float32")
    assert fast((x,)) == ["out"] and calls[-1][0] is x  # handed over as it is
    frozen = x.copy()
    frozen.flags.writeable = False
    for other in [(x.astype("float64"),), (np.zeros((3, 3), "float32"),), (frozen,),
                  (np.zeros((2, 6), "float32")[:, ::2],), (x, x), ([[0.0] * 3] * 2,), ()]:
        assert fast(other) is None  # the full check's turn: it converts or names the error
    assert len(calls) == 1
    # a dynamic model's shapes are its dispatch's to check; several inputs
    ranged = _fast_direct(direct, [(f32, None), (np.dtype("int64"), None)], True)
    assert ranged((np.zeros((5, 3), "float32"), np.zeros(4, "int64"))) == ["out"]
    assert ranged((np.zeros((5, 3), "float32"), np.zeros(4, "int32"))) is None
    assert _fast_direct(direct, [(f32, None)], False) is None  # (a shape nobody checks)
    assert _fast_direct(None, [(f32, (1,))], False) is None


def _timed_as_a_user_calls_it(module, arrays, expected, call):
    from collage_tvm.tools import bench

    runs, outs, extra = {}, {}, {}
    bench._collage_runs({"collage": module}, arrays, runs, outs, extra)
    assert set(runs) == {"collage", bench.COLLAGE_ON_TENSORS}
    assert extra["collage"]["call"] == call
    assert extra[bench.COLLAGE_ON_TENSORS]["call"] == "TVM tensors"
    got = runs["collage"]()
    got = list(got) if isinstance(got, tuple) else [got]
    assert all(isinstance(g, np.ndarray) for g in got)
    for figure in (got, outs["collage"], outs[bench.COLLAGE_ON_TENSORS]):
        assert len(figure) == len(expected)
        for g, e in zip(figure, expected):
            np.testing.assert_array_equal(g, e)


def test_a_model_tvm_cannot_import_saves_and_loads(tmp_path):
    if not _available("onnxruntime"):
        pytest.skip("onnxruntime is not available here")

    class Lstm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = torch.nn.LSTM(8, 16, batch_first=True)

        def forward(self, x):
            return self.lstm(x)[0][:, -1]

    path = str(tmp_path / "lstm.onnx")
    torch.onnx.export(Lstm().eval(), (torch.randn(1, 5, 8),), path, dynamo=False,
                      opset_version=17, input_names=["seq"], output_names=["last"])
    res = _build(path, tmp_path / "c.db", "onnxruntime")
    assert res.graph is None and "LSTM" in res.report.whole_model["why"]
    x = np.random.default_rng(0).standard_normal((1, 5, 8)).astype("float32")
    module = collage_tvm.load(collage_tvm.save(res, tmp_path / "art"))
    assert module.input_names == ["seq"] and module.output_names == ["last"]
    assert np.array_equal(module(x), _run_build(res, x))


@pytest.fixture(scope="module")
def saved(model_path, tmp_path_factory):
    """An artifact with an onnxruntime region (or all TVM where onnxruntime is missing)."""
    tmp = tmp_path_factory.mktemp("saved")
    backend = "onnxruntime" if _available("onnxruntime") else None
    res = _build(model_path, tmp / "c.db", backend)
    return collage_tvm.save(res, tmp / "art"), _run_build(res)


@pytest.fixture
def copy(saved, tmp_path):
    """A copy of the saved artifact to damage, and a writer of its edited manifest."""
    path = shutil.copytree(saved[0], tmp_path / "art")
    manifest = json.loads((path / "manifest.json").read_text())

    def edit(change):
        change(manifest)
        (path / "manifest.json").write_text(json.dumps(manifest))

    return path, manifest, edit


def test_an_unknown_format_version_is_refused(copy):
    path, _, edit = copy
    edit(lambda m: m.update(format_version=99))
    with pytest.raises(ArtifactError, match="format version 99 is newer than this collage-tvm"):
        collage_tvm.load(path)
    edit(lambda m: m.update(format_version=0))
    with pytest.raises(ArtifactError, match="format version 0 is not one .* export the model"):
        collage_tvm.load(path)


def test_another_library_version_is_refused_naming_the_one_to_install(copy):
    path, manifest, edit = copy
    if not manifest["backends"]:
        pytest.skip("no library region (onnxruntime is not available here)")
    edit(lambda m: m["backends"]["onnxruntime"].update(version="onnxruntime-0.9.0-in-place"))
    with pytest.raises(ArtifactError, match=r"built with onnxruntime-0\.9\.0-in-place .* this "
                                            r"machine has onnxruntime-.*: install onnxruntime-0\.9"):
        collage_tvm.load(path)


def test_another_tvm_is_refused(copy):
    path, _, edit = copy
    edit(lambda m: m["versions"].update(tvm="0.1.0"))
    with pytest.raises(ArtifactError, match=r"built with TVM 0\.1\.0; this is TVM .*install TVM 0\.1\.0"):
        collage_tvm.load(path)


def test_a_missing_library_is_refused(copy, monkeypatch):
    path, manifest, edit = copy
    if not manifest["backends"]:
        pytest.skip("no library region (onnxruntime is not available here)")
    # installed, but it does not load here
    monkeypatch.setattr(get_backend("onnxruntime"), "available",
                        lambda: (False, "ModuleNotFoundError: No module named 'onnxruntime'"))
    with pytest.raises(ArtifactError, match=r"on onnxruntime, which cannot run here \(Module"
                                            r"NotFoundError.*\): install onnxruntime-"):
        collage_tvm.load(path)
    monkeypatch.undo()

    def unknown(m):  # a library this collage-tvm has no backend for
        m["backends"]["nosuchlib"] = m["backends"].pop("onnxruntime")
        m["regions"][0]["backend"] = "nosuchlib"

    edit(unknown)
    with pytest.raises(ArtifactError, match="backend 'nosuchlib' .* does not know"):
        collage_tvm.load(path)


@pytest.mark.parametrize("damage", ["no kernels", "no region", "truncated region",
                                    "no manifest", "truncated manifest"])
def test_a_missing_or_truncated_file_is_refused(copy, damage):
    path, manifest, _ = copy
    region = manifest["regions"][0]["file"] if manifest["regions"] else "kernels.so"
    if damage == "no kernels":
        os.remove(path / "kernels.so")
        match = "incomplete: kernels.so is missing"
    elif damage == "no region":
        os.remove(path / region)
        match = f"incomplete: {region} is missing"
    elif damage == "truncated region":
        data = (path / region).read_bytes()
        (path / region).write_bytes(data[: len(data) // 2])
        match = f"{region} has {len(data) // 2} bytes, the manifest says {len(data)}"
    elif damage == "no manifest":
        os.remove(path / "manifest.json")
        match = "not a collage-tvm artifact: it has no manifest.json"
    else:
        text = (path / "manifest.json").read_text()
        (path / "manifest.json").write_text(text[: len(text) // 2])
        match = "manifest.json is damaged or truncated"
    with pytest.raises(ArtifactError, match=match):
        collage_tvm.load(path)


def test_a_cpu_without_a_feature_the_build_needs_is_refused(copy, monkeypatch):
    path, manifest, edit = copy
    host = artifact.host_cpu_features()
    if host is None:
        pytest.skip("this TVM cannot read the CPU's features")
    kernels = manifest["cpu_needs"][0]["features"]
    assert kernels and set(kernels) <= host  # what the kernels need, this CPU has
    lacking = kernels[-1]
    monkeypatch.setattr(artifact_load, "host_cpu_features", lambda: host - {lacking})
    with pytest.raises(ArtifactError, match=f"this CPU lacks {lacking}, which TVM's kernels"):
        collage_tvm.load(path)
    # a bf16 region on a CPU without bf16 instructions
    edit(lambda m: m.update(cpu_needs=[{"any_of": list(artifact.BF16_FEATURES),
                                        "for": "the bf16 regions on openvino_bf16"}]))
    monkeypatch.setattr(artifact_load, "host_cpu_features",
                        lambda: host - set(artifact.BF16_FEATURES))
    with pytest.raises(ArtifactError, match="has none of avx512bf16 / amx-bf16, which the bf16 "
                                            "regions on openvino_bf16 need"):
        collage_tvm.load(path)


def test_a_save_replaces_an_artifact_whole_or_leaves_it_as_it_was(saved, tmp_path, model_path,
                                                                  monkeypatch):
    res = _build(model_path, tmp_path / "c.db", None)
    path = shutil.copytree(saved[0], tmp_path / "art")
    before = (path / "manifest.json").read_text()

    class Broken:
        def export_library(self, _):
            raise RuntimeError("disk full")

    monkeypatch.setattr(res, "executable", Broken())
    with pytest.raises(ArtifactError, match="could not write its kernels"):
        collage_tvm.save(res, path)
    assert (path / "manifest.json").read_text() == before  # the old one, whole
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".art.")]  # no leftovers
    monkeypatch.undo()
    collage_tvm.save(res, path)  # an artifact is replaced
    assert collage_tvm.load(path).manifest["regions"] == []
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="not a collage-tvm artifact: not replaced"):
        collage_tvm.save(res, tmp_path / "other")


def test_cli_optimize_exports_and_run_writes_outputs_and_latency_percentiles(
        model_path, tmp_path, capsys):
    art = tmp_path / "art"
    code = cli.main(["optimize", model_path, "--backends", "tvm,onnxruntime", "--db",
                     str(tmp_path / "c.db"), "--no-graph-level", "--no-compare", "--calibrate",
                     "0", "--refine", "0", "--in-process", "--export", str(art)])
    assert code == 0
    assert f"exported to {art}" in capsys.readouterr().out
    module = collage_tvm.load(art)
    assert module.input_names == ["x"] and module.output_names == ["y"]  # the ONNX file's
    np.savez(tmp_path / "x.npz", x=X)
    code = cli.main(["run", str(art), "--inputs", str(tmp_path / "x.npz"), "--output",
                     str(tmp_path / "y.npz"), "--bench", "20"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "output y: float32[1, 8, 16, 16]" in out
    assert "latency over 20 runs after 3 warm-up: p50 " in out and " p90 " in out and " p99 " in out
    np.testing.assert_array_equal(np.load(tmp_path / "y.npz")["y"], module(X))
    # refusals and bad inputs: one line, exit code 2
    np.savez(tmp_path / "bad.npz", z=X)
    assert cli.main(["run", str(art), "--inputs", str(tmp_path / "bad.npz")]) == 2
    assert "collage-tvm: error: --inputs" in capsys.readouterr().err
    assert cli.main(["run", str(tmp_path / "nothing")]) == 2
    assert "collage-tvm: error:" in capsys.readouterr().err


def test_torch_tensors_in_torch_tensors_out(saved):
    path, ref = saved
    module = collage_tvm.load(path)
    out = module(torch.from_numpy(X))
    assert isinstance(out, torch.Tensor) and np.array_equal(out.numpy(), ref)
    assert isinstance(module.vm, relax.VirtualMachine)
    got = module.vm["main"](tvm.runtime.tensor(X)).numpy()
    assert np.array_equal(got, ref)


def test_bench_deploy_row_loads_in_a_fresh_process_beside_an_onnxruntime_session(tmp_path):
    """``bench --deploy``'s row (issue #36's figures): saved, loaded in a fresh process, the
    outputs bit-identical to the in-process build's, both timed; the docs render it."""
    if not _available("onnxruntime"):
        pytest.skip("needs onnxruntime")
    from collage_tvm.tools import docs
    from collage_tvm.tools.deploy import deploy_row

    path = _block_onnx(str(tmp_path / "block.onnx"))
    res = collage_tvm.optimize(path, "llvm", ["tvm", "onnxruntime"], db=str(tmp_path / "c.db"),
                               graph_level=False, compare=False, progress=False)
    row = deploy_row(path, res, str(tmp_path), "block", rounds=2)
    assert row["identical"], row
    for key in ("save_s", "load_s", "ort_session_s", "first_run_s", "in_process_ms",
                "loaded_ms"):
        assert row[key] > 0, (key, row)
    assert row["bytes"] > 0 and row["load_vs_ort"] == row["load_s"] / row["ort_session_s"]
    table = docs.deploy_table([{"machine": {"cpu": "X", "cores": 2},
                                "models": [{"model": "block", "size": "small", "deploy": row}]}])
    assert "| block | small |" in table and "| yes |" in table


def _main_calling(symbol: str, order=(0, 1), outputs=2, field_order=None, then_relu=False):
    """A Relax main that calls packed function ``symbol`` on its two parameters in
    ``order`` and returns its ``outputs`` (a tuple's fields in ``field_order``)."""
    bb = relax.BlockBuilder()
    params = [relax.Var(n, relax.TensorType((2, 3), "float32")) for n in ("a", "b")]
    ret = relax.TensorType((2, 3), "float32")
    ret = ret if outputs == 1 else relax.TupleType([ret] * outputs)
    with bb.function("main", params):
        with bb.dataflow():
            call = bb.emit(relax.op.call_pure_packed(symbol, *[params[k] for k in order],
                                                     ty_args=ret))
            if outputs == 1:
                out = bb.emit(relax.op.nn.relu(call)) if then_relu else call
            else:
                items = [bb.emit(relax.TupleGetItem(call, j)) for j in range(outputs)]
                out = relax.Tuple([items[j] for j in (field_order or range(outputs))])
            out = bb.emit_output(out)
        bb.emit_func_output(out)
    return bb.get()["main"]


def test_a_main_that_only_calls_its_region_on_its_inputs_is_told_apart():
    """The numpy call goes straight to a region's library only where the VM's main does
    nothing else: every parameter in order, the outputs as the region gives them."""
    from collage_tvm.artifact import _passes_through

    assert _passes_through(_main_calling("r.0"), "r.0", 2)
    assert _passes_through(_main_calling("r.0", outputs=1), "r.0", 1)
    assert not _passes_through(_main_calling("r.0"), "r.1", 2)  # another region
    assert not _passes_through(_main_calling("r.0", order=(1, 0)), "r.0", 2)  # swapped inputs
    assert not _passes_through(_main_calling("r.0", order=(0, 0)), "r.0", 2)  # one unused
    assert not _passes_through(_main_calling("r.0", field_order=(1, 0)), "r.0", 2)
    assert not _passes_through(_main_calling("r.0", outputs=1, then_relu=True), "r.0", 1)
