"""Any model a user brings builds (issue #15): TVM covers every node, by construction."""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import tvm
from tvm import relax

import collage_tvm
from collage_tvm.placement import Candidate
from collage_tvm.placer.op_level import ensure_cover
from collage_tvm.target import make_target
from collage_tvm.tools.suites import matches, onnx_cases, tvm_only_check
from collage_tvm.check.contender import records

CPU_BACKENDS = ["tvm", "dnnl", "mkl", "onnxruntime", "openvino"]


def _available_backends():
    return [b for b in CPU_BACKENDS if collage_tvm.get_backend(b).available()[0]]


def _check_suite(cases) -> int:
    target = make_target("llvm")
    passed, failures = 0, []
    for case in cases:
        r = tvm_only_check(case, target)
        if r["tvm"] != "match":
            continue  # TVM alone cannot run it: nothing to hold Collage to
        passed += 1
        if r["collage"] != "match" or r.get("uncovered"):
            failures.append(f"{case.name}: {r}")
    assert not failures, "\n".join(failures)
    return passed


def test_onnx_file_suites_build_in_collage_wherever_tvm_alone_runs_them():
    n = _check_suite(c for s in ("pytorch-converted", "pytorch-operator", "simple")
                     for c in onnx_cases(s))
    assert n >= 100  # the wheel's 140 cases, 121 of which TVM alone runs (2026-11-23)


def test_onnx_node_suite_sample_builds_in_collage_wherever_tvm_alone_runs_it():
    sample = [c for k, c in enumerate(onnx_cases("node")) if k % 10 == 0]
    assert _check_suite(sample) >= 50


def test_node_cases_stored_as_tensor_protos_reach_both_builds_as_arrays():
    """The cast and quantize cases hold their data as TensorProtos (bfloat16, float8): they
    were fed to TVM as numpy object arrays, and both builds failed with "unknown dtype
    `object`" (161 rows) instead of being tested."""
    names = ("test_cast_FLOAT16_to_FLOAT", "test_cast_DOUBLE_to_FLOAT16")
    cases = [c for c in onnx_cases("node") if c.name in names]
    assert len(cases) == 2
    for case in cases:
        assert all(isinstance(a, np.ndarray) and a.dtype != object
                   for a in case.inputs + case.outputs), case.name
    assert _check_suite(cases) == 2


@pytest.mark.slow
def test_onnx_node_suite_builds_in_collage_wherever_tvm_alone_runs_it():
    assert _check_suite(onnx_cases("node")) >= 700


def test_a_node_no_backend_could_time_alone_stays_on_tvm():
    cands = [Candidate("tvm", frozenset([0])), Candidate("tvm", frozenset([1])),
             Candidate("dnnl", frozenset([0, 1])), Candidate("tvm", frozenset([2]))]
    costs = {cands[0]: 1.0, cands[1]: math.inf, cands[2]: math.inf, cands[3]: 2.0}
    fixed, kept = ensure_cover(3, cands, costs)
    assert kept == [1] and fixed[cands[1]] == 0.0 and fixed[cands[0]] == 1.0
    assert costs[cands[1]] == math.inf  # the caller's table is left as it was
    assert ensure_cover(3, cands, fixed)[1] == []


class FusedQKV(nn.Module):
    """Attention with one fused QKV projection split into q, k, v (the GPT/BERT idiom)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).split(32, dim=-1)
        attn = torch.softmax(q @ k.transpose(-1, -2) / 32 ** 0.5, dim=-1)
        return self.out(attn @ v)


class Relu6CNN(nn.Module):
    """ReLU6 (ONNX Clip 0..6): TVM's ONNX importer makes it two call_tir bindings."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.c2(nn.functional.relu6(self.c1(x)))


@pytest.mark.parametrize("model,shape", [(FusedQKV, (1, 16, 32)), (Relu6CNN, (1, 3, 16, 16))],
                         ids=["fused_qkv", "relu6"])
def test_models_that_crashed_the_search_build_on_every_cpu_backend_and_match_torch(
        model, shape, tmp_path):
    torch.manual_seed(0)
    m, x = model().eval(), torch.randn(*shape)
    path = str(tmp_path / "m.onnx")
    torch.onnx.export(m, (x,), path, dynamo=False, opset_version=17)
    backends = _available_backends()
    res = collage_tvm.optimize(path, "llvm", backends, db=str(tmp_path / "c.db"), compare=True,
                               isolate=False, progress=False, calibrate_rounds=0,
                               refine_rounds=0, graph_level=False)
    comp = records(res.report.comparison)
    assert all(r["match"] for r in comp.values()), comp
    vm = relax.VirtualMachine(res.executable, tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x.numpy())).numpy()
    with torch.no_grad():
        assert matches([got], [m(x).numpy()], 1e-3, 1e-4)


def test_a_model_with_control_flow_is_compiled_by_tvm_alone_with_the_reason(tmp_path):
    case = next(c for c in onnx_cases("node") if c.name == "test_if")
    res = collage_tvm.optimize(case.model, "llvm", ["tvm", "dnnl"], db=str(tmp_path / "c.db"),
                               progress=False, graph_level=False, compare=False)
    assert res.graph is None and "dataflow block" in res.report.kept_on_tvm[0]
    vm = relax.VirtualMachine(res.executable, tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(np.asarray(a)) for a in case.inputs])
    assert matches([got.numpy()], case.outputs, case.rtol, case.atol)


class _Lstm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(8, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        return self.head(self.lstm(x)[0][:, -1])


def test_a_model_tvm_cannot_import_runs_wholly_on_a_graph_library(tmp_path, capsys):
    from collage_tvm.cli import main
    from collage_tvm.frontend.load import ModelError

    path = str(tmp_path / "lstm.onnx")
    m = _Lstm().eval()
    torch.onnx.export(m, (torch.randn(1, 5, 8),), path, dynamo=False, opset_version=17)
    with pytest.raises(ModelError, match="ONNX import failed.*LSTM.*add onnxruntime or openvino"):
        collage_tvm.optimize(path, "llvm", ["tvm", "dnnl"], db=str(tmp_path / "c.db"),
                             graph_level=False, compare=False)
    res = collage_tvm.optimize(path, "llvm", ["tvm", "dnnl", "onnxruntime"],
                               db=str(tmp_path / "c.db"), progress=False,
                               graph_level=False, compare=False)
    assert res.graph is None and res.report.whole_model["backend"] == "onnxruntime"
    assert "LSTM" in res.report.whole_model["why"]
    x = torch.randn(1, 5, 8)
    got = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    with torch.no_grad():
        assert matches([got.numpy()], [m(x).numpy()], 1e-4, 1e-5)
    assert main(["optimize", path, "--backends", "tvm,onnxruntime", "--no-graph-level",
                 "--db", str(tmp_path / "c.db")]) == 0
    assert "it runs wholly on onnxruntime" in capsys.readouterr().out


def test_a_model_tvm_cannot_import_runs_on_the_library_that_runs_it_fastest_here(tmp_path):
    path = str(tmp_path / "lstm.onnx")
    m = _Lstm().eval()
    torch.onnx.export(m, (torch.randn(1, 5, 8),), path, dynamo=False, opset_version=17)
    res = collage_tvm.optimize(path, "llvm", ["tvm", "onnxruntime", "openvino"],
                               db=str(tmp_path / "c.db"), graph_level=False, compare=False)
    whole = res.report.whole_model
    assert set(whole["timed"]) == {"onnxruntime", "openvino"}  # both ran it, side by side
    assert whole["backend"] in whole["timed"]
    lead = min(whole["timed"], key=whole["timed"].get)
    assert whole["backend"] == lead or whole["backend"] == "onnxruntime"  # (within 1%: kept)
    x = torch.randn(1, 5, 8)
    got = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    with torch.no_grad():
        assert matches([got.numpy()], [m(x).numpy()], 1e-4, 1e-5)


def _dynamic_batch_onnx(path):
    m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()).eval()
    torch.onnx.export(m, (torch.randn(1, 3, 8, 8),), path, dynamo=False, opset_version=17,
                      input_names=["image"], dynamic_axes={"image": {0: "batch"}})
    return m


def test_a_dynamic_input_dimension_keeps_the_model_on_tvm_naming_the_flag_that_fixes_it(
        tmp_path, capsys):
    from collage_tvm.cli import main
    from collage_tvm.frontend.load import ModelError

    path = str(tmp_path / "dyn.onnx")
    m = _dynamic_batch_onnx(path)
    res = collage_tvm.optimize(path, "llvm", ["tvm", "dnnl"], db=str(tmp_path / "c.db"),
                               progress=False, graph_level=False, compare=False)
    assert res.graph is None and len(res.report.kept_on_tvm) == 1
    assert "input 'image' has a dynamic dimension 0" in res.report.kept_on_tvm[0]
    assert "--input-shape image=1x3x8x8" in res.report.kept_on_tvm[0]
    x = torch.randn(3, 3, 8, 8)  # TVM alone runs any batch
    got = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    with torch.no_grad():
        assert matches([got.numpy()], [m(x).numpy()], 1e-3, 1e-4)
    with pytest.raises(ModelError, match="names no input of the model: imgae; its inputs: image"):
        collage_tvm.optimize(path, "llvm", ["tvm"], db=str(tmp_path / "c.db"),
                             input_shapes={"imgae": (2, 3, 8, 8)},
                             graph_level=False, compare=False)
    res = collage_tvm.optimize(path, "llvm", ["tvm"], db=str(tmp_path / "c.db"), progress=False,
                               isolate=False, input_shapes={"image": (2, 3, 8, 8)},
                               graph_level=False, compare=False)
    assert res.graph is not None and not res.report.kept_on_tvm
    x = torch.randn(2, 3, 8, 8)
    got = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    with torch.no_grad():
        assert matches([got.numpy()], [m(x).numpy()], 1e-3, 1e-4)
    assert main(["optimize", path, "--backends", "tvm", "--db", str(tmp_path / "c.db"),
                 "--in-process", "--no-compare", "--input-shape", "image=2x3x8x8"]) == 0
    capsys.readouterr()
    assert main(["optimize", path, "--backends", "tvm", "--db", str(tmp_path / "c.db")]) == 0
    assert "--input-shape image=1x3x8x8" in capsys.readouterr().out
    assert main(["optimize", path, "--backends", "tvm", "--input-shape", "image=2by3"]) == 2


def _suite_row(suite, name, backends, tmp_path):
    from collage_tvm.tools.suites import TORCH_SUITES, torch_model_check

    return torch_model_check(TORCH_SUITES[suite][1], name, backends, str(tmp_path / "c.db"),
                             str(tmp_path))


def _transformers_row(name, backends, tmp_path):
    pytest.importorskip("transformers")  # the test extra (make setup installs it)
    return _suite_row("transformers", name, backends, tmp_path)


@pytest.mark.parametrize("name", [pytest.param("gpt2", marks=pytest.mark.slow),  # ~65 s
                                  "llama"])
def test_transformers_decoders_from_configs_build_and_match_torch(name, tmp_path):
    row = _transformers_row(name, ["tvm"], tmp_path)  # every backend: the slow test below
    assert row["status"] == "built" and row["match"], row
    assert row["shipped"] in ("collage", row["best"][0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "roberta", "distilbert", "gpt2", "gpt_neo",
                                  "t5_encoder", "vit", "whisper_encoder", "llama"])
def test_transformers_suite_builds_on_every_cpu_backend_and_matches_torch(name, tmp_path):
    backends = _available_backends()
    row = _transformers_row(name, backends, tmp_path)
    assert row["status"] == "built" and row["match"], row


# Opsets 13 to the newest each exporter writes: the TorchScript-based one stops at 23;
# the dynamo one writes up to 28, the newest onnx 1.23 defines (checked in the test).
@pytest.mark.parametrize("exporter,opset", [("torchscript", 13), ("torchscript", 18),
                                            ("torchscript", 23), ("dynamo", 13),
                                            ("dynamo", 18), ("dynamo", "newest")])
@pytest.mark.parametrize("model,shape", [(FusedQKV, (1, 16, 32)), (Relu6CNN, (1, 3, 16, 16))],
                         ids=["fused_qkv", "relu6"])
def test_onnx_from_both_pytorch_exporters_builds_and_matches_torch(model, shape, opset, exporter,
                                                                   tmp_path):
    import onnx

    if opset == "newest":
        opset = onnx.defs.onnx_opset_version()
        assert opset >= 28

    torch.manual_seed(0)
    m, x = model().eval(), torch.randn(*shape)
    path = str(tmp_path / "m.onnx")
    if exporter == "dynamo":
        pytest.importorskip("onnxscript")  # the test extra (make setup installs it)
        torch.onnx.export(m, (x,), dynamo=True, opset_version=opset).save(path)
    else:
        torch.onnx.export(m, (x,), path, dynamo=False, opset_version=opset)
    proto = onnx.load(path)
    proto.ir_version = min(proto.ir_version, 10)
    onnx.save(proto, path)
    res = collage_tvm.optimize(path, "llvm", ["tvm"], db=str(tmp_path / "c.db"), isolate=False,
                               progress=False, calibrate_rounds=0, refine_rounds=0,
                               graph_level=False, compare=False)
    got = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    with torch.no_grad():
        assert matches([got.numpy()], [m(x).numpy()], 1e-3, 1e-4)


@pytest.mark.parametrize("model,shape", [(FusedQKV, (1, 16, 32)), (Relu6CNN, (1, 3, 16, 16))],
                         ids=["fused_qkv", "relu6"])
def test_pytorch_modules_through_torch_export_build_and_match_torch(model, shape, tmp_path):
    torch.manual_seed(0)
    m, x = model().eval(), torch.randn(*shape)
    res = collage_tvm.optimize(m, "llvm", ["tvm", "dnnl"], db=str(tmp_path / "c.db"),
                               example_inputs=(x,), isolate=False, progress=False,
                               calibrate_rounds=0, refine_rounds=0,
                               graph_level=False, compare=False)
    got = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    got = got[0] if type(got).__name__ == "Array" or isinstance(got, (list, tuple)) else got
    with torch.no_grad():
        assert matches([got.numpy()], [m(x).numpy()], 1e-3, 1e-4)


@pytest.mark.parametrize("suite,name", [("pytorch-converted", "test_AvgPool1d"),
                                        ("pytorch-operator", "test_operator_sqrt"),
                                        ("node", "test_shape"), ("node", "test_size")])
def test_final_check_on_one_op_models_and_nan_outputs(suite, name, tmp_path):
    """test_AvgPool1d: Collage places it exactly as TVM alone would, so the check's reference
    (tvm-only) is the same build as Collage's and must still be compared. test_operator_sqrt:
    the square root of negative inputs is NaN in every build, which is agreement, not error.
    test_shape, test_size: a shape and a 0-d result, compared like tensors."""
    from collage_tvm.tools.suites import collage_check, input_shapes

    case = next(c for c in onnx_cases(suite) if c.name == name)
    row = collage_check(case.model, case.inputs, case.outputs, ["tvm", "dnnl"],
                        str(tmp_path / "c.db"), input_shapes=input_shapes(case))
    assert row["status"] == "built" and row["match"], row


def test_integer_division_by_a_random_input_never_divides_by_zero(tmp_path):
    """test_div_int8 and friends (onnx node tests): Collage's measurements and final check
    run each build on random inputs; an integer zero among them as a divisor is a SIGFPE that
    killed the whole search (and the suite with it). Divisors are now drawn from [1, 4).
    Run in a child process, so that a regression is a failed test, not a dead pytest."""
    import subprocess
    import sys

    from collage_tvm.graph.subgraph import divisor_params, random_inputs

    code = ("from collage_tvm.tools.suites import onnx_cases, collage_check\n"
            "names = ['test_div_int8', 'test_mod_int64_fmod']\n"
            "for c in onnx_cases('node'):\n"
            "    if c.name in names:\n"
            "        row = collage_check(c.model, c.inputs, c.outputs, ['tvm', 'onnxruntime'],\n"
            f"                            {str(tmp_path / 'c.db')!r}, c.rtol, c.atol)\n"
            "        print(c.name, row['status'], row.get('match'))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[-3:-1] == ["test_div_int8 built True",
                                              "test_mod_int64_fmod built True"], run.stdout
    # Found through a cast; an index input keeps 0 (a valid index everywhere).
    a = relax.Var("a", relax.TensorType((64,), "int32"))
    b = relax.Var("b", relax.TensorType((64,), "int8"))
    i = relax.Var("i", relax.TensorType((64,), "int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [a, b, i]):
        with bb.dataflow():
            q = bb.emit(relax.op.floor_divide(a, bb.emit(relax.op.astype(b, "int32"))))
            out = bb.emit_output(relax.op.take(q, i, axis=0))
        bb.emit_func_output(out)
    func = bb.get()["main"]
    assert divisor_params(func) == {func.params[1]}
    _, bs, idx = random_inputs(func)
    assert bs.min() >= 1 and idx.min() == 0


def test_a_sequence_input_of_unknown_dtype_gets_float_random_inputs():
    """test_identity_sequence / test_identity_opt (onnx node tests): TVM's importer stacks the
    sequence into one tensor and leaves its dtype unknown; the final check's random inputs
    failed on it ("data type 'None' not understood") and the search crashed."""
    from collage_tvm.tools.suites import collage_check, input_shapes

    for name in ("test_identity_sequence", "test_identity_opt"):
        case = next(c for c in onnx_cases("node") if c.name == name)
        row = collage_check(case.model, case.inputs, case.outputs, ["tvm", "onnxruntime"],
                            ":memory:", case.rtol, case.atol, input_shapes=input_shapes(case))
        assert row["status"] == "built" and row["match"], (name, row)


def _node_case(name):
    from collage_tvm.tools.suites import input_shapes

    case = next(c for c in onnx_cases("node") if c.name == name)
    return case, input_shapes(case)


def test_shape_vars_a_match_cast_defines_order_and_pin_the_nodes_that_read_them():
    """test_squeeze (axes as an input): TVM's importer computes the output shape at run time
    and binds it with match_casts that define symbolic vars; the final reshape reads them but
    none of the match_cast's Relax vars. The graph missed that edge, the placement ran the
    reshape first, and TVM failed ('PrimExpr ... has not been computed'). Now the edge is
    there, and the nodes defining or reading such vars get their single TVM op only."""
    from collage_tvm.registry import resolve_backends
    from collage_tvm.frontend import load_model, normalize_for_collage
    from collage_tvm.graph import DataflowGraph
    from collage_tvm.candidates import generate_candidates

    case, shapes = _node_case("test_squeeze")
    graph = DataflowGraph.from_module(normalize_for_collage(load_model(case.model, None, shapes)))
    definers = [n for n in graph.nodes if n.defines]
    reshape = graph.nodes[graph.outputs[0]]
    assert definers and reshape.op_name == "relax.reshape"
    assert definers[-1].index in reshape.inputs, (definers, reshape)
    assert {n.index for n in definers} | {reshape.index} <= graph.pinned
    backends, _ = resolve_backends(["tvm", "onnxruntime"], make_target("llvm"))
    cands = generate_candidates(graph, list(backends.values()))
    for c in cands:
        if c.nodes & graph.pinned:
            assert c.backend == "tvm" and len(c.nodes) == 1, c
    # Nodes that only compute the shape's values stay placeable on the library.
    assert any(c.backend == "onnxruntime" for c in cands)


@pytest.mark.parametrize("name", ["test_squeeze", "test_range_float_type_positive_delta"])
def test_models_whose_shapes_are_computed_at_run_time_build_and_match(name, tmp_path):
    """Two of the 16 onnx node cases that crashed the search (run-time shapes from input
    values: squeeze axes, a range's limits; the whole node suite in `make test-slow`)."""
    from collage_tvm.tools.suites import collage_check

    case, shapes = _node_case(name)
    row = collage_check(case.model, case.inputs, case.outputs, ["tvm", "onnxruntime"],
                        str(tmp_path / "c.db"), case.rtol, case.atol, input_shapes=shapes)
    assert row["status"] == "built" and row["match"], row


def test_the_check_runs_every_build_on_the_users_inputs_first(tmp_path):
    """test_slice_default_axes: starts and ends are inputs. Random ones make a slice of
    negative extent, on which TVM alone fails too (std::bad_alloc): the search crashed. The
    user's example inputs are now the first inputs every build is checked and timed on."""
    import numpy as np

    from collage_tvm import optimize
    from collage_tvm.graph.subgraph import given_inputs, random_inputs

    case, shapes = _node_case("test_slice_default_axes")
    res = optimize(case.model, "llvm", ["tvm", "onnxruntime"], db=str(tmp_path / "c.db"),
                   compare=True, progress=False, input_shapes=shapes,
                   example_inputs=case.inputs, graph_level=False)
    vm = relax.VirtualMachine(res.executable, tvm.cpu())
    got = vm["main"](*[tvm.runtime.tensor(a) for a in case.inputs])
    assert matches([got.numpy()], case.outputs, case.rtol, case.atol)
    assert records(res.report.comparison)["tvm-only"]["match"]
    # Only seed 0, and only where the arrays fit the parameters.
    func = res.graph.func
    with given_inputs(case.inputs):
        assert all(np.array_equal(a, b) for a, b in zip(random_inputs(func), case.inputs))
        assert not np.array_equal(random_inputs(func, seed=1)[1], case.inputs[1])
        assert random_inputs(func.params[:1])[0].shape == case.inputs[0].shape
    with given_inputs([case.inputs[0][:1], *case.inputs[1:]]):  # does not fit: random
        assert random_inputs(func)[0].shape == case.inputs[0].shape


def test_optimize_takes_example_inputs_from_a_file_by_input_name(tmp_path, capsys):
    """`collage-tvm optimize model.onnx --inputs FILE.npz`: the CLI way to the check on the
    user's inputs (test_slice_default_axes fails on random slice bounds in TVM alone too);
    a file that does not fit the model's inputs is an error naming them."""
    import onnx

    from collage_tvm.cli import main
    from collage_tvm.frontend.load import read_example_inputs

    case, _ = _node_case("test_slice_default_axes")
    path = str(tmp_path / "slice.onnx")
    onnx.save(case.model, path)
    names = [i.name for i in case.model.graph.input]
    good = str(tmp_path / "in.npz")
    np.savez(good, **dict(zip(names, case.inputs)))
    db = str(tmp_path / "c.db")
    assert main(["optimize", path, "--backends", "tvm,onnxruntime", "--db", db,
                 "--no-graph-level", "--inputs", good]) == 0
    positional = str(tmp_path / "pos.npz")
    np.savez(positional, *case.inputs)  # arr_0, arr_1, ...: in the model's input order
    got = read_example_inputs(positional, path)
    assert all(np.array_equal(a, b) for a, b in zip(got, case.inputs)) and len(got) == 3
    bad = str(tmp_path / "bad.npz")
    np.savez(bad, x=case.inputs[0], begin=case.inputs[1])
    capsys.readouterr()
    assert main(["optimize", path, "--backends", "tvm", "--db", db, "--inputs", bad]) == 2
    err = capsys.readouterr().err
    assert "missing starts, ends" in err and "not inputs: begin" in err, err


def test_a_placement_that_fails_to_compile_ships_tvm_alone_with_the_reason(tmp_path, monkeypatch):
    import importlib

    build = importlib.import_module("collage_tvm.build")  # the module (collage_tvm.build is the function)

    def broken(*args, **kwargs):
        raise RuntimeError("codegen of group 3 failed")

    torch.manual_seed(0)
    m, x = Relu6CNN().eval(), torch.randn(1, 3, 16, 16)
    path = str(tmp_path / "m.onnx")
    torch.onnx.export(m, (x,), path, dynamo=False, opset_version=17)
    monkeypatch.setattr(build, "compile_staged", broken)  # (the shipped build's compile)
    res = collage_tvm.optimize(path, "llvm", ["tvm"], db=str(tmp_path / "c.db"), isolate=False,
                               progress=False, calibrate_rounds=0, refine_rounds=0,
                               graph_level=False, compare=False)
    assert res.report.shipped == "tvm-only"
    assert "codegen of group 3 failed" in res.report.kept_on_tvm[-1]
    got = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    with torch.no_grad():
        assert matches([got.numpy()], [m(x).numpy()], 1e-3, 1e-4)


# ------------------------------------------------------------------ torchvision and timm

def _torchvision_names(task=None):
    """Every classification model of torchvision (``task`` None), or of its ``segmentation``
    or ``video`` module; [] without torchvision."""
    try:
        from collage_tvm.tools.suites import torchvision_names, torchvision_task_names
        return torchvision_task_names(task) if task else torchvision_names()
    except ImportError:
        return []


def test_torchvision_imports_against_the_cpu_torch_and_lists_every_classification_model():
    pytest.importorskip("torchvision")  # the test extra (make setup installs it)
    names = _torchvision_names()
    assert len(names) >= 80 and {"resnet50", "vit_b_16", "swin_t", "maxvit_t"} <= set(names)
    from collage_tvm.tools.suites import torchvision_model

    model, (x,) = torchvision_model("vit_b_32")  # a ViT at 64x64: image_size passed through
    assert x.shape == (1, 3, 64, 64) and model.image_size == 64


def test_torchvision_segmentation_and_video_suites_list_every_model_and_build_its_input():
    pytest.importorskip("torchvision")
    seg, video = _torchvision_names("segmentation"), _torchvision_names("video")
    assert {"fcn_resnet50", "deeplabv3_resnet50", "lraspp_mobilenet_v3_large"} <= set(seg)
    assert {"r3d_18", "mc3_18", "r2plus1d_18", "s3d", "mvit_v2_s", "swin3d_t"} <= set(video)
    from collage_tvm.tools.suites import (TORCH_SUITES, torchvision_segmentation_model,
                                          torchvision_video_model)

    assert TORCH_SUITES["torchvision-video"][0]() == video
    model, (x,) = torchvision_segmentation_model("fcn_resnet50")
    with torch.no_grad():  # the dict's "out" map, at the input's size
        assert x.shape == (1, 3, 64, 64) and model(x).shape == (1, 21, 64, 64)
    _, (clip,) = torchvision_video_model("mvit_v2_s")  # MViT: its embeddings' own size
    assert clip.shape == (1, 3, 16, 224, 224)
    with pytest.raises(ValueError, match="unknown torchvision video model 'resnet50'"):
        torchvision_video_model("resnet50")


SAMPLES = [("torchvision", "squeezenet1_1"), ("torchvision", "shufflenet_v2_x0_5"),
           ("torchvision-segmentation", "lraspp_mobilenet_v3_large"),
           ("torchvision-video", "r3d_18"),
           ("timm", "lcnet_050"), ("timm", "levit_128s")]


# The sample's three slowest to import and compile (30-70 s each on 2 cores) run with the
# slow tests (`make test-slow`); the default run keeps a torchvision and a timm model.
SLOW_SAMPLES = ("lraspp_mobilenet_v3_large", "r3d_18", "levit_128s")


@pytest.mark.parametrize("suite,name", [pytest.param(*s, marks=pytest.mark.slow)
                                        if s[1] in SLOW_SAMPLES else s for s in SAMPLES])
def test_torchvision_and_timm_sample_places_every_node_on_tvm_and_matches_torch(
        suite, name, tmp_path):
    """The fast check (no measuring): import, candidates, every node placed on TVM,
    partition, compile, run. ShuffleNet: TVM alone cannot compile it (static slices)."""
    pytest.importorskip(suite.split("-")[0])
    import onnx

    from collage_tvm.tools.suites import (TORCH_SUITES, WEAK_SIGNAL, Case, checked_model,
                                          export_onnx)

    # (ShuffleNet's output hardly moves with its input at its own initialisation: checked
    # with He-normal weights, as the suite does)
    model, inputs, expected, signal, _ = checked_model(TORCH_SUITES[suite][1], name)
    assert signal > WEAK_SIGNAL
    path = export_onnx(model, inputs, str(tmp_path / f"{name}.onnx"))
    scale = float(np.abs(expected[0]).max())  # timm's random-weight outputs: ~1e-8
    case = Case(name, onnx.load(path), [i.numpy() for i in inputs], expected, rtol=1e-3,
                atol=1e-3 * scale, floors=False)
    r = tvm_only_check(case, make_target("llvm"))
    assert scale > 0 and r["collage"] == "match" and r["uncovered"] == [], r


@pytest.mark.slow
@pytest.mark.parametrize("suite,name", SAMPLES)
def test_torchvision_and_timm_sample_builds_and_matches_torch(suite, name, tmp_path):
    pytest.importorskip(suite.split("-")[0])
    row = _suite_row(suite, name, ["tvm", "onnxruntime"], tmp_path)
    assert row["status"] == "built" and row["match"], row
    assert row["shipped"] in ("collage", row["best"][0])


@pytest.mark.slow
@pytest.mark.parametrize("name", _torchvision_names())
def test_torchvision_suite_builds_on_every_cpu_backend_and_matches_torch(name, tmp_path):
    row = _suite_row("torchvision", name, _available_backends(), tmp_path)
    assert row["status"] == "built" and row["match"], row


@pytest.mark.slow
@pytest.mark.parametrize("suite,name", [(f"torchvision-{task}", name)
                                        for task in ("segmentation", "video")
                                        for name in _torchvision_names(task)])
def test_torchvision_segmentation_and_video_build_on_every_cpu_backend_and_match_torch(
        suite, name, tmp_path):
    row = _suite_row(suite, name, _available_backends(), tmp_path)
    assert row["status"] == "built" and row["match"], row


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(__import__("collage_tvm.tools.suites",
                                                   fromlist=["TIMM"]).TIMM))
def test_timm_suite_builds_on_every_cpu_backend_and_matches_torch(name, tmp_path):
    pytest.importorskip("timm")
    row = _suite_row("timm", name, _available_backends(), tmp_path)
    assert row["status"] == "built" and row["match"], row


class ChunkCNN(nn.Module):
    """ShuffleNet's unit: x.chunk(2, dim=1), one half through convolutions, concatenated,
    channels shuffled. The TorchScript exporter writes the chunk as a Slice with bounds
    computed from Shape: TVM's importer gives it an unknown output shape."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(8, 8, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        a, b = self.c1(x).chunk(2, dim=1)
        y = torch.cat([a, torch.relu(self.c2(b))], dim=1)
        return y.reshape(1, 2, 4, 8, 8).transpose(1, 2).reshape(1, 8, 8, 8)


def test_slices_with_bounds_computed_from_constants_become_static(tmp_path):
    import onnx
    from tvm.relax.frontend.onnx import from_onnx

    from collage_tvm.frontend.load import normalize_for_collage

    torch.manual_seed(0)
    m, x = ChunkCNN().eval(), torch.randn(1, 8, 8, 8)
    path = str(tmp_path / "m.onnx")
    torch.onnx.export(m, (x,), path, dynamo=False, opset_version=17)
    imported = from_onnx(onnx.load(path))
    assert "dynamic_strided_slice" in imported.script()  # what the importer gives
    mod = normalize_for_collage(imported)
    assert "dynamic_strided_slice" not in mod.script()
    assert all(isinstance(b.var.ty.shape, relax.ShapeExpr)
               for b in mod["main"].body.blocks[0].bindings
               if isinstance(b.var.ty, relax.TensorType))
    res = collage_tvm.optimize(path, "llvm", ["tvm", "onnxruntime"], db=str(tmp_path / "c.db"),
                               isolate=False, progress=False, calibrate_rounds=0, refine_rounds=0,
                               graph_level=False, compare=False)
    got = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x.numpy()))
    with torch.no_grad():
        assert matches([got.numpy()], [m(x).numpy()], 1e-3, 1e-4)


def test_slices_with_bounds_from_an_input_stay_dynamic():
    from collage_tvm.frontend.static_slices import static_slices

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    begin = relax.Var("begin", relax.TensorType((2,), "int64"))
    with bb.function("main", [x, begin]):
        with bb.dataflow():
            end = bb.emit(relax.const(np.array([4, 8]), "int64"))
            out = bb.emit_output(relax.op.dynamic_strided_slice(
                x, begin, end, relax.const(np.array([1, 1]), "int64")))
        bb.emit_func_output(out)
    mod = bb.get()
    assert "dynamic_strided_slice" in static_slices(mod).script()


def test_a_model_the_torchscript_exporter_cannot_write_goes_through_the_dynamo_one(tmp_path):
    pytest.importorskip("onnxscript")  # the test extra (make setup installs it)
    from collage_tvm.tools.suites import torch_model_check

    def make(name):  # adaptive pooling 4x4 -> 3x3: "output size not a factor of input size"
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.AdaptiveAvgPool2d(3), nn.Flatten())
        return m.eval(), (torch.randn(1, 3, 4, 4),)

    row = torch_model_check(make, "pool", ["tvm"], str(tmp_path / "c.db"), str(tmp_path))
    assert row["status"] == "built" and row["match"] and row["exporter"] == "dynamo", row


def test_transformers_vision_models_construct_beside_the_installed_torchvision():
    # transformers imports torchvision where it is installed; the suite makes that import work
    pytest.importorskip("transformers")
    from collage_tvm.tools.suites import transformers_model

    for name in ("vit", "whisper_encoder"):
        model, inputs = transformers_model(name)
        with torch.no_grad():
            assert model(*inputs).ndim == 3


def test_a_suite_run_on_named_models_keeps_the_earlier_rows_of_the_others(tmp_path):
    from collage_tvm.tools import suites

    done = [{"model": "squeezenet1_1", "build": {"status": "built", "match": True}, "s": 1.0}]
    seen = []
    rows = suites.run("onnx-files", ["tvm"], str(tmp_path / "c.db"), str(tmp_path),
                      only=["test_AvgPool1d"], done=done, on_row=seen.append)
    assert [r["model"] for r in rows] == ["test_AvgPool1d", "squeezenet1_1"]
    assert seen and seen[-1] == rows


def test_suite_outputs_are_compared_relative_to_their_scale(tmp_path):
    from collage_tvm.tools.suites import torch_model_check

    def make(name):  # outputs of ~1e-9: any absolute tolerance would call anything a match
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
        with torch.no_grad():
            m[0].weight.mul_(1e-9)
            m[0].bias.zero_()
        return m.eval(), (torch.randn(1, 3, 6, 6),)

    row = torch_model_check(make, "tiny", ["tvm"], str(tmp_path / "c.db"), str(tmp_path))
    assert row["status"] == "built" and row["match"] and 0 < row["scale"] < 1e-7, row
    assert row["max_err"] < 1e-3 * row["scale"]


def test_the_suite_tolerance_follows_the_output_scale_both_ways():
    """Tiny outputs get a tiny atol (a fixed one would match anything); huge ones
    (inception_v3 with random batch-norm statistics reaches 1e9) a proportional one, so
    the float32 rounding of elements near zero passes and a wrong element does not."""
    from collage_tvm.check import compare_outputs
    from collage_tvm.tools.suites import scaled_atol

    assert scaled_atol(1e-4, 1.0) == 1e-4 and scaled_atol(1e-4, 0.0) == 1e-4
    assert scaled_atol(1e-4, 1e-9) == pytest.approx(1e-12)
    ref = np.array([1e9, 3.0, -2.0], "float32")
    rounding = ref + np.array([0.0, 3.5e3, -1.2e3], "float32")  # 3.5e-6 of the scale
    wrong = ref + np.array([0.0, 3e6, 0.0], "float32")  # 3e-3 of the scale
    atol = scaled_atol(1e-4, float(np.abs(ref).max()))
    assert compare_outputs([rounding], [ref], 1e-3, atol)[0]
    assert not compare_outputs([wrong], [ref], 1e-3, atol)[0]


def _tiny_swin():
    """torchvision's Swin at a tiny size: its window partition, shift mask and padding are
    computed from ``Shape`` at run time in the TorchScript export."""
    from collage_tvm.tools.suites import import_torchvision

    import_torchvision()
    from torchvision.models.swin_transformer import SwinTransformer

    torch.manual_seed(0)
    model = SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                            window_size=[3, 3], num_classes=10).eval()
    return model, (torch.randn(1, 3, 32, 32),)


def test_shape_computations_of_a_swin_export_fold_so_tvm_can_import_it(tmp_path):
    """TVM's ONNX importer rejected torchvision's swin_t (``Reshape expects the input tensor
    to have known shape``); with the shape computations folded it imports, every node has
    a TVM candidate and the outputs match PyTorch."""
    pytest.importorskip("torchvision")
    import onnx

    from collage_tvm.frontend.fold_shapes import fold_shapes
    from collage_tvm.tools.suites import Case, export_onnx

    model, inputs = _tiny_swin()
    with torch.no_grad():
        expected = [model(*inputs).numpy()]
    proto = onnx.load(export_onnx(model, inputs, str(tmp_path / "swin.onnx")))
    folded, n = fold_shapes(proto)
    ops = {node.op_type for node in folded.graph.node}
    assert n > 100 and not ops & {"Shape", "Range", "ConstantOfShape", "ScatterND"}, ops
    assert "Shape" in {node.op_type for node in proto.graph.node}  # the caller's is untouched
    case = Case("swin", proto, [i.numpy() for i in inputs], expected, rtol=1e-3, atol=1e-5,
                floors=False)
    r = tvm_only_check(case, make_target("llvm"))
    assert r["collage"] == "match" and r["uncovered"] == [], r


def test_a_shape_of_a_dynamic_input_is_not_folded_until_its_shape_is_given():
    import onnx
    from onnx import TensorProto, helper

    from collage_tvm.frontend.fold_shapes import fold_shapes

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["b"], axis=0),
             helper.make_node("Unsqueeze", ["b", "zero1"], ["b1"]),
             helper.make_node("Concat", ["b1", "m1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    inits = [helper.make_tensor("zero", TensorProto.INT64, [], [0]),
             helper.make_tensor("zero1", TensorProto.INT64, [1], [0]),
             helper.make_tensor("m1", TensorProto.INT64, [1], [-1])]
    proto = helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    same, n = fold_shapes(proto)
    assert n == 0 and same is proto
    static, n = fold_shapes(proto, {"x": (2, 6)})
    assert n == 4 and [node.op_type for node in static.graph.node] == ["Reshape"]
    shape = next(i for i in static.graph.initializer if i.name == "shape")
    assert onnx.numpy_helper.to_array(shape).tolist() == [2, -1]


def test_a_resumed_suite_run_runs_named_models_again_with_again(tmp_path):
    import json

    from collage_tvm.cli import main

    out, table = tmp_path / "out", tmp_path / "out" / "suite_onnx-files.json"
    args = ["--backends", "tvm", "--out", str(out), "--db", str(tmp_path / "c.db")]
    assert main(["bench", "--suite", "onnx-files", "test_AvgPool1d", "test_AvgPool2d", *args]) == 0
    doc = json.loads(table.read_text())
    for r in doc["rows"]:
        r["marker"] = "earlier run"
    table.write_text(json.dumps(doc))
    assert main(["bench", "--suite", "onnx-files", "test_AvgPool1d", "--resume", "--again",
                 *args]) == 0
    rows = {r["model"]: r for r in json.loads(table.read_text())["rows"]}
    assert "marker" not in rows["test_AvgPool1d"] and "marker" in rows["test_AvgPool2d"]


def test_a_suite_under_a_reduced_budget_writes_its_own_file_and_refuses_a_bad_one(tmp_path,
                                                                                   capsys):
    import json

    from collage_tvm.cli import main

    out = tmp_path / "out"
    args = ["--backends", "tvm", "--out", str(out), "--db", str(tmp_path / "c.db")]
    assert main(["bench", "--suite", "onnx-files", "test_AvgPool1d", "--accuracy", "banana",
                 *args]) == 2
    assert "accuracy 'banana'" in capsys.readouterr().err and not out.exists()
    assert main(["bench", "--suite", "onnx-files", "test_AvgPool1d", "--accuracy", "bf16",
                 *args]) == 0
    doc = json.loads((out / "suite_onnx-files_bf16.json").read_text())
    assert doc["accuracy"] == "bf16" and not (out / "suite_onnx-files.json").exists()


class _RelPad(nn.Module):
    """timm's botnet relative logits: F.pad of a (B, W, 2W - 1) tensor, flattened, padded
    again, reshaped. The TorchScript exporter writes the pads as a computation over
    constants (ConstantOfShape -> Concat -> Reshape -> Slice -> Transpose -> Reshape ->
    Cast), with no Shape op anywhere; TVM's importer rejected it: "Dynamic pads"."""

    def forward(self, x):
        b, w, _ = x.shape
        x = torch.nn.functional.pad(x, [0, 1]).flatten(1)
        x = torch.nn.functional.pad(x, [0, w - 1])
        return torch.relu(x.reshape(b, w + 1, 2 * w - 1)[:, :w, w - 1:])


def test_pads_computed_from_constants_fold_so_tvm_can_import_them(tmp_path):
    import onnx

    from collage_tvm.frontend.fold_shapes import fold_shapes
    from collage_tvm.tools.suites import Case, export_onnx

    model, x = _RelPad().eval(), torch.randn(2, 5, 9)
    expected = [model(x).numpy()]
    proto = onnx.load(export_onnx(model, (x,), str(tmp_path / "relpad.onnx")))
    assert "Shape" not in {n.op_type for n in proto.graph.node}
    folded, n = fold_shapes(proto)
    inits = {i.name for i in folded.graph.initializer}
    pads = [node.input[1] for node in folded.graph.node if node.op_type == "Pad"]
    assert n > 0 and pads and all(p in inits for p in pads)
    case = Case("relpad", proto, [x.numpy()], expected, rtol=1e-5, atol=1e-6, floors=False)
    r = tvm_only_check(case, make_target("llvm"))
    assert r["collage"] == "match" and r["uncovered"] == [], r


def test_a_suite_model_with_a_zero_initialised_head_gets_random_weights():
    # timm's ResMLP starts with a zero classifier head: its output would be zero for any
    # input, and any build would "match". The suite draws such weights at random.
    from collage_tvm.tools.suites import no_zero_weights

    head = nn.Linear(8, 4)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model = no_zero_weights(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), head))
    assert head.weight.abs().max() > 0 and not head.bias.any()  # biases stay as they were
    assert model(torch.randn(2, 8)).abs().max() > 0


def test_an_import_error_names_the_onnx_node_it_stopped_at():
    """TVM's importer often does not say which operator it is about ("TopK k must be a
    constant"); Collage's error names the node and its type."""
    from onnx import TensorProto, helper

    from collage_tvm.frontend import ModelError, load_model

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])
    k = helper.make_tensor_value_info("k", TensorProto.INT64, [1])
    vals = helper.make_tensor_value_info("v", TensorProto.FLOAT, [1, None])
    idx = helper.make_tensor_value_info("i", TensorProto.INT64, [1, None])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="act"),
         helper.make_node("TopK", ["r", "k"], ["v", "i"], name="my_topk")],
        "g", [x, k], [vals, idx])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelError, match=r"at node 'my_topk' \(TopK\): "):
        load_model(model)


def test_an_operator_no_backend_can_run_is_one_clear_error_naming_it_and_its_dtype(tmp_path):
    """Integer Pow: TVM cannot compile it ("power only applies to float"; constant folding
    failed on it first) and the graph libraries' exporter writes float arithmetic only.
    Collage says so in one error naming the operator and the dtype."""
    from collage_tvm.build import UnsupportedOperator

    case = next(c for c in onnx_cases("node") if c.name == "test_pow_types_int32_int32")
    with pytest.raises(UnsupportedOperator, match=r"relax\.power -> int32: TVM fails on it"):
        collage_tvm.optimize(case.model, "llvm", ["tvm", "onnxruntime"],
                             db=str(tmp_path / "c.db"), isolate=False, progress=False,
                             graph_level=False, compare=False)


def test_where_tvm_alone_cannot_build_a_whole_model_library_build_is_the_reference():
    import importlib

    from collage_tvm.placement import Candidate

    from collage_tvm.check.contender import from_records
    from collage_tvm.check.reference import reference

    whole = [Candidate("onnxruntime", frozenset([0, 1]))]
    builds = {"collage": whole, "tvm-only": [], "onnxruntime": whole,
              "dnnl+tvm": [Candidate("dnnl", frozenset([0])), Candidate("tvm", frozenset([1]))]}
    failed = {"ms": math.inf, "match": False, "error": "power only applies to float"}
    def ref(results):
        return reference(from_records(results), builds)

    assert ref({"tvm-only": failed, "onnxruntime": {"ms": 1.0}}) == "onnxruntime"
    assert ref({"tvm-only": {"ms": 2.0}, "onnxruntime": {"ms": 1.0}}) == "tvm-only"
    assert ref({"tvm-only": failed, "onnxruntime": dict(failed), "dnnl+tvm": {"ms": 3.0}}) \
        == "dnnl+tvm"
    with pytest.raises(RuntimeError, match="TVM alone cannot build this model"):
        ref({"tvm-only": failed, "onnxruntime": dict(failed), "dnnl+tvm": dict(failed)})


def test_a_suite_row_says_when_the_output_hardly_depends_on_the_input():
    from collage_tvm.tools.suites import WEAK_SIGNAL, _build_cell, input_signal

    dead = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).eval()
    with torch.no_grad():
        dead[0].bias.fill_(-100.0)  # every activation zero: the output is the last bias
    live = nn.Sequential(nn.Linear(8, 4)).eval()
    x = (torch.randn(2, 8),)
    with torch.no_grad():
        signals = {m: input_signal(m, x, [m(*x).numpy()]) for m in (dead, live)}
    assert signals[dead] < WEAK_SIGNAL < signals[live]
    row = {"status": "built", "match": True, "max_err": 0.0, "scale": 1.0, "search_s": 1.0,
           "collage_ms": 1.0, "best": None, "signal": signals[dead]}
    assert "weak" in _build_cell(row)[1]
    assert _build_cell({**row, "signal": signals[live]})[1] == "yes"

    class Nonzero(nn.Module):  # an output whose shape follows the input's values
        def forward(self, x):
            return torch.nonzero(x > 0)

    x = (torch.ones(16),)  # 16 rows; the redrawn input (seeded) has fewer positives
    with torch.no_grad():
        assert input_signal(Nonzero(), x, [Nonzero()(*x).numpy()]) == float("inf")


def test_a_model_whose_activations_die_out_is_checked_with_weights_that_keep_them(tmp_path):
    """torchvision's S3D and DeepLabV3-MobileNetV3 at their own random initialisation: the
    output does not move with the input; the suite draws He-normal weights instead."""
    from collage_tvm.tools.suites import WEAK_SIGNAL, torch_model_check

    def make(_name):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
        with torch.no_grad():
            m[0].weight.mul_(1e-9)  # a stand-in for activations that vanished with depth
        return m, (torch.randn(1, 3, 8, 8),)

    row = torch_model_check(make, "dying", ["tvm"], str(tmp_path / "c.db"), str(tmp_path))
    assert row["weights"].startswith("He-normal") and row["signal"] > WEAK_SIGNAL, row
    assert row["status"] == "built" and row["match"], row


def _loop_onnx(path, trips: int | None = 3):
    """x (4,) -> a Loop of ``trips`` iterations collecting relu(x) + i as its scan output:
    TVM's importer lacks Loop, and shape inference leaves the output's first dimension
    unknown (the trip count is a constant only at run time). ``trips`` None: 10 x the
    largest |x|, a shape that follows the input's values."""
    import onnx
    from onnx import TensorProto, helper

    from_input = [helper.make_node("Abs", ["x"], ["ax"]),
                  helper.make_node("ReduceMax", ["ax"], ["mx"], keepdims=0),
                  helper.make_node("Mul", ["mx", "ten"], ["m10"]),
                  helper.make_node("Cast", ["m10"], ["trips"], to=TensorProto.INT64)]

    body = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["i_f"], to=TensorProto.FLOAT),
         helper.make_node("Relu", ["x"], ["r"]),
         helper.make_node("Add", ["r", "i_f"], ["scan"]),
         helper.make_node("Identity", ["cond"], ["cond_out"])],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("scan", TensorProto.FLOAT, [4])])
    consts = ([helper.make_tensor("ten", TensorProto.FLOAT, [], [10.0])] if trips is None
              else [helper.make_tensor("trips", TensorProto.INT64, [], [trips])])
    graph = helper.make_graph(
        (from_input if trips is None else [])
        + [helper.make_node("Loop", ["trips", ""], ["out"], body=body)],
        "loop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], consts)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                                ir_version=9), path)


def test_a_whole_model_output_shape_inference_cannot_see_is_found_by_running_it(tmp_path):
    """MViT v2's ONNX has 51 Loops: the whole-model fallback could not type its output."""
    path = str(tmp_path / "loop.onnx")
    _loop_onnx(path)
    res = collage_tvm.optimize(path, "llvm", ["tvm", "onnxruntime"],
                               db=str(tmp_path / "c.db"), progress=False,
                               graph_level=False, compare=False)
    assert res.report.whole_model["backend"] == "onnxruntime"
    assert "Loop" in res.report.whole_model["why"]
    x = np.array([-1.0, 0.5, 2.0, -3.0], "float32")
    got = relax.VirtualMachine(res.executable, tvm.cpu())["main"](tvm.runtime.tensor(x))
    expected = np.stack([np.maximum(x, 0) + i for i in range(3)])
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)


def test_a_whole_model_output_whose_shape_follows_the_input_is_a_clear_error(tmp_path):
    from collage_tvm.frontend.load import ModelError

    path = str(tmp_path / "loop.onnx")
    _loop_onnx(path, trips=None)
    with pytest.raises(ModelError, match="Loop.*dynamic dimension.*follows the input's values"):
        collage_tvm.optimize(path, "llvm", ["tvm", "onnxruntime"], db=str(tmp_path / "c.db"),
                             progress=False, graph_level=False, compare=False)


def test_a_whole_model_onnxruntime_fails_to_run_is_a_clear_error(tmp_path, monkeypatch):
    """MViT v2's TorchScript export: onnxruntime loads it but fails in a Loop."""
    import onnxruntime as ort

    from collage_tvm.frontend.load import ModelError

    class Failing:
        def __init__(self, *args, **kwargs):
            pass

        def run(self, *args):
            raise RuntimeError("Loop subgraph input 0 has unknown shape: 2279")

    monkeypatch.setattr(ort, "InferenceSession", Failing)
    path = str(tmp_path / "loop.onnx")
    _loop_onnx(path)
    with pytest.raises(ModelError, match="onnxruntime failed to run it: RuntimeError: Loop "
                                         "subgraph input 0 has unknown shape"):
        collage_tvm.optimize(path, "llvm", ["tvm", "onnxruntime"], db=str(tmp_path / "c.db"),
                             progress=False, graph_level=False, compare=False)
