"""Precision as a placement dimension (issue #17): the accuracy budget, the bf16 variants
of the libraries, and the check that keeps a build outside the budget from shipping."""
import math

import numpy as np
import pytest
import tvm

import collage_tvm
from collage_tvm.placing import OUTSIDE_BUDGET, Placing, _within_budget
from collage_tvm.report import BuildReport
from collage_tvm.stores import open_db
from collage_tvm.check import graph_lib_groups, never_slower
from collage_tvm.registry import resolve_backends
from collage_tvm.graph import DataflowGraph
from collage_tvm.options import SearchOptions
from collage_tvm.placement import Placement
from collage_tvm.precision import Accuracy, cpu_precisions, parse_accuracy, relative_error
from collage_tvm.registry import get_backend, register_backend
from collage_tvm.target import make_target
from collage_tvm.tools.zoo import export_onnx
from collage_tvm.check.contender import records

BF16, BF16_WHY = cpu_precisions()["bf16"]
ORT = get_backend("onnxruntime").available()[0]


def test_budgets_parse_and_say_which_precisions_they_allow():
    assert parse_accuracy(None) == Accuracy() and parse_accuracy("strict").strict
    bf16 = parse_accuracy("bf16")
    assert bf16.allows("bf16") and bf16.tolerance == pytest.approx(2e-2)
    assert parse_accuracy("0.05").allows("bf16")
    tight = parse_accuracy(1e-3)  # within bf16's rounding: f32 only
    assert not tight.strict and not tight.allows("bf16") and tight.allows("f32")
    for bad in ("fast", "-1", "2"):
        with pytest.raises(ValueError, match="expected f32, bf16, int8 or a tolerance"):
            parse_accuracy(bad)
    # the strict default leaves the placement-log key as it was before precisions
    assert "accuracy" not in SearchOptions().key_variant()
    assert "|accuracy:0.02" in SearchOptions(accuracy="bf16").key_variant()


def test_relative_error_is_the_largest_error_over_the_output_scale():
    ref = [np.array([10.0, -20.0, 0.5], "float32")]
    assert relative_error([ref[0] + np.float32(0.2)], ref) == pytest.approx(0.01, rel=1e-5)
    assert relative_error([ref[0][:2]], ref) == math.inf
    assert relative_error([np.array([np.nan, -20.0, 0.5])], ref) == math.inf
    check = Accuracy("bf16", 2e-2).check([ref[0] + np.float32(0.2)], ref)
    assert check["match"] and not Accuracy().check([ref[0] + np.float32(0.2)], ref)["match"]


def test_the_strict_check_forgives_float32_rounding_of_huge_outputs_but_not_errors():
    # inception_v3 with random batch-norm statistics: outputs reach 1e9, and an element
    # near zero differs by thousands between two correct float32 builds. The strict check
    # had rejected every build but tvm-only, which then shipped 18x slower.
    rng = np.random.default_rng(0)
    ref = (rng.standard_normal(1000) * 1e9).astype("float32")
    ref[0] = 10.0
    rounded = ref.copy()
    rounded[0] += 3000.0   # 3e-6 of the scale: rounding
    assert Accuracy().check([rounded], [ref])["match"]
    wrong = ref.copy()
    wrong[0] += 1e7        # 1e-2 of the scale: an error
    assert not Accuracy().check([wrong], [ref])["match"]
    # At scale 1 nothing changes: 0.2 off a 20 is still a mismatch.
    small = [np.array([10.0, -20.0, 0.5], "float32")]
    assert not Accuracy().check([small[0] + np.float32(0.2)], small)["match"]


def test_the_strict_check_scales_with_tiny_outputs_so_wrong_ones_fail():
    """Random weights can leave a model's outputs at 1e-4: a fixed atol of 1e-3 would pass
    an all-zero (or sign-flipped) output as a match. The tolerance follows the scale."""
    rng = np.random.default_rng(0)
    ref = (rng.standard_normal((4, 10)) * 1e-4).astype("float32")
    strict = Accuracy()
    assert not strict.check([np.zeros_like(ref)], [ref])["match"]
    assert not strict.check([-ref], [ref])["match"]
    # float32 rounding of the same outputs still matches
    close = ref * (1 + 1e-5 * rng.standard_normal(ref.shape)).astype("float32")
    assert strict.check([close], [ref])["match"]


def test_a_strict_or_too_tight_budget_keeps_every_backend_f32():
    target = make_target("llvm")
    for budget in ("f32", 1e-3):
        backends, _ = resolve_backends(["openvino"], target, budget)
        assert all(b.precision == "f32" for b in backends.values()), budget
    with pytest.raises(ValueError, match="computes in bf16.*--accuracy bf16"):
        resolve_backends(["openvino_bf16"], target, "f32")


def test_a_bf16_budget_adds_the_bf16_variant_where_the_cpu_has_bf16():
    backends, skipped = resolve_backends(["openvino"], make_target("llvm"), "bf16")
    if BF16:
        ok = get_backend("openvino_bf16").available()
        assert "openvino_bf16" in backends or not ok[0], skipped
        assert "flag" in BF16_WHY  # which CPU flag was found
    else:
        assert "openvino_bf16" in skipped and "bf16" in skipped["openvino_bf16"]


class _Noisy(collage_tvm.Lowering):
    """onnxruntime with every output scaled by 1.1: a 'reduced precision' library whose
    error (~10% of the scale) breaks any bf16 budget."""

    def __init__(self):
        from collage_tvm.backends.onnxruntime import OnnxRuntimeLowering

        self.inner = OnnxRuntimeLowering()

    def available(self):
        return self.inner.available()

    def version(self):
        return "noisy-" + self.inner.version()

    def lower(self, func):
        call = self.inner.lower(func)

        def noisy(*args):
            out = call(*args)
            for t in out if isinstance(out, tuple) else [out]:
                np.from_dlpack(t)[...] *= 1.1
            return out

        return noisy


@pytest.mark.skipif(not ORT, reason="onnxruntime unavailable")
def test_a_build_whose_error_breaks_the_budget_is_not_shipped(tmp_path):
    from collage_tvm.frontend import load_model, normalize_for_collage
    from collage_tvm.patterns.graph_rule import exportable, one_anchor_group
    from collage_tvm.registry import add_backend_pattern_rule

    b = register_backend("noisy_bf16", kind="graph", precision="bf16", lowering=_Noisy())
    add_backend_pattern_rule("noisy_bf16", exportable, one_anchor_group, max_size=8)
    target = make_target("llvm")
    path = export_onnx("resnet_small", str(tmp_path / "r.onnx"))
    graph = DataflowGraph.from_module(normalize_for_collage(load_model(path)))
    backends = {"tvm": get_backend("tvm"), "noisy_bf16": b}
    noisy = Placement(graph_lib_groups(graph, b), math.nan)
    assert any(g.backend == "noisy_bf16" for g in noisy.groups)
    # the final comparison: the noisy build is reported with its error and not shipped
    verdict = never_slower(graph, noisy, backends, target, accuracy="bf16")
    assert not records(verdict.comparison)["collage"]["match"]
    assert records(verdict.comparison)["collage"]["rel_err"] == pytest.approx(0.1, rel=0.05)
    assert all(g.backend == "tvm" for g in verdict.placement.groups), verdict.shipped
    # without the comparison: the check against f32 still runs, and the search goes again
    # on the f32 backends
    report = BuildReport(backends=list(backends))
    options = SearchOptions(backends=("tvm", "noisy_bf16"), accuracy="bf16", isolate=False,
                            progress=False, calibrate_rounds=0, refine_rounds=0,
                            compare=False, graph_level=False)
    placed, placed_graph = _within_budget(
        Placing(graph, backends, target, open_db(str(tmp_path / "c.db")), options, report), noisy)
    assert placed_graph is graph and all(g.backend == "tvm" for g in placed.groups)
    assert not records(report.comparison)[OUTSIDE_BUDGET]["match"] and "f32" in report.shipped
    assert records(report.comparison)[OUTSIDE_BUDGET]["rel_err"] == pytest.approx(0.1, rel=0.05)


@pytest.mark.skipif(not (BF16 and get_backend("openvino_bf16").available()[0]),
                    reason="no bf16 on this CPU or no OpenVINO")
def test_openvino_in_bf16_is_placed_within_the_bf16_budget_and_reported(tmp_path):
    path = export_onnx("resnet_small", str(tmp_path / "r.onnx"))
    res = collage_tvm.optimize(path, "llvm", ["tvm", "openvino"], db=str(tmp_path / "c.db"),
                               accuracy="bf16", compare=True, progress=False,
                               calibrate_rounds=0, refine_rounds=0, graph_level=False)
    comp = records(res.report.comparison)
    assert "openvino_bf16" in res.report.backends and "openvino_bf16" in comp
    assert "flag" in res.report.precision["bf16"]  # which CPU flag allowed bf16
    bf16 = comp["openvino_bf16"]
    assert bf16["match"] and 1e-5 < bf16["rel_err"] <= 2e-2, bf16  # bf16 rounding, in budget
    assert comp["openvino"]["rel_err"] < 1e-5  # the f32 variant
    assert comp[res.report.shipped if res.report.shipped in comp else "collage"]["match"]
