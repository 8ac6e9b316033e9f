"""The docs' measured tables are rendered from the results files committed beside them
(issue #34): the committed pages match a fresh rendering, and a changed results file shows."""
import json

import pytest

from collage_tvm.tools import docs


def test_the_committed_pages_are_what_their_results_files_render():
    assert docs.main(["--check"]) == 0


def _report(ms):
    return {"target": "llvm", "shipped": "collage",
            "comparison": {"collage": {"ms": ms, "match": True, "max_err": 1e-7,
                                       "rel_err": 1e-7, "ops": {"openvino": 3, "tvm": 1}},
                           "tvm-only": {"ms": 9.0, "match": True, "max_err": 0.0,
                                        "rel_err": 0.0, "ops": {"tvm": 4}}}}


def test_a_block_renders_its_results_file_and_check_names_a_stale_page(tmp_path, capsys):
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text(json.dumps(_report(1.25)))
    page = ("# Bench\n\nprose stays\n\n<!-- rendered: optimize-report results/r.json -->\n"
            "old table\n<!-- end rendered -->\n\nmore prose\n")
    (tmp_path / "BENCHMARKS.md").write_text(page)
    (tmp_path / "COVERAGE.md").write_text("# nothing rendered\n")
    assert docs.main(["--check", "--docs", str(tmp_path)]) == 1
    assert "BENCHMARKS.md" in capsys.readouterr().err
    assert docs.main(["--docs", str(tmp_path)]) == 0
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "old table" not in text and "prose stays" in text and "more prose" in text
    assert "| collage (shipped) | 1.250 |" in text and "openvino 3, tvm 1" in text
    assert docs.main(["--check", "--docs", str(tmp_path)]) == 0  # rendering again: the same
    (tmp_path / "results" / "r.json").write_text(json.dumps(_report(2.5)))
    assert docs.main(["--check", "--docs", str(tmp_path)]) == 1  # the figure moved


def test_a_block_naming_a_missing_file_or_an_unknown_kind_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="gone.json"):
        docs.render_page("<!-- rendered: suite-table results/gone.json -->\n"
                         "<!-- end rendered -->", tmp_path)
    with pytest.raises(ValueError, match="expected one of .*suite-table"):
        docs.render_page("<!-- rendered: pie-chart x.json -->\n<!-- end rendered -->", tmp_path)


def test_the_torch_compile_table_says_whether_the_second_process_used_the_log(tmp_path):
    graph = {"built": True, "seconds": 2.0, "from_log": False, "shipped": "collage",
             "fallback": ""}
    run = {"first_call_s": 9.0, "rel_err": 2e-7, "eager_ms": 5.0, "compiled_ms": 4.0}
    doc = {"machine": {"cpu": "X", "cores": 2}, "rows": [{
        "model": "m", "options": {"backends": ["tvm", "onnxruntime"], "graph_level": False},
        "first": {**run, "graphs": [graph, graph]},
        "second": {**run, "graphs": [{**graph, "seconds": 0.5, "from_log": True},
                                     {**graph, "seconds": 0.25, "from_log": False}]}}]}
    text = docs.torch_compile_table([doc])
    assert ("| m | tvm, onnxruntime; op level | 2 | 4.0 | 0.8 | **no** | yes | 2.0e-07 | 5.00 "
            "| 4.00 |") in text


def test_the_call_tir_survey_renders_both_tables_with_its_machine():
    doc = {"machine": {"cpu": "X", "cores": 2, "tvm": "0.27", "onnx": "1.2"},
           "node": {"test_clip": {"call_tir": [["Clip", "maximum", 1, 0]]},
                    "test_clip_example": {"call_tir": [["Clip", "maximum", 1, 0]]}},
           "models": {"m": {"call_tir": [["Clip", "minimum", 3, 0]], "nodes": [10, 7],
                            "unplaceable": [{"relax.call_tir": 6}, {}]}}}
    text = docs.call_tir_table(doc)
    assert text.startswith("Machine: X, 2 cores; tvm 0.27, onnx 1.2")
    assert "| Clip | maximum | R.maximum; R.clip with a following minimum | 2 -> 0 | 2 node cases |" \
        in text
    assert "| Clip | minimum | R.minimum; R.clip after a maximum | 3 -> 0 | m |" in text
    assert "| m | 10 -> 7 | 6 (relax.call_tir 6) | 0 |" in text


def test_a_summary_over_two_machines_names_each_rows_machine():
    row = {"model": "a", "vs_best_f32": 1.1, "build": {}}
    docs_ = [{"suite": "torchvision", "machine": {"cpu": cpu, "cores": 2}, "rows": [row]}
             for cpu in ("AMD EPYC", "Intel Xeon")]
    text = docs.suite_summary(docs_)
    assert "| suite | machine | accuracy |" in text
    assert "| torchvision | AMD EPYC | f32 |" in text and "| torchvision | Intel Xeon | f32 |" in text
    assert "| machine |" not in docs.suite_summary(docs_[:1])


def test_the_summary_counts_rows_below_the_goal_beyond_their_a_a_spread():
    rows = [{"model": m, "build": {"status": "built", "match": True, "vs_best_f32": x,
                                   "aa_spread": aa}}
            for m, x, aa in (("close", 0.95, 0.06), ("far", 0.90, 0.04), ("fine", 1.1, 0.01))]
    text = docs.suite_summary([{"suite": "torchvision", "machine": {"cpu": "X"}, "rows": rows}])
    assert "| 2 (1 beyond A/A noise) |" in text


def test_the_gpu_table_sets_the_shipped_build_against_the_best_gpu_framework():
    fw = {"pytorch (cuda)": {"ms": 3.0, "match": True},
          "torch.compile": {"ms": 2.5, "match": True},
          "torch.compile (cuda graphs)": {"ms": 1.5, "match": False},  # wrong: not the bar
          "collage": {"ms": 2.0, "match": True}}
    doc = {"machine": {"cpu": "X", "cores": 16, "gpu": "NVIDIA H100"}, "models": [{
        "model": "m", "size": "paper", "frameworks": fw,
        "two-level": {"shipped": "cudnn+tvm", "comparison": {
            "collage": {"ms": 2.7, "ops": {"inductor": 5}}}}}]}
    text = docs.gpu_table([doc])
    assert "Machine: X, 16 cores, GPU NVIDIA H100" in text
    assert ("| m | paper | inductor 5 (2.700) | cudnn+tvm | 2.000 | 3.000 | 2.500 | 1.500 "
            "(wrong) | 1.25x | **NO** |") in text


def test_a_machine_line_names_the_cpu_generation_where_the_model_name_does_not():
    from collage_tvm.tools.suites import machine_line

    line = machine_line({"cpu": "AMD EPYC", "mcpu": "znver3", "cores": 2, "tvm": "0.27"})
    assert line == "Machine: AMD EPYC (znver3), 2 cores; tvm 0.27"
    assert machine_line({"cpu": "AMD EPYC", "cores": 2}) == "Machine: AMD EPYC, 2 cores"


def _cli_flags() -> set:
    """Every option string of the CLI, its verbs' included."""
    import argparse

    from collage_tvm.cli import _parser

    flags, todo = set(), [_parser()]
    while todo:
        parser = todo.pop()
        for action in parser._actions:
            flags.update(action.option_strings)
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return flags


def test_every_flag_the_readme_and_the_guide_name_is_one_the_cli_takes():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    flags = _cli_flags()
    assert {"--accuracy", "--no-lean", "--rpc-tracker", "--bench"} <= flags  # the walk works
    unknown = []
    for page in ("README.md", "docs/GUIDE.md"):
        for n, line in enumerate((root / page).read_text().splitlines(), 1):
            # code spans that are a collage-tvm command or start with a flag
            for code in re.findall(r"`([^`]+)`", line):
                if not code.startswith(("collage-tvm", "--")):
                    continue
                unknown += [f"{page}:{n}: {flag} in `{code}`"
                            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", code)
                            if flag not in flags]
    assert not unknown, "\n".join(unknown)
