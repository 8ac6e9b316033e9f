"""`collage-tvm bench` end to end on a small zoo model: results written, every framework's
output checked against PyTorch (no timing assertions: these machines are noisy)."""
import json
import os

import pytest

from collage_tvm.cli import main
from collage_tvm.registry import get_backend


@pytest.mark.skipif(not get_backend("onnxruntime").available()[0], reason="no onnxruntime")
def test_bench_small_model_writes_results_and_checks_every_framework(tmp_path):
    out = str(tmp_path / "bench")
    rc = main(["bench", "dcgan", "--size", "small", "--backends", "tvm,onnxruntime",
               "--db", str(tmp_path / "c.db"), "--out", out])
    assert rc == 0
    results = json.load(open(os.path.join(out, "results.json")))
    (m,) = results["models"]
    assert m["model"] == "dcgan" and m["size"] == "small"
    comp = m["op-level"]["comparison"]
    assert {"tvm-only", "collage", "onnxruntime"} <= set(comp)
    assert all(r["match"] for r in comp.values())
    fw = m["frameworks"]
    assert {"pytorch", "onnxruntime", "collage"} <= set(fw)
    assert all(r["match"] for r in fw.values()), fw
    assert m["glue"]["match"]
    text = open(os.path.join(out, "results.md")).read()
    assert "| collage |" in text and "Frameworks" in text


def test_bench_rejects_unknown_models(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "alexnet"])
    assert "unknown model" in capsys.readouterr().err
