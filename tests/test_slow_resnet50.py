"""Minutes-long end-to-end runs on ResNet-50 (paper size): `make test-slow`."""
import math

import pytest

import collage_tvm
from collage_tvm.tools.zoo import export_onnx
from collage_tvm.check.contender import records

pytestmark = pytest.mark.slow

BACKENDS = ["tvm", "dnnl", "mkl", "onnxruntime", "openvino"]


@pytest.fixture(scope="module")
def resnet50_onnx(tmp_path_factory):
    return export_onnx("resnet50", "paper", str(tmp_path_factory.mktemp("m") / "resnet50.onnx"))


def test_resnet50_ships_the_fastest_correct_build_and_the_second_build_measures_nothing(
        resnet50_onnx, tmp_path):
    available = [b for b in BACKENDS if collage_tvm.get_backend(b).available()[0]]
    db = str(tmp_path / "costs.db")
    res = collage_tvm.optimize(resnet50_onnx, "llvm", available, db=db, compare=True,
                               progress=False)
    comp = records(res.report.comparison)
    # Every single-backend build was judged beside the placement, on the same inputs.
    assert "tvm-only" in comp and "collage" in comp
    for name in available[1:]:
        assert any(n == name or n.startswith(f"{name}+") for n in comp), (name, sorted(comp))
    assert comp["collage"]["match"], comp["collage"]
    shipped = comp[res.report.shipped]
    assert shipped["match"]
    fastest = min(r["ms"] for r in comp.values() if r["match"] and math.isfinite(r["ms"]))
    assert shipped["ms"] == fastest
    assert res.report.distinct_measured > 0
    again = collage_tvm.optimize(resnet50_onnx, "llvm", available, db=db, compare=True,
                                 progress=False)
    assert again.report.placement_from_log and again.report.distinct_measured == 0
    assert [(g.backend, g.nodes) for g in again.placement.groups] == \
        [(g.backend, g.nodes) for g in res.placement.groups]
