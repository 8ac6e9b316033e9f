"""TVM's kernels tuned with MetaSchedule (issue #16): the compile pipeline, the tuning
database, the tuner's control flow, Collage's choice of kernels, and the whole loop on a
small model (tune, build tuned, tune again: nothing new)."""
import json
import math
import os

import numpy as np
import pytest
import tvm
from tvm import relax

import collage_tvm
from collage_tvm import tuning
from collage_tvm.stores import placement_key
from collage_tvm.graph import DataflowGraph
from collage_tvm.placement import Candidate
from collage_tvm.target import make_target
from collage_tvm.tuning.plan import plan
from collage_tvm.tuning import tuner

TARGET = make_target()


def _conv_block(channels=8, size=16, seed=0):
    """conv2d + bias + relu, weights as constants."""
    rng = np.random.default_rng(seed)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, channels, size, size), "float32"))
    w = rng.standard_normal((channels, channels, 3, 3)).astype("float32")
    b = rng.standard_normal((1, channels, 1, 1)).astype("float32")
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(w), padding=1))
            y = bb.emit(relax.op.add(y, relax.const(b)))
            y = bb.emit(relax.op.nn.relu(y))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _matmul(m=16, k=32, n=32, seed=0):
    rng = np.random.default_rng(seed)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.const(rng.standard_normal((k, n)).astype("float32"))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()


def _run(executable, *arrays):
    vm = relax.VirtualMachine(executable, tvm.cpu())
    return vm["main"](*[tvm.runtime.tensor(a) for a in arrays]).numpy()


def test_a_fused_candidate_is_one_kernel_and_computes_what_tvm_computes():
    mod = _conv_block()
    ks = tuning.kernels(mod["main"], TARGET)
    assert [name for name, _ in ks] == ["fused_conv2d_add_relu"]
    # Without global_symbol (an extracted candidate) the function is not dropped as dead.
    assert len(tuning.kernels(mod["main"].without_attr("global_symbol"), TARGET)) == 1
    x = np.random.default_rng(1).standard_normal((1, 8, 16, 16)).astype("float32")
    np.testing.assert_allclose(_run(tuning.compile_module(mod, TARGET), x),
                               _run(tvm.compile(mod, TARGET), x), rtol=1e-5, atol=1e-5)


def _threads_in_fresh_process(**env):
    """(TVM's pool size, the process's cores, the tvm backend's version) in a new
    interpreter that imported collage_tvm, with ``env`` set and no thread setting inherited."""
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items()
            if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    code = ("import collage_tvm, json; from collage_tvm.target import tvm_threads, host_cores; "
            "print(json.dumps([tvm_threads(), host_cores(), "
            "collage_tvm.get_backend('tvm').version()]))")
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_tvm_runs_its_kernels_on_every_core_and_its_costs_say_on_how_many():
    # TVM alone would take half the logical CPUs on x86 (one thread on a 2-vCPU machine),
    # while the libraries it is compared with take all of them.
    threads, cores, version = _threads_in_fresh_process()
    assert threads == cores
    assert version.endswith(f"+t{cores}")
    # A user's own setting wins, and the cost DB keeps its costs apart.
    threads, _, version = _threads_in_fresh_process(TVM_NUM_THREADS="1")
    assert threads == 1 and version.endswith("+t1")


def test_a_database_of_another_tvm_version_or_target_is_ignored_with_a_message(tmp_path, caplog):
    path = tmp_path / "t"
    tuning.TuningDB(str(path), TARGET)
    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "tvm": "0.1.0"}))
    with caplog.at_level("WARNING", logger="collage_tvm"):
        assert tuning.open_tuning_db(str(path), TARGET) is None
    assert "0.1.0" in caplog.text and "tuning database ignored" in caplog.text
    # Records timed on another number of TVM threads are not mixed in either.
    (path / "meta.json").write_text(json.dumps({**meta, "threads": meta["threads"] + 1}))
    with caplog.at_level("WARNING", logger="collage_tvm"):
        assert tuning.open_tuning_db(str(path), TARGET) is None
    assert "threads" in caplog.text
    # A missing directory is no database (and is not created unless asked).
    assert tuning.open_tuning_db(str(tmp_path / "none"), TARGET) is None
    assert not (tmp_path / "none").exists()


def test_default_directory_sits_next_to_the_cost_db_one_per_target(tmp_path):
    d = tuning.default_dir(str(tmp_path / "costs.db"), TARGET)
    assert d.startswith(str(tmp_path / "costs.tuning")) and tuning.target_id(TARGET) in d
    assert tuning.default_dir(":memory:", TARGET) is None
    other = tvm.target.Target({"kind": "llvm", "num-cores": 1})
    assert tuning.target_id(other) != tuning.target_id(TARGET)


def test_the_host_cpu_is_one_target_however_it_is_given(tmp_path):
    # issue #35: Target({"kind": "llvm"}) found none of the records "llvm" had tuned (the
    # tuning DB and the costs are keyed by the mcpu the string form adds); it also compiled
    # for a generic x86-64 CPU.
    from collage_tvm.target import device_fingerprint, make_target

    host = make_target("llvm")
    for given in (tvm.target.Target({"kind": "llvm"}), {"kind": "llvm"}, '{"kind": "llvm"}'):
        same = make_target(given)
        assert str(same) == str(host), given
        assert tuning.default_dir(str(tmp_path / "c.db"), same) == tuning.default_dir(
            str(tmp_path / "c.db"), host)
        assert device_fingerprint(same) == device_fingerprint(host)
    named = make_target({"kind": "llvm", "mcpu": "x86-64"})  # a CPU named: kept as given
    assert named.attrs["mcpu"] == "x86-64"
    arm = make_target({"kind": "llvm", "mtriple": "aarch64-linux-gnu"})  # another machine's
    assert not arm.attrs.get("mcpu")
    assert make_target({"kind": "llvm", "num-cores": 1}).attrs["num-cores"] == 1


def test_tuner_goes_on_after_a_failing_kernel_and_stops_at_the_budget(tmp_path, monkeypatch):
    db = tuning.TuningDB(str(tmp_path / "t"), TARGET)
    items = [tuning.KernelToTune(f"k{i}", tuning.kernels(_matmul(16 + i)["main"], TARGET)[0][1])
             for i in range(3)]
    calls = []

    def fake_tune(db_, item, trials, seed):
        calls.append((item.name, trials))
        if item.name == "k0":
            raise RuntimeError("schedule space is empty")

    monkeypatch.setattr(tuner, "_tune_one", fake_tune)
    res = tuning.tune_kernels(db, items, budget_s=1e6, trials=32, progress=False)
    assert [r.status for r in res] == ["failed", "tuned", "tuned"]
    assert "schedule space is empty" in res[0].reason
    assert all(r.untuned_ms > 0 for r in res)  # each kernel's untuned time, measured
    # One round first, then what the kernel's share of the budget allows (here all 32).
    assert calls == [("k0", 16), ("k1", 16), ("k1", 16), ("k2", 16), ("k2", 16)]
    assert [r.trials for r in res] == [0, 32, 32]
    # No budget left for even one round: nothing is tuned, each kernel says why; the kernel
    # that failed is remembered and not tried again.
    res = tuning.tune_kernels(db, items, budget_s=1.0, trials=32, progress=False)
    assert [r.status for r in res] == ["failed", "skipped", "skipped"]
    assert res[0].reason.startswith("in an earlier tune: RuntimeError: schedule space is empty")
    assert res[1].reason == "out of budget"
    # Untuned times are kept beside the records.
    assert set(json.loads((tmp_path / "t" / tuner.UNTUNED).read_text())) == {i.key for i in items}
    # Interrupted (Ctrl-C): the interruption goes through, what was measured is kept.
    (tmp_path / "t" / tuner.UNTUNED).unlink()

    def interrupted(db_, item, trials, seed):
        raise KeyboardInterrupt

    monkeypatch.setattr(tuner, "_tune_one", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tuning.tune_kernels(db, items[1:], budget_s=1e6, trials=32, progress=False)
    assert items[1].key in json.loads((tmp_path / "t" / tuner.UNTUNED).read_text())


def test_a_cpu_schedule_loads_the_x86_intrinsics_alone():
    """Not every target's (tensor_intrin's __init__: 45 s to minutes): x86's, registered;
    a later import of the package (MetaSchedule's TuneContext) costs nothing."""
    import subprocess
    import sys

    code = ("import sys, time, tvm\n"
            "from collage_tvm.tuning.inprocess import tensor_intrinsics\n"
            "from collage_tvm.target import make_target\n"
            "tensor_intrinsics(make_target('llvm'))\n"
            "from tvm.s_tir import TensorIntrin\n"
            "assert TensorIntrin.get('dot_16x4_vnni', allow_missing=True) is not None\n"
            "t = time.time(); import tvm.s_tir.tensor_intrin; assert time.time() - t < 1\n"
            "print(sorted(m for m in sys.modules if m.startswith('tvm.s_tir.tensor_intrin.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['tvm.s_tir.tensor_intrin.x86']"


def test_tuning_a_kernel_records_schedules_the_build_applies(tmp_path):
    """Real MetaSchedule: 16 trials of one matmul, built tuned, same outputs; the
    candidate's signature names the record; tuning again with enough records: cached."""
    mod = _matmul(64, 128, 128)
    (name, kernel), = tuning.kernels(mod["main"], TARGET)
    db = tuning.TuningDB(str(tmp_path / "t"), TARGET)
    assert db.signature(mod["main"]) == "" and db.digest() == ""
    res, = tuning.tune_kernels(db, [tuning.KernelToTune(name, kernel)], budget_s=120,
                               trials=16, progress=False)
    assert res.status == "tuned" and res.trials == 16, res
    assert db.trials(kernel) >= 8 and math.isfinite(res.tuned_ms)
    assert res.tuned_ms < res.untuned_ms  # a tiled matmul beats the naive loop nest
    sig = db.signature(mod["main"])
    assert sig and db.digest()
    assert db.signature(_conv_block()["main"]) == ""  # another kernel: untouched
    x = np.random.default_rng(2).standard_normal((64, 128)).astype("float32")
    np.testing.assert_allclose(_run(tuning.compile_module(mod, TARGET, db.database), x),
                               _run(tuning.compile_module(mod, TARGET), x), rtol=1e-4, atol=1e-4)
    # Re-opened from disk: the same records; enough of them, so nothing is tuned again.
    again = tuning.TuningDB(str(tmp_path / "t"), TARGET)
    assert again.signature(mod["main"]) == sig
    res, = tuning.tune_kernels(again, [tuning.KernelToTune(name, kernel)], budget_s=120,
                               trials=db.trials(kernel), progress=False)
    assert res.status == "cached" and res.trials == 0


class _Backend:
    def __init__(self, external):
        self.is_external = external


def test_plan_stakes_what_the_placement_spends_on_each_kernel():
    """A kernel's stake is min(untuned TVM, best library) summed over its places: a conv a
    library runs fast stakes the library's time, an op only TVM runs stakes all of its.
    (Fake costs: this checks the arithmetic, not a measurement.)"""
    graph = DataflowGraph(_conv_block()["main"])
    assert [n.op_name for n in graph.nodes[:3]] == ["relax.nn.conv2d", "relax.add", "relax.nn.relu"]
    conv, add, relu = (frozenset([i]) for i in range(3))
    tail = frozenset([1, 2])
    whole = frozenset([0, 1, 2])
    cands = {Candidate("tvm", whole): 0.05, Candidate("lib", whole): 3.0,  # TVM's own fusion
             Candidate("tvm", conv): 100.0, Candidate("lib", conv): 1.0,
             Candidate("tvm", tail): 0.5,  # no library candidate for add+relu
             Candidate("tvm", add): 0.3, Candidate("lib", add): 0.2,
             Candidate("tvm", relu): math.inf}  # failed: no stake
    items = plan(graph, list(cands), cands, {"tvm": _Backend(False), "lib": _Backend(True)},
                 TARGET)
    by_name = {i.name: i for i in items}
    assert by_name["conv2d"].stake_ms == pytest.approx(1.0)
    assert by_name["conv2d"].best_library_ms == pytest.approx(1.0)
    assert by_name["fused_add_relu"].stake_ms == pytest.approx(0.5)
    assert math.isinf(by_name["fused_add_relu"].best_library_ms)
    assert by_name["add"].stake_ms == pytest.approx(0.2)
    assert "relu" not in by_name
    # TVM's own fusion of the model first, whatever its stake; then largest stake first.
    assert by_name["fused_conv2d_add_relu"].tier == 0 and by_name["conv2d"].tier == 1
    assert [i.name for i in items] == ["fused_conv2d_add_relu", "conv2d", "fused_add_relu", "add"]


def test_placement_key_names_the_tuning_records():
    func = _conv_block()["main"]
    backends = {"tvm": collage_tvm.get_backend("tvm")}
    plain = placement_key(func, TARGET, backends)
    assert placement_key(func, TARGET, backends, tuning="") == plain
    assert placement_key(func, TARGET, backends, tuning="abc") != plain
    untuned = collage_tvm.SearchOptions(tuning=False)
    assert placement_key(func, TARGET, backends, untuned) != plain


def test_placement_key_names_the_cost_model(monkeypatch):
    # Placements searched on costs the measurer no longer gives (before cold-cache timing)
    # are searched again.
    import importlib

    build = importlib.import_module("collage_tvm.stores")  # where the key is made
    func = _conv_block()["main"]
    backends = {"tvm": collage_tvm.get_backend("tvm")}
    now = placement_key(func, TARGET, backends)
    monkeypatch.setattr(build, "COST_MODEL", "an earlier one")
    assert placement_key(func, TARGET, backends) != now


def test_tune_then_build_uses_tuned_kernels_and_a_second_tune_measures_nothing(tmp_path):
    """The whole loop on a matmul (tvm alone: one kernel): tune, then optimize applies the
    records (tune re-measured the tuned TVM candidate: a DB hit), outputs match the
    untuned build; a second tune finds everything done and says so."""
    mod = _matmul(64, 128, 128)
    db = str(tmp_path / "costs.db")
    rep = collage_tvm.tune(mod, backends=["tvm"], db=db, budget=120, trials=16,
                           progress=False, isolate=False)
    assert [r.status for r in rep.results] == ["tuned"] and rep.remeasured == 1, rep.summary()
    assert os.path.dirname(rep.tuning_db) == str(tmp_path / "costs.tuning")
    assert "| matmul | " in rep.markdown() and " | 1 | " in rep.markdown()
    res = collage_tvm.optimize(mod, backends=["tvm"], db=db, progress=False, isolate=False,
                               graph_level=False, compare=False)
    assert res.report.tuning["records"] == rep.records_after > 0
    assert res.report.distinct_measured == 0, res.report  # tune measured everything
    plain = collage_tvm.optimize(mod, backends=["tvm"], db=db, progress=False, isolate=False,
                                 tuning=False, graph_level=False, compare=False)
    assert not plain.report.tuning
    x = np.random.default_rng(3).standard_normal((64, 128)).astype("float32")
    np.testing.assert_allclose(_run(res.executable, x), _run(plain.executable, x),
                               rtol=1e-4, atol=1e-4)
    # The bench's variant: untuned beside tuned, interleaved, outputs checked.
    from collage_tvm.tools.bench import tuning_steps

    steps = tuning_steps(mod, collage_tvm.SearchOptions(backends=("tvm",), isolate=False,
                                                        progress=False), db)
    assert [s["label"] for s in steps] == ["untuned TVM", "tuned TVM"]
    assert all(s["match"] and s["ms"] > 0 for s in steps)
    again = collage_tvm.tune(mod, backends=["tvm"], db=db, budget=120, trials=16,
                             progress=False, isolate=False)
    assert [r.status for r in again.results] == ["cached"]
    assert again.measured == 0 and again.remeasured == 0
    assert again.summary().startswith("measured nothing new")
    # The budget is per model and cumulative: what earlier tunes took counts.
    assert again.spent_before >= rep.times["tune"] * 0.99 > 0
    spent = collage_tvm.tune(mod, backends=["tvm"], db=db, budget=1, trials=64,
                             progress=False, isolate=False)
    assert [r.status for r in spent.results] == ["skipped"]
    assert spent.results[0].reason == "budget spent by earlier tunes"
    assert "this model has had" in spent.summary()


def _matmul_onnx(path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((32, 32)).astype("float32"), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def test_cli_tune_reports_per_kernel_and_db_stats_lists_the_tuning_db(tmp_path, capsys):
    """``collage-tvm tune`` with no time to tune: the candidates are measured, the kernel is
    planned and reported as out of budget; ``db stats`` lists the tuning database."""
    from collage_tvm.cli import main

    path = _matmul_onnx(str(tmp_path / "mm.onnx"))
    db = str(tmp_path / "costs.db")
    assert main(["tune", path, "--backends", "tvm", "--db", db, "--budget", "1",
                 "--in-process"]) == 0
    out = capsys.readouterr().out
    assert "| matmul | " in out and "out of budget" in out and "1 kernel(s) planned" in out
    assert main(["db", "stats", "--db", db]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert len(stats["tuning"]) == 1 and stats["tuning"][0]["records"] == 0
    assert stats["tuning"][0]["path"].startswith(str(tmp_path / "costs.tuning"))
    assert main(["tune", str(tmp_path / "missing.onnx"), "--db", db]) == 2
    assert "missing.onnx" in capsys.readouterr().err


def test_measuring_in_process_uses_the_records_the_build_sees_now(tmp_path):
    """A candidate built in this process with the database's path applies the active
    database, not a copy opened earlier from the same path (which would miss records added
    since, while the candidate's key names them)."""
    path = str(tmp_path / "t")
    first = tuning.TuningDB(path, TARGET)
    with tuning.use_tuning_db(path, TARGET) as opened:  # a copy, opened from the path
        assert opened is not None and opened is not first
    again = tuning.TuningDB(path, TARGET)  # e.g. reloaded after a tune
    with tuning.use_tuning_db(again):
        with tuning.use_tuning_db(path, TARGET) as used:
            assert used is again and tuning.active_database() is again
    assert tuning.active_database() is None
    with tuning.use_tuning_db(None) as none:
        assert none is None and tuning.active_database() is None
