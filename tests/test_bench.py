"""`collage-tvm bench` end to end on a small zoo model: results written, every framework's
output (torch.compile included) checked against PyTorch, the plots written, and the
ablation's steps checked against each other (no timing assertions: these machines are
noisy). One bench run, with ``--ablation``, serves every test here but the slow one of
``--rewrite`` (its own run: ~20 s more of the default test run for a path
``tests/test_rewrite.py`` covers otherwise)."""
import json
import os
import sys

import pytest

from collage_tvm.cli import main
from collage_tvm.registry import get_backend

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

needs_ort = pytest.mark.skipif(not get_backend("onnxruntime").available()[0],
                               reason="no onnxruntime")


def _bench(tmp, *flags):
    """(output folder, its results.json) of ``bench dcgan --size small`` with ``flags``."""
    out = str(tmp / "out")
    rc = main(["bench", "dcgan", "--size", "small", "--backends", "tvm,onnxruntime",
               "--no-graph-level", *flags, "--db", str(tmp / "c.db"), "--out", out])
    assert rc == 0
    return out, json.load(open(os.path.join(out, "results.json")))


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """``bench dcgan --size small --ablation``: (output folder, its results.json)."""
    return _bench(tmp_path_factory.mktemp("bench"), "--ablation")


@needs_ort
def test_bench_small_model_writes_results_and_checks_every_framework(bench_run):
    out, results = bench_run
    (m,) = results["models"]
    assert m["model"] == "dcgan" and m["size"] == "small"
    comp = m["op-level"]["comparison"]
    assert {"tvm-only", "collage", "onnxruntime"} <= set(comp)
    # tvm-only is not built when the search found TVM alone hopeless (its reason says so);
    # every build that was built matches the reference
    built = {n: r for n, r in comp.items() if not r.get("skipped")}
    assert all(r["match"] for r in built.values()), comp
    assert "tvm-only" in built or "not built" in comp["tvm-only"]["error"]
    assert any(r.get("reference") for r in built.values()), comp
    fw = m["frameworks"]
    assert {"pytorch", "torch.compile", "onnxruntime", "collage"} <= set(fw)
    assert "error" not in fw["torch.compile"], fw["torch.compile"]
    assert fw["torch.compile"]["compile_s"] > 0
    assert all(r["match"] for n, r in fw.items() if r.get("precision", "f32") == "f32"), fw
    # each framework at its own default precision too, its error against PyTorch in f32
    default = fw["pytorch (bf16 autocast)"]
    assert default["precision"] == "bf16" and 0 < default["rel_err"] < 0.1, default
    assert fw["pytorch"]["rel_err"] == 0.0 and m["accuracy"] == "f32"
    assert m["glue"]["onnxruntime"]["match"]
    text = open(os.path.join(out, "results.md")).read()
    assert "| collage |" in text and "| torch.compile |" in text and "Frameworks" in text


@needs_ort
def test_bench_plots_collage_speedups_as_png(bench_run):
    out, results = bench_run
    from collage_tvm.tools.bench import speedups

    with open(os.path.join(out, "results.png"), "rb") as f:
        assert f.read(8) == PNG_MAGIC
    bars = speedups(results["models"][0])
    # every framework but Collage itself, and every single-backend build that was built
    comp = results["models"][0]["op-level"]["comparison"]
    assert {"PyTorch eager", "torch.compile", "ONNX Runtime", "onnxruntime build"} <= set(bars)
    assert ("tvm-only build" in bars) == (not comp["tvm-only"].get("skipped"))
    assert all(v > 0 for v, _ in bars.values())
    assert all(match for label, (_, match) in bars.items() if "bf16" not in label
               and "default" not in label)


@needs_ort
def test_bench_ablation_adds_backends_one_at_a_time(bench_run):
    out, results = bench_run
    steps = results["models"][0]["ablation"]
    assert [s["backends"] for s in steps] == [["tvm"], ["tvm", "onnxruntime"]]
    assert all(s["match"] and s["ms"] > 0 for s in steps), steps
    assert set(steps[0]["ops_per_backend"]) == {"tvm"}
    assert "| tvm, onnxruntime |" in open(os.path.join(out, "results.md")).read()
    with open(os.path.join(out, "results_ablation.png"), "rb") as f:
        assert f.read(8) == PNG_MAGIC


@needs_ort
@pytest.mark.slow
def test_bench_rewrite_times_placed_only_beside_rewritten_and_placed(tmp_path):
    out, results = _bench(tmp_path, "--rewrite")
    steps = results["models"][0]["rewrite"]
    assert [s["label"] for s in steps] == ["placed", "rewritten+placed"]
    assert all(s["match"] and s["ms"] > 0 for s in steps), steps
    assert "rewrite" not in steps[0] and steps[1]["rewrite"]["graphs"] >= 1
    assert "| rewritten+placed |" in open(os.path.join(out, "results.md")).read()


def test_plot_leaves_out_failed_entries_and_keeps_mismatched_ones(tmp_path):
    from collage_tvm.tools.bench import plot, plot_ablation, speedups

    nan = float("nan")
    m = {"model": "toy",
         "op-level": {"shipped": "collage", "comparison": {
             "tvm-only": {"ms": 4.0, "match": True}, "collage": {"ms": 1.0, "match": True},
             "dnnl+tvm": {"ms": float("inf"), "match": False, "error": "boom"}}},
         "frameworks": {"pytorch": {"ms": 3.0, "match": True},
                        "torch.compile": {"ms": nan, "match": False, "error": "no compiler"},
                        "openvino": {"ms": 0.5, "match": False},
                        "collage": {"ms": 2.0, "match": True}},
         "ablation": [{"backends": ["tvm"], "ms": 4.0, "match": True},
                      {"backends": ["tvm", "dnnl"], "ms": 2.0, "match": False}]}
    assert speedups(m) == {"PyTorch eager": (1.5, True), "OpenVINO": (0.25, False),
                           "tvm-only build": (4.0, True)}
    results = {"machine": {"cpu": "test", "cores": 2}, "models": [m]}
    for fn, name in ((plot, "r.png"), (plot_ablation, "a.png")):
        with open(fn(results, str(tmp_path / name)), "rb") as f:
            assert f.read(8) == PNG_MAGIC


def test_bench_rejects_unknown_models(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "alexnet"])
    assert "unknown model" in capsys.readouterr().err


def test_a_failing_model_is_reported_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    from collage_tvm.tools import bench

    def fake(name, *a, **k):
        if name == "bert":
            raise ValueError("groups form a cycle; no executable order\nmore detail")
        return {"model": name, "size": "small"}

    monkeypatch.setattr(bench, "bench_model", fake)
    monkeypatch.setattr(bench, "plot", lambda results, path: path)
    res = bench.run(["bert", "dcgan"], str(tmp_path), ["tvm"], size="small")
    assert [m["model"] for m in res["models"]] == ["bert", "dcgan"]
    assert res["models"][0]["error"] == "ValueError: groups form a cycle; no executable order"
    saved = json.load(open(tmp_path / "results.json"))
    assert saved["models"][0]["error"].startswith("ValueError")
    assert "### bert: FAILED" in open(tmp_path / "results.md").read()
    assert "bert: FAILED" in capsys.readouterr().out


def test_without_matplotlib_the_plots_are_skipped_with_a_message(tmp_path, monkeypatch, capsys):
    from collage_tvm.tools import bench

    monkeypatch.setattr(bench, "bench_model", lambda name, *a, **k: {"model": name,
                                                                     "size": "small"})
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    res = bench.run(["dcgan"], str(tmp_path), ["tvm"], size="small", ablation=True)
    assert res["files"] == ["results.json", "results.md"]
    assert sorted(os.listdir(tmp_path)) == ["results.json", "results.md"]
    out = capsys.readouterr().out
    for png in ("results.png", "results_ablation.png"):
        assert f"{png} not written" in out and "pip install 'collage-tvm[plot]'" in out, out
