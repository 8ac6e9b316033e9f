"""SearchOptions: one object for what a search takes, and the placement-log key it gives."""
import dataclasses

import pytest

from collage_tvm.options import Evolution, FinalCheck, SearchOptions


def test_every_option_declares_whether_it_is_part_of_the_placement_log_key():
    for f in dataclasses.fields(SearchOptions):
        assert "key" in f.metadata, f"SearchOptions.{f.name} says nothing about the key"
        if f.metadata["key"] is None:
            assert f.metadata.get("why"), f"SearchOptions.{f.name} is left out without a reason"


def test_an_option_added_without_a_key_declaration_cannot_make_a_key():
    @dataclasses.dataclass(frozen=True)
    class WithNewOption(SearchOptions):
        precision: str = "float32"

    with pytest.raises(TypeError, match="precision"):
        WithNewOption().key_variant()


def test_the_defaults_find_the_best_every_backend_both_levels_and_the_final_check():
    """Issue #33: with no options a search uses every backend that loads here, both levels
    with a bounded budget, and the final check (the model file on each library the floor)."""
    from collage_tvm.registry import get_backend, list_backends, resolve_backends
    from collage_tvm.target import make_target

    base = SearchOptions()
    assert base.backends == () and base.graph_level and base.compare
    assert 0 < base.budget <= 120
    backends, skipped = resolve_backends(base.backends, make_target("llvm"))
    cpu_f32 = {n for n in list_backends() if get_backend(n).device == "cpu"
               and get_backend(n).precision == "f32" and get_backend(n).variant_of is None}
    assert {"tvm", "onnxruntime", "openvino"} <= cpu_f32
    assert set(backends) | set(skipped) == cpu_f32 | {"tvm"}
    assert "cudnn" not in set(backends) | set(skipped)  # another device's library


def test_key_changes_with_search_options_and_not_with_display_ones():
    base = SearchOptions(graph_level=False)
    # The same variant text the placement log was keyed with before SearchOptions existed,
    # so logs written by earlier builds still hit.
    assert base.key_variant() == "|switching|refined2|calibrated4"
    assert SearchOptions().key_variant() == "|switching|graph-level|refined2|calibrated4"
    assert SearchOptions(switching=False, refine_rounds=0, calibrate_rounds=0,
                         graph_level=False).key_variant() == ""
    for same in (dict(progress=False), dict(isolate=False), dict(budget=10.0),
                 dict(on_generation=print), dict(build_jobs=4), dict(compare=False),
                 dict(evolution=Evolution()), dict(final_check=FinalCheck(runoff_rounds=3))):
        assert SearchOptions(graph_level=False, **same).key_variant() == base.key_variant(), same
    for other in (dict(switching=False), dict(refine_rounds=1), dict(calibrate_rounds=0),
                  dict(graph_level=True), dict(lean=False),
                  dict(evolution=Evolution(population=20)), dict(evolution={"cxpb": 0.5})):
        assert SearchOptions(**{"graph_level": False, **other}).key_variant() != \
            base.key_variant(), other


def test_options_from_keywords_name_an_unknown_one_and_check_values():
    opts = SearchOptions.of(None, backends="tvm,dnnl,mkl", graph_level=True, budget=None)
    assert opts.backends == ("tvm", "dnnl", "mkl") and opts.graph_level
    assert opts.budget == SearchOptions().budget
    assert SearchOptions.of(opts, compare=True).graph_level  # changes keep the rest
    with pytest.raises(TypeError, match="graph_levle.*known: .*graph_level"):
        SearchOptions.of(None, graph_levle=True)
    with pytest.raises(ValueError, match="refine_rounds"):
        SearchOptions(refine_rounds=-1)
    with pytest.raises(ValueError, match="budget"):
        SearchOptions(budget=0)
    with pytest.raises(ValueError, match="build_jobs must be >= 0"):
        SearchOptions(build_jobs=-1)
    with pytest.raises(ValueError, match="population must be >= 2"):
        SearchOptions(evolution={"population": 1})
    with pytest.raises(ValueError, match="probabilities"):
        SearchOptions(evolution=Evolution(mutpb=1.5))
    assert SearchOptions(evolution={"patience": 9}).evolution == Evolution(patience=9)


def test_the_graph_levels_evolution_settings_reach_its_search(monkeypatch):
    """``SearchOptions.evolution`` is what ``GraphLevelSearch.run`` is given (population,
    patience, crossover and mutation probabilities, immigrants), not run's own defaults."""
    import importlib

    from collage_tvm.report import BuildReport

    placing = importlib.import_module("collage_tvm.placing")
    seen = {}

    class Search:
        n_genes = 0  # (nothing the final check times anyway: ``_timed_anyway``)

        def __init__(self, *a, **kw):
            self.eligible = [1]

        def run(self, **kw):
            seen.update(kw)
            raise StopIteration  # what it was given is all this test reads

    monkeypatch.setattr(placing, "GraphLevelSearch", Search)
    evolution = Evolution(population=7, patience=2, cxpb=0.3, mutpb=0.9, immigrants=0)
    p = placing.Placing(None, {"onnxruntime": type("B", (), {"kind": "graph", "rules": [1]})()},
                        None, None, SearchOptions(evolution=evolution, budget=3.0),
                        BuildReport(backends=[]))
    with pytest.raises(StopIteration):
        placing._graph_level(p, None, evaluate=lambda groups: (1.0, None))
    assert {k: seen[k] for k in ("population", "patience", "cxpb", "mutpb", "immigrants")} \
        == dataclasses.asdict(evolution)
    assert seen["budget_s"] == 3.0


def test_the_cli_reads_build_jobs_and_refuses_a_negative_count(capsys):
    from collage_tvm.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["optimize", "model.onnx", "--build-jobs", "-2"])
    assert exit_.value.code == 2
    assert "expected a number of processes >= 0, got '-2'" in capsys.readouterr().err


def test_optimize_rejects_an_unknown_option_before_doing_any_work(tmp_path):
    import collage_tvm

    with pytest.raises(TypeError, match="unknown search option"):
        collage_tvm.optimize(str(tmp_path / "missing.onnx"), "llvm", ["tvm"], graph_levle=True)
