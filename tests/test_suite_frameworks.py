"""The torch suites judged against the frameworks (issue #33): a suite row times the shipped
Collage build beside the user's ONNX file on ONNX Runtime and OpenVINO (f32 and default
precision) and PyTorch eager, checks each against PyTorch, and the table sums up Collage
against the best correct f32 framework; the models are built at their usual input sizes."""
import math

import pytest
import torch
from torch import nn

from collage_tvm.registry import get_backend
from collage_tvm.target import host_cores
from collage_tvm.tools import suites

needs_libraries = pytest.mark.skipif(
    not (get_backend("onnxruntime").available()[0] and get_backend("openvino").available()[0]),
    reason="needs onnxruntime and openvino")
EVERY_FRAMEWORK = {"collage", "onnxruntime", "openvino", "openvino (default)", "pytorch",
                   suites.CONTROL, suites.OPENVINO_F32_CONTROL}


class TwoInputNet(nn.Module):
    """A conv block on an image plus a bias map given as a second input: the suite's
    frameworks take every input of the model, in the ONNX file's order."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x, bias):
        return torch.relu(self.conv(x) + bias).mean(dim=(2, 3))


def _make(name):
    torch.manual_seed(0)
    return TwoInputNet().eval(), (torch.randn(1, 3, 16, 16), torch.randn(1, 8, 16, 16))


@needs_libraries
def test_a_suite_row_times_collage_beside_every_framework_checked_against_pytorch(tmp_path):
    row = suites.torch_model_check(_make, "two_input", ["tvm", "onnxruntime"],
                                   str(tmp_path / "c.db"), str(tmp_path), frameworks=True)
    assert row["status"] == "built" and row["match"], row
    assert row["input"] == ["1x3x16x16", "1x8x16x16"]
    # the shipped build timed as a server runs it: saved, loaded back; the folder is gone
    assert row["timed"] == "saved and loaded", row["timed"]
    assert not (tmp_path / "two_input" / "shipped").exists()
    fw = row["frameworks"]
    # the loaded build called as a user calls it, numpy in and out; its VM on TVM tensors
    # timed beside it
    assert set(fw) == EVERY_FRAMEWORK | {"collage (TVM tensors)"}, fw
    assert fw["collage"]["call"].startswith("numpy"), fw["collage"]
    assert fw["collage (TVM tensors)"]["call"] == "TVM tensors"
    for name, r in fw.items():
        assert "error" not in r, (name, r)
        assert math.isfinite(r["ms"]) and r["ms"] > 0 and isinstance(r["match"], bool), (name, r)
        assert r["precision"] and math.isfinite(r["rel_err"]), (name, r)
    assert all(fw[n]["match"] for n in ("collage", "onnxruntime", "openvino", "pytorch")), fw
    assert fw["pytorch"]["rel_err"] == 0.0 and fw["openvino"]["precision"] == "f32"
    for name, r in fw.items():  # each batch, in round order: what the ratios pair
        assert len(r["batches"]) == r["rounds"] and all(b > 0 for b in r["batches"]), name
    best, best_ms = row["best_f32"]
    assert best in suites.F32_FRAMEWORKS and best_ms == fw[best]["ms"]
    mine = fw["collage"]["batches"]
    by_round = {n: suites.paired_ratio(mine, fw[n]["batches"]) for n in suites.F32_FRAMEWORKS}
    # OpenVINO f32 in two instances, one made before the Collage build, one after: both count
    by_round["openvino"] = math.sqrt(by_round["openvino"] * suites.paired_ratio(
        mine, fw[suites.OPENVINO_F32_CONTROL]["batches"]))
    assert row["openvino_f32_aa_spread"] is not None
    assert row["paired"] and row["vs_best_f32"] == pytest.approx(min(by_round.values()))
    assert row["vs_best_f32"] == pytest.approx(by_round[best])
    assert row["vs_openvino_default"] == pytest.approx(
        suites.paired_ratio(mine, fw["openvino (default)"]["batches"]))
    assert row["threads"] == host_cores()
    assert torch.get_num_threads() == row["threads"]


def test_the_best_f32_framework_leaves_out_wrong_and_reduced_precision_ones():
    fw = {"collage": {"ms": 2.0, "match": True, "precision": "f32"},
          "onnxruntime": {"ms": 1.0, "match": False, "precision": "f32"},  # fast but wrong
          "openvino": {"ms": 2.5, "match": True, "precision": "f32"},
          "openvino (default)": {"ms": 0.5, "match": True, "precision": "bf16"},
          "pytorch": {"error": "RuntimeError: no", "ms": math.nan, "match": False}}
    v = suites.versus(fw)
    assert v["best_f32"] == ("openvino", 2.5)
    assert v["vs_best_f32"] == pytest.approx(1.25)
    assert v["vs_openvino_default"] == pytest.approx(0.25)
    assert not v["paired"]  # no batches: the ratio of the medians
    none_correct = {**fw, "openvino": {**fw["openvino"], "match": False}}
    assert suites.versus(none_correct)["best_f32"] is None
    assert suites.versus(none_correct)["vs_best_f32"] is None


def _row(model, vs, match=True):
    collage = 10.0
    best = collage * vs
    fw = {"collage": {"ms": collage, "match": match, "precision": "f32", "rel_err": 0.0},
          "onnxruntime": {"ms": best, "match": True, "precision": "f32", "rel_err": 1e-6},
          "openvino": {"ms": best * 1.5, "match": True, "precision": "f32", "rel_err": 1e-6},
          "openvino (default)": {"ms": best / 2, "match": True, "precision": "bf16",
                                 "rel_err": 3e-3},
          "pytorch": {"ms": best * 2, "match": True, "precision": "f32", "rel_err": 0.0}}
    return {"model": model, "input_size": "usual",
            "build": {"status": "built", "match": match, "max_err": 1e-6, "scale": 1.0,
                      "search_s": 5.0, "collage_ms": collage, "best": ("onnxruntime", best),
                      "shipped": "collage", "input": ["1x3x224x224"], "frameworks": fw,
                      "threads": 2, **suites.versus(fw)}}


def test_the_suite_table_sums_up_collage_against_the_best_f32_framework():
    rows = [_row("a", 1.10), _row("b", 0.95), _row("c", 0.80), _row("d", 1.04), _row("e", 1.00),
            _row("wrong", 0.50, match=False),  # a build that does not match is not counted
            {"model": "crashed", "input_size": "usual",
             "build": {"status": "crash", "error": "boom"}}]
    machine = {"cpu": "Some CPU 9000", "cores": 2, "tvm": "0.27", "onnxruntime": "1.31"}
    text = suites.markdown("torchvision", rows, machine)
    assert text.splitlines()[0].startswith("Machine: Some CPU 9000, 2 cores")
    for column in ("Collage ms", "ORT ms", "OpenVINO f32 ms", "OpenVINO default ms",
                   "PyTorch ms", "Collage vs best f32"):
        assert f"| {column} |" in text, column
    row_a = next(line for line in text.splitlines() if line.startswith("| a |"))
    assert "| 11.000 |" in row_a and "| 5.500 (bf16) |" in row_a and "1.10x (onnxruntime)" in row_a
    assert "**0.95x (onnxruntime)**" in text  # below the goal: bold
    summary = text.strip().splitlines()[-1]
    assert "5 rows counted" in summary and "median 1.00x" in summary, summary
    assert "worst 0.800x (c)" in summary and "2 below 0.97x (b, c)" in summary, summary
    assert "by 3% or more on 2: a, d." in summary, summary
    assert "busy" not in text  # no load recorded: nothing said


def test_the_summary_says_where_the_search_itself_ended_on_a_mix():
    """"No mixed placement shipped" has two causes: the search proposed none, or the final
    check timed its mix behind a single library. The summary tells them apart, with the
    mix's time over the fastest single build's, nearest first."""
    whole, near, far = _row("whole", 1.0), _row("near", 1.0), _row("far", 1.0)
    whole["build"]["collage_ops"] = {"openvino": 300, "tvm": 0}
    near["build"].update(collage_ops={"openvino": 290, "tvm": 10}, collage_ms=10.4,
                         best=("openvino", 10.0), shipped="openvino")
    far["build"].update(collage_ops={"onnxruntime": 100, "openvino": 200}, collage_ms=30.0,
                        best=("openvino (model file)", 10.0), shipped="openvino (model file)")
    st = suites.suite_stats([far, whole, near])
    assert st["searched_mixed"] == [("near", pytest.approx(1.04)), ("far", pytest.approx(3.0))]
    assert st["mixed"] == [] and st["searched_known"] == 3
    assert suites.searched_a_mix(whole["build"]) is None
    summary = suites.markdown("torchvision", [far, whole, near]).strip().splitlines()[-1]
    assert "The search ended on a mix on 2 (near 1.04x, far 3.00x" in summary, summary
    # no mix proposed: said so; rows that do not record the placement: nothing claimed
    summary = suites.markdown("torchvision", [whole]).strip().splitlines()[-1]
    assert "ended on one backend running the whole model on every row." in summary, summary
    assert "The search ended" not in suites.markdown("torchvision", [_row("old", 1.0)])
    from collage_tvm.tools import docs
    table = docs.suite_summary([{"suite": "torchvision", "rows": [far, whole, near]}])
    assert "| search ended on a mix (nearest) |" in table
    assert table.strip().splitlines()[-1].endswith("| 2 (1.04x, near) |"), table


def test_a_row_s_log_line_gives_its_error_beside_the_output_scale(tmp_path):
    # random weights can make a large output: the suite judges the error relative to the
    # outputs' largest magnitude, and the log says so instead of a bare 4.5e+02
    row = _row("wide", 1.0)
    row["build"].update(max_err=450.0, scale=1.1e5)
    *_, line = suites._torch_suite("torchvision", ["resnet18"], "usual", ["tvm"], None,
                                   str(tmp_path), False, 1.0, False, "f32", True)
    text = line(row)
    assert "max err 4.5e+02 of 1.1e+05" in text, text
    assert "| 4.5e+02 of 1.1e+05 |" in suites.markdown("torchvision", [row])


def test_the_table_gives_the_numpy_call_it_judged_and_the_vm_on_tvm_tensors_beside_it():
    """A row timed as a user calls the loaded build (numpy in and out) judges that figure,
    and its cell gives the VM's on TVM tensors beside it; an older row (the VM alone) is
    shown as it was, and the note under the table is there only where a row has both."""
    from collage_tvm.tools.bench import COLLAGE_ON_TENSORS

    new, old = _row("new", 1.0), _row("old", 1.0)
    new["build"]["frameworks"]["collage"]["call"] = "numpy, the library's own call"
    new["build"]["frameworks"][COLLAGE_ON_TENSORS] = {"ms": 9.25, "match": True,
                                                      "call": "TVM tensors"}
    assert suites.versus(new["build"]["frameworks"]) == suites.versus(
        old["build"]["frameworks"])  # not a contender: the ratios are the numpy call's
    text = suites.markdown("torchvision", [new, old])
    line = {r.split(" | ")[0][2:]: r for r in text.splitlines() if r.startswith("| ")}
    assert "| 10.000 (VM 9.250) |" in line["new"]
    assert "| 10.000 |" in line["old"]
    assert "`collage_tvm.load(dir)(x)`" in text
    assert "collage_tvm.load(dir)(x)" not in suites.markdown("torchvision", [old])


def test_the_table_says_where_a_close_call_raced_in_serving_ran_another_library():
    switched, kept = _row("switched", 1.0), _row("kept", 1.0)
    # (the race's record; older results files called it "decided_at_load")
    for row, chose, key in ((switched, "openvino", "decided"),
                            (kept, "onnxruntime", "decided_at_load")):
        row["build"]["shipped"] = "onnxruntime (model file)"
        row["build"]["frameworks"]["collage"][key] = {
            "shipped": "onnxruntime", "chose": chose, "rounds": 15, "left_out": {},
            "ms": {"onnxruntime": 1.0, "openvino": 0.9 if chose == "openvino" else 1.1}}
    text = suites.markdown("torchvision", [switched, kept, _row("plain", 1.0)],
                           {"cpu": "Some CPU", "cores": 2})
    line = {r.split(" | ")[0][2:]: r for r in text.splitlines() if r.startswith("| ")}
    assert "| onnxruntime (model file); served by openvino (raced beside onnxruntime) |" \
        in line["switched"]
    assert "| onnxruntime (model file); at load: kept (timed beside openvino) |" in line["kept"]
    assert line["plain"].endswith("| collage |")


def test_a_row_below_the_goal_by_no_more_than_its_a_a_spread_is_within_noise():
    close, far, none = _row("close", 0.95), _row("far", 0.90), _row("none", 0.95)
    for r, spread in ((close, 0.06), (far, 0.04)):
        r["build"]["frameworks"][suites.CONTROL] = {
            "ms": r["build"]["frameworks"]["onnxruntime"]["ms"] * (1 + spread), "match": True,
            "precision": "f32", "rel_err": 0.0}
        r["build"].update(suites.versus(r["build"]["frameworks"]))
    assert close["build"]["aa_spread"] == pytest.approx(0.06)
    assert none["build"].get("aa_spread") is None
    st = suites.suite_stats([close, far, none])
    assert st["below"] == ["close", "far", "none"]
    assert st["below_beyond_noise"] == ["far", "none"]  # no control: not excused
    text = suites.markdown("torchvision", [close, far, none])
    assert "**0.95x (onnxruntime; A/A 6%)**" in text and '"A/A": the same ONNX file' in text
    assert "3 below 0.97x (close, far, none), 2 of them by more than their A/A control's " \
        "spread (far, none)" in text
    # every row below beyond its control: said too (it once read as if none had one)
    text = suites.markdown("torchvision", [far, _row("fine", 1.0)])
    assert "1 below 0.97x (far), 1 of them by more than their A/A control's spread" in text
    # rows without a control: nothing said of one
    assert "A/A control" not in suites.markdown("torchvision", [none])


def test_a_row_below_openvino_default_is_judged_by_openvino_s_own_a_a_control():
    """Two compiled instances of one file on OpenVINO land further apart than two ONNX
    Runtime sessions: "Collage vs OpenVINO default" is excused by OpenVINO's control, the f32
    figure still by ONNX Runtime's."""
    row = _row("m", 0.95)
    fw = row["build"]["frameworks"]
    row["build"]["accuracy"] = "bf16"
    fw[suites.CONTROL] = {**fw["onnxruntime"], "ms": fw["onnxruntime"]["ms"] * 1.01}
    default = fw["openvino (default)"]
    fw[suites.OPENVINO_CONTROL] = {**default, "ms": default["ms"] * 1.06}
    row["build"].update(suites.versus(fw))
    b = row["build"]
    assert b["aa_spread"] == pytest.approx(0.01) and b["openvino_aa_spread"] == pytest.approx(0.06)
    assert b["vs_openvino_default"] < suites.GOAL - 0.1  # far below: beyond either spread
    assert not suites.within_noise(b, "vs_openvino_default")
    b["vs_openvino_default"] = 0.95
    assert suites.within_noise(b, "vs_openvino_default")  # 5% short, OpenVINO's A/A 6%
    assert not suites.within_noise(b, "vs_best_f32")  # 5% short, ONNX Runtime's A/A 1%
    assert "(OpenVINO A/A 6%)" in suites.markdown("timm", [row])
    # a try is as noisy as its widest control
    assert suites._widest_spread(b) == pytest.approx(0.06)
    assert suites._widest_spread({"aa_spread": None}) is None


def test_openvino_f32_as_the_best_framework_is_judged_in_both_instances_and_by_its_own_a_a():
    row = _row("m", 0.95)
    fw = row["build"]["frameworks"]
    fw["openvino"]["ms"] = 9.0  # ahead of ONNX Runtime (9.5): the best f32 framework
    fw[suites.CONTROL] = {**fw["onnxruntime"], "ms": fw["onnxruntime"]["ms"] * 1.01}
    fw[suites.OPENVINO_F32_CONTROL] = {**fw["openvino"], "ms": 10.0}  # the later instance
    b = row["build"]
    b.update(suites.versus(fw))
    assert b["best_f32"] == ("openvino", 9.0)
    assert b["vs_best_f32"] == pytest.approx(math.sqrt(0.9 * 1.0))  # both instances
    assert b["openvino_f32_aa_spread"] == pytest.approx(1.0 / 0.9 - 1.0)
    assert suites._spread_for(b, "vs_best_f32") == b["openvino_f32_aa_spread"]
    assert suites.within_noise(b)  # 5.1% short, OpenVINO's two instances 11% apart
    text = suites.markdown("timm", [row])
    assert "(openvino; A/A 11%)" in text and "geometric mean of Collage's ratios" in text
    # a row whose best is ONNX Runtime is judged by ONNX Runtime's control
    fw["openvino"]["ms"] = 20.0
    b.update(suites.versus(fw))
    assert b["best_f32"][0] == "onnxruntime"
    assert suites._spread_for(b, "vs_best_f32") == pytest.approx(0.01)


def test_the_collage_build_is_loaded_between_the_frameworks_and_their_a_a_controls(
        monkeypatch):
    """OpenVINO runs the first of two compiled instances of one file a few percent slower:
    the shipped build is made after the frameworks and before their A/A controls, and the
    OpenVINO figure it is judged by takes both instances."""
    from collage_tvm.tools import bench

    made = []

    def maker(name):
        def make():
            made.append(name)
            return (lambda: None), [0.0], *(["bf16"] if "default" in name else [])
        return make

    monkeypatch.setattr(bench, "_library_makers", lambda path, arrays: {
        n: maker(n) for n in ("onnxruntime", "openvino", "openvino (default)")})
    monkeypatch.setattr(bench, "_torch_runs", lambda *a: ({"pytorch": None}, {"pytorch": [0.0]},
                                                          {}))

    def collage_runs(builds, arrays, runs, outs, extra=None):
        runs["collage"], outs["collage"] = builds["collage"], [0.0]

    monkeypatch.setattr(bench, "_collage_runs", collage_runs)
    monkeypatch.setattr(bench, "_framework_times", lambda runs, extra, controls: {
        n: 1.0 for n in runs})
    later = bench.LoadLater(lambda: made.append("collage") or "the build")
    rows = bench.torch_frameworks(lambda *x: torch.zeros(1), (torch.zeros(1),), "m.onnx", later,
                                  lambda out, ref, precision: {"match": True, "max_err": 0.0,
                                                               "rel_err": 0.0},
                                  controls={suites.CONTROL: "onnxruntime",
                                            suites.OPENVINO_CONTROL: "openvino (default)"})
    assert made == ["onnxruntime", "openvino", "openvino (default)", "collage", "onnxruntime",
                    "openvino (default)"]
    assert rows[suites.OPENVINO_CONTROL]["precision"] == "bf16"
    # judged against both instances: the geometric mean of the two ratios
    assert suites._bracketed(0.9, 1.1) == pytest.approx(math.sqrt(0.99))
    assert suites._bracketed(0.9, None) == 0.9 and suites._bracketed(None, 1.1) is None


def test_a_model_too_large_for_every_framework_at_once_is_timed_a_group_at_a_time(
        monkeypatch, tmp_path):
    """regnet_y_128gf (2.6 GB of weights) on 24 GB: seven sessions at once do not fit. Each
    library and control is then made and timed beside Collage (and PyTorch) on its own, one
    group's sessions gone before the next; each figure is its group's ratio to Collage, put
    on the first group's Collage figure, so the row's ratios are the groups' own."""
    import psutil

    from collage_tvm.tools import bench

    made, alive = [], set()

    class Session:
        def __init__(self, name):
            self.name = name
            alive.add(name)
            made.append((name, sorted(alive)))

        def __del__(self):
            alive.discard(self.name)

    def maker(name):
        return lambda: (Session(name), [0.0], *(["bf16"] if "default" in name else []))

    monkeypatch.setattr(bench, "_library_makers", lambda path, arrays: {
        n: maker(n) for n in ("onnxruntime", "openvino", "openvino (default)")})
    monkeypatch.setattr(bench, "_torch_runs", lambda *a: ({"pytorch": None}, {"pytorch": [0.0]},
                                                          {}))
    rounds = iter(range(100))

    def collage_runs(builds, arrays, runs, outs, extra=None):
        runs["collage"], outs["collage"] = builds["collage"], [0.0]

    def times(runs, extra, controls):  # Collage at 10, 20, 30 ms in the successive groups;
        k = next(rounds) + 1  # each framework at 1.1x the Collage beside it
        return {n: (10.0 * k if n == "collage" else 11.0 * k) for n in runs}

    monkeypatch.setattr(bench, "_collage_runs", collage_runs)
    monkeypatch.setattr(bench, "_framework_times", times)
    model = tmp_path / "m.onnx"
    model.write_bytes(b"0" * 1000)
    controls = {suites.CONTROL: "onnxruntime"}
    assert suites.framework_groups(str(model), controls) is None  # a small model: all at once
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("M", (), {"available": 10})())
    groups = suites.framework_groups(str(model), controls)
    assert groups == [{"onnxruntime"}, {"openvino"}, {"openvino (default)"}, {suites.CONTROL}]
    rows = suites._timed_in_groups(
        lambda only: bench.torch_frameworks(
            lambda *x: torch.zeros(1), (torch.zeros(1),), str(model),
            bench.LoadLater(lambda: "the build"),
            lambda out, ref, precision: {"match": True, "max_err": 0.0, "rel_err": 0.0},
            controls=controls, only=only), groups)
    assert [n for n, _ in made] == ["onnxruntime", "openvino", "openvino (default)", "onnxruntime"]
    assert all(len(with_it) == 1 for _, with_it in made)  # never two sessions at once
    assert rows["collage"]["ms"] == 10.0
    for name in ("onnxruntime", "openvino", "openvino (default)", suites.CONTROL):
        assert rows[name]["ms"] == pytest.approx(11.0), rows[name]  # 1.1x its own Collage
        assert rows[name]["group_ms"] == pytest.approx(rows[name]["collage_ms"] * 1.1)
        assert "batches" not in rows[name]
    assert rows["openvino (default)"]["precision"] == "bf16"
    assert suites.versus(rows)["vs_best_f32"] == pytest.approx(1.1)
    cell = suites._versus_cell({"vs_best_f32": 1.1, "best_f32": ("onnxruntime", 11.0),
                                "frameworks_grouped": [sorted(g) for g in groups]})
    assert cell.startswith("1.10x (onnxruntime)") and "group of its own" in cell


def test_a_row_timed_on_a_busy_machine_says_so():
    quiet, busy = _row("quiet", 1.10), _row("busy", 0.80)
    quiet["build"].update(other_load=0.02, frameworks_other_load=0.05)
    busy["build"].update(other_load=0.52, frameworks_other_load=0.30)
    lines = suites.markdown("torchvision", [quiet, busy]).splitlines()
    assert "busy" not in next(line for line in lines if line.startswith("| quiet |"))
    assert ("**0.80x (onnxruntime)** (busy: other processes took final check 52%, "
            "frameworks 30% of the CPU)") in next(line for line in lines
                                                  if line.startswith("| busy |"))


def test_openvino_default_counts_only_within_its_precision():
    fw = {"collage": {"ms": 2.0, "match": True, "precision": "f32"},
          "openvino (default)": {"ms": 1.0, "match": False, "precision": "bf16"}}
    assert suites.versus(fw)["vs_openvino_default"] is None  # wrong: no figure against it
    fw["openvino (default)"]["match"] = True
    assert suites.versus(fw)["vs_openvino_default"] == pytest.approx(0.5)


def test_a_bf16_table_sums_up_collage_against_openvino_default_and_counts_mixed_placements():
    rows = [_row("a", 1.10), _row("b", 1.00), _row("floor", 1.20)]
    for r in rows:
        r["build"]["accuracy"] = "bf16"
    rows[0]["build"]["collage_ops"] = {"openvino_bf16": 40, "dnnl": 3}  # mixed, wins
    rows[1]["build"]["collage_ops"] = {"openvino": 40, "tvm": 2}  # mixed, no clear win
    rows[2]["build"].update(shipped="openvino_bf16 (model file)",  # one library: not mixed
                            collage_ops={"openvino": 40, "tvm": 2})
    text = suites.markdown("timm", rows)
    assert "| Collage vs OpenVINO default |" in text and "accuracy budget bf16" in text
    row_a = next(line for line in text.splitlines() if line.startswith("| a |"))
    assert "| **0.55x** |" in row_a  # _row: OpenVINO default at half the best f32's ms
    versus_f32, versus_default = [line for line in text.splitlines() if "rows counted" in line]
    assert "Collage vs best f32" in versus_f32
    assert "Collage vs OpenVINO at its default precision" in versus_default
    assert "worst 0.500x (b)" in versus_default and "3 below 0.97x" in versus_default
    assert "mixed placement (operators on two or more backends) shipped on 2 (a, b)" in versus_f32
    assert "1 of them winning by 3% or more: a." in versus_f32
    assert not suites.is_mixed(rows[2]["build"]) and suites.is_mixed(rows[0]["build"])


@needs_libraries
def test_a_bf16_suite_row_is_searched_and_judged_within_the_budget(tmp_path):
    row = suites.torch_model_check(_make, "two_input", ["tvm", "openvino"],
                                   str(tmp_path / "c.db"), str(tmp_path), frameworks=True,
                                   accuracy="bf16")
    assert row["status"] == "built" and row["accuracy"] == "bf16", row
    assert row["match"] and row["rel_err"] <= 2e-2, row
    fw = row["frameworks"]
    assert math.isfinite(fw["collage"]["ms"]) and fw["collage"]["precision"] == "bf16"
    # OpenVINO's default, the figure the row is judged against, gets an A/A control of its
    # own: the file compiled a second time, at the precision OpenVINO chose
    again = fw[suites.OPENVINO_CONTROL]
    assert "error" not in again and again["precision"] == fw["openvino (default)"]["precision"]
    assert row["openvino_aa_spread"] == pytest.approx(abs(suites.paired_ratio(
        fw["openvino (default)"]["batches"], again["batches"]) - 1.0))
    mine = fw["collage"]["batches"]
    assert row["vs_openvino_default"] == pytest.approx(math.sqrt(  # both instances count
        suites.paired_ratio(mine, fw["openvino (default)"]["batches"])
        * suites.paired_ratio(mine, again["batches"])))
    f32 = suites.torch_model_check(_make, "two_input", ["tvm"], str(tmp_path / "c.db"),
                                   str(tmp_path))
    assert f32["accuracy"] == "f32" and "rel_err" not in f32


def _needs_torchvision():
    try:
        suites.import_torchvision()  # against the CPU torch (collage_tvm._torchvision)
    except ImportError as err:
        pytest.skip(str(err))


def test_usual_input_sizes_are_what_users_run_and_small_ones_stay_quick():
    _needs_torchvision()
    _, (x,) = suites.torchvision_model("resnet18", "usual")
    assert x.shape == (1, 3, 224, 224)
    assert suites.torchvision_model("resnet18")[1][0].shape == (1, 3, 64, 64)  # small
    # the size their published weights are evaluated at
    assert suites.torchvision_usual_size("inception_v3") == 299
    assert suites.torchvision_usual_size("efficientnet_b3") == 300
    assert suites.torchvision_usual_size("vit_h_14") == 224
    with pytest.raises(ValueError, match="unknown input size 'huge'"):
        suites.torchvision_model("resnet18", "huge")


def test_timm_usual_size_is_its_default_cfg_input_size():
    _needs_torchvision()  # timm imports it
    pytest.importorskip("timm")
    model, (x,) = suites.timm_model("levit_128s", "usual")
    assert x.shape == (1, *model.default_cfg["input_size"]) == (1, 3, 224, 224)
    with torch.no_grad():
        assert model(x).shape == (1, 1000)


@pytest.mark.parametrize("name", ["gpt2", "vit", "whisper_encoder"])
def test_transformers_at_the_usual_size_run_128_tokens(name):
    _needs_torchvision()  # transformers imports it for ViT and Whisper
    pytest.importorskip("transformers")
    model, inputs = suites.transformers_model(name, "usual")
    with torch.no_grad():
        hidden = model(*inputs)
    assert hidden.shape[1] == {"vit": 197, "whisper_encoder": 128}.get(name, 128), hidden.shape
    small, small_inputs = suites.transformers_model(name)
    with torch.no_grad():
        assert small(*small_inputs).shape[1] < hidden.shape[1]



def test_in_child_runs_a_function_in_a_fresh_process_and_a_dead_one_is_a_clear_error():
    import os

    assert suites.in_child(os.getpid) != os.getpid()
    with pytest.raises(suites.ChildDied, match="_exit died"):
        suites.in_child(os._exit, 3)
    with pytest.raises(ZeroDivisionError):  # an exception comes back as itself
        suites.in_child(divmod, 1, 0)


def test_frameworks_timed_on_a_busy_machine_are_timed_again_and_the_quietest_counts(
        monkeypatch):
    """The retry looks at the load alone: the quietest timing counts even where its figures
    are worse for Collage."""
    row = _framework_row_timed(monkeypatch, [0.40, 0.05, 0.30], [
        {"collage": 1.0, "onnxruntime": 2.0}, {"collage": 1.0, "onnxruntime": 0.9}])
    assert row["frameworks_loads"] == [0.40, 0.05]  # quiet on the second try: no third
    assert row["frameworks_other_load"] == 0.05
    assert row["frameworks"]["onnxruntime"]["ms"] == 0.9 and row["vs_best_f32"] == 0.9


def test_the_figures_close_to_collage_are_timed_on_with_the_a_a_control(monkeypatch):
    """The row's runoff times on Collage's figure and what is within its margin of Collage's
    (either side) or of the fastest f32 framework where that is ahead of Collage, with the A/A control beside ONNX Runtime;
    the far ones keep their first figure. A fake ``interleaved`` gives the figures (no clock
    read)."""
    from collage_tvm.measure import timing
    from collage_tvm.tools import bench

    first = {}
    calls = []

    def fake(fns, rounds, samples=None, **kw):
        calls.append((set(fns), rounds))
        ms = {n: first[n] * (1 if len(calls) == 1 else 0.5) for n in fns}
        for n in fns:
            samples.setdefault(n, []).extend([ms[n]] * rounds)
        return ms

    monkeypatch.setattr(timing, "interleaved", fake)
    bf16 = {"openvino (default)": {"precision": "bf16"}}
    controls = {suites.CONTROL: "onnxruntime"}

    def timed(figures: dict, expect_close: set) -> None:
        first.clear()
        first.update(figures)
        calls.clear()
        extra = {k: dict(v) for k, v in bf16.items()}
        runs = {n: (lambda: None) for n in first}
        ms = bench._framework_times(runs, extra, controls=dict(controls))
        assert calls[0] == (set(first), bench.FRAMEWORK_ROUNDS)
        if not expect_close:
            assert len(calls) == 1
            expect_close = set()
        else:
            assert calls[1] == (expect_close, bench.ROW_RUNOFF_ROUNDS - bench.FRAMEWORK_ROUNDS)
        for n in first:
            assert ms[n] == (first[n] / 2 if n in expect_close else first[n]), n
            assert extra[n]["rounds"] == (bench.ROW_RUNOFF_ROUNDS if n in expect_close
                                          else bench.FRAMEWORK_ROUNDS), n

    # close to Collage on either side; the A/A control with ONNX Runtime
    timed({"collage": 10.0, "onnxruntime": 9.5, suites.CONTROL: 12.0, "openvino": 10.8,
           "pytorch": 30.0, "openvino (default)": 5.0},
          {"collage", "onnxruntime", "openvino", suites.CONTROL})
    # Collage far behind (a noisy first pass): the fastest f32 framework and those close to
    # it are timed on with Collage; bf16's figure is no f32 mark
    timed({"collage": 12.0, "onnxruntime": 10.5, suites.CONTROL: 10.2, "openvino": 10.0,
           "pytorch": 30.0, "openvino (default)": 5.3},
          {"collage", "onnxruntime", "openvino", suites.CONTROL})
    # the control close by the noise it is there to show, ONNX Runtime not: both go on
    timed({"collage": 10.0, "onnxruntime": 14.0, suites.CONTROL: 10.5, "openvino": 20.0,
           "pytorch": 30.0, "openvino (default)": 14.0},
          {"collage", "onnxruntime", suites.CONTROL})
    # nothing close to Collage, and no framework ahead of it: no runoff
    timed({"collage": 10.0, "onnxruntime": 20.0, suites.CONTROL: 20.0, "openvino": 20.0,
           "pytorch": 30.0, "openvino (default)": 14.0}, set())
    # OpenVINO's default close (the bf16 criterion): its own control goes on beside it, and a
    # control is never the f32 mark Collage is held to (its precision is OpenVINO's default)
    controls.update({suites.OPENVINO_CONTROL: "openvino (default)"})
    bf16[suites.OPENVINO_CONTROL] = {"precision": "bf16"}
    timed({"collage": 10.0, "onnxruntime": 20.0, suites.CONTROL: 20.0, "openvino": 20.0,
           "pytorch": 30.0, "openvino (default)": 10.5, suites.OPENVINO_CONTROL: 13.0},
          {"collage", "openvino (default)", suites.OPENVINO_CONTROL})


def test_frameworks_whose_a_a_control_strays_are_timed_again_and_the_steadiest_counts(
        monkeypatch):
    """A VM's host busy with other guests shows in no CPU counter of this machine, but in
    the A/A control: a timing whose control landed beyond ``AA_NOISY`` from ONNX Runtime's
    figure is retried, and the one with the smallest A/A spread counts (not the one best for
    Collage)."""
    row = _framework_row_timed(monkeypatch, [0.0] * 3, [
        {"collage": 1.0, "onnxruntime": 2.0, suites.CONTROL: 2.6},   # A/A 30%: again
        {"collage": 1.0, "onnxruntime": 0.9, suites.CONTROL: 0.93},  # 3.3%: again
        {"collage": 1.0, "onnxruntime": 1.5, suites.CONTROL: 1.2},   # 20%
    ])
    assert row["frameworks_aa_spreads"] == pytest.approx([0.3, 0.0333, 0.2], abs=1e-3)
    assert row["frameworks"]["onnxruntime"]["ms"] == 0.9 and row["vs_best_f32"] == 0.9
    assert row["aa_spread"] == pytest.approx(0.0333, abs=1e-3)


def _framework_row_timed(monkeypatch, loads: list, figures: list) -> dict:
    """``suites.framework_row`` with each try's load (the share of the CPU other processes
    took) and figures (framework -> ms) given, nothing timed."""
    from collage_tvm.measure import timing
    from collage_tvm.tools import bench

    loads, figures = iter(loads), iter(figures)

    def exit_(self, *exc):
        self.share = next(loads)

    def frameworks(*args, **kwargs):
        return {fw: {"ms": ms, "match": True} for fw, ms in next(figures).items()}

    monkeypatch.setattr(timing.OtherLoad, "__exit__", exit_)
    monkeypatch.setattr(bench, "torch_frameworks", frameworks)
    monkeypatch.setattr(suites, "checked_model", lambda make, name: (None,) * 5)
    monkeypatch.setattr(suites, "BUSY_PAUSE_S", 0.0)
    return suites.framework_row(None, "m", "m.onnx", None)


def test_ratios_are_taken_round_by_round_where_the_figures_carry_their_batches():
    # ONNX Runtime ran in a slow stretch of the machine for its last rounds, Collage did not
    # have to: the ratio of the medians says ONNX Runtime is slower; round by round (each
    # round times both side by side) they are even, and the slow rounds hit Collage too
    slow = [1.0] * 6 + [2.0] * 5
    fw = {"collage": {"ms": 1.0, "match": True, "batches": [1.0] * 6 + [2.0] * 5},
          "onnxruntime": {"ms": 2.0, "match": True, "batches": slow},
          suites.CONTROL: {"ms": 1.0, "match": True, "batches": [1.1 * b for b in slow]},
          "openvino": {"ms": 1.5, "match": True, "batches": [0.9 * b for b in slow]},
          "openvino (default)": {"ms": 1.0, "match": True,
                                 "batches": [1.2 * b for b in slow]}}
    v = suites.versus(fw)
    assert v["paired"]
    assert v["best_f32"] == ("openvino", 1.5)  # 0.9x of Collage's time, round by round
    assert v["vs_best_f32"] == pytest.approx(0.9)
    assert v["vs_openvino_default"] == pytest.approx(1.2)
    assert v["aa_spread"] == pytest.approx(0.1)
    assert suites.paired_ratio([1.0] * 4, [2.0] * 4) is None  # too few rounds to pair
    assert suites.paired_ratio([1.0, 2.0, 1.0, 4.0, 1.0], [2.0, 4.0, 2.0, 8.0, 1.0]) == 2.0


def test_round_log_ratios_pair_heads_or_tails_and_skip_untimed_rounds():
    """The suites pair the first rounds (ONNX Runtime timed on alone after Collage stopped),
    the final check the last ones (the close builds timed on together): the same lists give
    different pairs, and a non-positive batch is a round not timed."""
    from collage_tvm.measure.timing import PAIRED_MIN_ROUNDS, round_log_ratios

    mine = [1.0] * 5
    other = [2.0] * 5 + [4.0] * 3  # three more rounds, of a slower stretch
    assert [round(math.exp(x), 9) for x in round_log_ratios(mine, other)] == [2.0] * 5
    tails = round_log_ratios(mine, other, tails=True)
    assert [round(math.exp(x), 9) for x in tails] == [2.0, 2.0, 4.0, 4.0, 4.0]
    assert round_log_ratios(mine, [2.0, 0.0, 2.0, 2.0, 2.0]) is None  # 4 rounds timed
    assert round_log_ratios(mine[:PAIRED_MIN_ROUNDS - 1], other) is None
    assert round_log_ratios(None, other) is None
    assert round_log_ratios(None, other, tails=True) is None


def test_a_build_that_cannot_be_saved_is_timed_in_memory_with_the_reason(tmp_path):
    import types

    broken = types.SimpleNamespace(executable="the executable", module=None, target=None)
    shipped, how = suites.saved_and_loaded(broken, str(tmp_path / "shipped"))
    assert shipped == "the executable"
    assert how.startswith("in memory (saving and loading it failed: "), how
    assert not (tmp_path / "shipped").exists()
