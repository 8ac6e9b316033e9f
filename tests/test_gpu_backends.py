"""The GPU backends (cudnn, cublas, inductor, tensorrt) and the cuda target.

Without a GPU: which groups each GPU backend claims, the partitioned module for a cuda
target, what each lowering reads from a group (its plan) and refuses, the reasons a
backend gives for not running here, and TVM's own CUDA build (it compiles without a
device). With a GPU (``gpu`` marker, skipped with the reason elsewhere): each lowering's
numerics against torch on the device, and a whole build on ``cuda`` checked against the
TVM-only build. docs/GPU.md says how to run them on a CUDA 13 machine.
"""
import numpy as np
import pytest
import tvm
from tvm import relax

from collage_tvm.graph import DataflowGraph
from collage_tvm.graph.subgraph import extract_function
from collage_tvm.byoc import partition
from collage_tvm.candidates import generate_candidates
from collage_tvm.placer.op_level import place
from collage_tvm.registry import get_backend

from collage_tvm.backends._cuda import torch_cuda
from collage_tvm.backends._epilogue import analyse
from collage_tvm.backends.cublas import CublasLowering
from collage_tvm.backends.cudnn import CudnnLowering
from collage_tvm.backends.inductor import InductorLowering
from collage_tvm.check.contender import records

HAVE_GPU, NO_GPU_REASON = torch_cuda()


def gpu(test):
    """The ``gpu`` marker (``pytest -m gpu`` on a GPU machine), skipped with the reason here."""
    skip = pytest.mark.skipif(not HAVE_GPU, reason=f"needs a CUDA GPU: {NO_GPU_REASON}")
    return pytest.mark.gpu(skip(test))


RNG = np.random.default_rng(0)
op = relax.op


def _const(*shape):
    return relax.const(RNG.standard_normal(shape).astype("float32"))


def _cnn_and_mlp():
    """conv+bias+relu, conv+bias+residual+relu, an NHWC conv, a dense+bias+gelu(tanh), a
    dense+bias+gelu(erf), a batched matmul: what each GPU table should and should not claim."""
    x = relax.Var("x", relax.TensorType((1, 8, 8, 8), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(op.nn.conv2d(x, _const(8, 8, 3, 3), padding=[1, 1, 1, 1]))  # 0
            y = bb.emit(op.add(y, _const(1, 8, 1, 1)))                                 # 1
            y = bb.emit(op.nn.relu(y))                                                 # 2
            z = bb.emit(op.nn.conv2d(y, _const(8, 8, 1, 1)))                           # 3
            z = bb.emit(op.add(z, _const(1, 8, 1, 1)))                                 # 4
            z = bb.emit(op.add(z, y))                                                  # 5
            z = bb.emit(op.nn.relu(z))                                                 # 6
            t = bb.emit(op.permute_dims(z, [0, 2, 3, 1]))                              # 7 NHWC
            t = bb.emit(op.nn.conv2d(t, _const(8, 3, 3, 8), padding=[1, 1, 1, 1],
                                     data_layout="NHWC", kernel_layout="OHWI"))        # 8
            f = bb.emit(op.reshape(t, (8, 64)))                                        # 9
            d = bb.emit(op.matmul(f, _const(64, 32)))                                  # 10
            d = bb.emit(op.add(d, _const(32)))                                         # 11
            d = bb.emit(op.nn.gelu_tanh(d))                                            # 12
            e = bb.emit(op.matmul(d, _const(32, 32)))                                  # 13
            e = bb.emit(op.add(e, _const(32)))                                         # 14
            e = bb.emit(op.nn.gelu(e))                                                 # 15
            q = bb.emit(op.reshape(e, (2, 4, 32)))                                     # 16
            k = bb.emit(op.permute_dims(q, [0, 2, 1]))                                 # 17
            s = bb.emit(op.matmul(q, k))                                               # 18
            out = bb.emit_output(s)
        bb.emit_func_output(out)
    return bb.get()["main"]


def _claims(graph, name):
    return {c.nodes for c in generate_candidates(graph, [get_backend(name)])}


def test_cudnn_and_cublas_claim_their_epilogue_groups_and_nothing_they_cannot_run():
    g = DataflowGraph(_cnn_and_mlp())
    names = [n.op_name for n in g.nodes]
    assert names[8] == "relax.nn.conv2d" and names[18] == "relax.matmul"
    cudnn = _claims(g, "cudnn")
    assert frozenset({0, 1, 2}) in cudnn            # conv + bias + relu: one cuDNN kernel
    assert frozenset({3, 4, 5, 6}) in cudnn         # conv + bias + residual + relu
    assert not any(8 in c for c in cudnn)           # NHWC: not our cuDNN table's layout
    assert not any(i in c for c in cudnn for i in (10, 13, 18))  # no matmul on cuDNN
    cublas = _claims(g, "cublas")
    assert frozenset({10, 11, 12}) in cublas        # dense + bias + gelu(tanh): cuBLASLt epilogue
    assert frozenset({13, 14}) in cublas            # dense + bias, the erf gelu left out
    assert not any(15 in c for c in cublas)
    assert frozenset({18}) in cublas                # batched matmul of two run-time tensors
    assert not any(i in c for c in cublas for i in (0, 3, 8))
    trt = _claims(g, "tensorrt")                   # TVM's TensorRT table, as TVM ships it
    assert frozenset({8}) in trt and any(0 in c for c in trt)


def _cuda_partition():
    """The test model placed on a cuda target by a fake cost table (cuDNN and cuBLAS
    cheaper than TVM where they apply), partitioned."""
    func = _cnn_and_mlp()
    g = DataflowGraph(func)
    backends = {n: get_backend(n) for n in ("tvm", "cudnn", "cublas")}
    cands = generate_candidates(g, list(backends.values()))
    costs = {c: (1.0 if c.backend != "tvm" else 2.0) * len(c.nodes) ** 0.5 for c in cands}
    placement = place(g.producers, cands, costs, {})
    return g, placement, partition(g, placement.groups, backends)


def test_a_cuda_placement_partitions_into_cudnn_cublas_and_tvm_functions():
    g, placement, mod = _cuda_partition()
    used = {c.backend for c in placement.groups}
    assert used == {"tvm", "cudnn", "cublas"}
    external = {gv.name_hint: f for gv, f in mod.functions.items()
                if isinstance(f, relax.Function) and f.attrs is not None and "Codegen" in f.attrs}
    codegens = sorted(str(f.attrs["Codegen"]) for f in external.values())
    assert "collage_cudnn" in codegens and "collage_cublas" in codegens
    # every external function is one the lowering can read: its plan names the anchor
    for f in external.values():
        lib = str(f.attrs["Codegen"])[len("collage_"):]
        plan = analyse(f, lib, batched_matmul=lib == "cublas")
        assert plan.anchor == ("relax.matmul" if lib == "cublas" else "relax.nn.conv2d")
    assert sorted(i for c in placement.groups for i in c.nodes) == list(range(len(g)))


def test_tvm_alone_builds_the_model_for_cuda_without_a_device():
    from collage_tvm.target import make_target
    from collage_tvm.tuning.compile import compile_module

    mod = tvm.IRModule({"main": _cnn_and_mlp()})
    exe = compile_module(mod, make_target("cuda:sm_90"))  # dlight's default GPU schedules
    assert exe is not None


def test_lowerings_read_the_plan_and_refuse_what_their_library_cannot_run():
    g = DataflowGraph(_cnn_and_mlp())

    def group(nodes):
        return extract_function(g, frozenset(nodes), lift_constants=False)[0]

    conv = analyse(group({3, 4, 5, 6}), "cudnn")
    assert conv.anchor == "relax.nn.conv2d" and conv.unary == ("relu", "")
    assert conv.bias.shape == (8,) and isinstance(conv.residual, int)
    dense = analyse(group({10, 11, 12}), "cublas")
    assert dense.unary == ("gelu", "tanh") and dense.weight.shape == (32, 64)  # (N, K)
    assert analyse(group({18}), "cublas", batched_matmul=True).anchor == "relax.matmul"
    with pytest.raises(NotImplementedError, match="cublas: batched matmul"):
        analyse(group({18}), "cublas")  # a library that has no batched GEMM says so
    with pytest.raises(NotImplementedError, match="cublas: relax.nn.conv2d is not supported"):
        CublasLowering().lower(group({0, 1, 2}))
    with pytest.raises(NotImplementedError, match="cudnn: matmul is not supported"):
        CudnnLowering().lower(group({10, 11}))
    with pytest.raises(NotImplementedError, match=r"cublas: the activation \('gelu', 'none'\)"):
        CublasLowering().lower(group({13, 14, 15}))


def test_gpu_backends_say_why_they_do_not_run_here_and_a_cpu_target_skips_them():
    from collage_tvm.registry import resolve_backends
    from collage_tvm.target import make_target

    ok, why = get_backend("tensorrt").available()
    assert not ok and "TensorRT" in why
    with pytest.raises(NotImplementedError, match="tensorrt: TensorRT"):
        get_backend("tensorrt").get_lowering().lower(_cnn_and_mlp())
    _, skipped = resolve_backends(["cudnn", "cublas"], make_target("llvm"))
    assert skipped == {"cudnn": "runs on cuda, the target is cpu",
                       "cublas": "runs on cuda, the target is cpu"}
    if not HAVE_GPU:
        _, skipped = resolve_backends(["cudnn", "cublas", "dnnl"], make_target("cuda:sm_90"))
        assert skipped["cudnn"] == NO_GPU_REASON and skipped["cublas"] == NO_GPU_REASON
        assert skipped["dnnl"] == "runs on cpu, the target is cuda"
        with pytest.raises(ValueError, match="target 'cuda': .* 'cuda:sm_90'"):
            make_target("cuda")
    with pytest.raises(ValueError, match="sm_90"):
        make_target("cuda:ampere")


class _InductorOnCpu(InductorLowering):
    """The inductor lowering on the CPU: the same translation and torch.compile, no GPU."""

    device = "cpu"


def test_inductor_offers_regions_and_runs_a_subgraph_as_compiled_torch_ops():
    g = DataflowGraph(_cnn_and_mlp())
    claims = _claims(g, "inductor")
    # Regions only (each candidate is a torch.compile of seconds): no per-operator groups.
    assert frozenset({0, 1, 2}) not in claims and all(len(c) > 1 for c in claims)
    assert frozenset(range(9, 20)) in claims          # a region: one compiled call, 11 ops
    assert not any(8 in c for c in claims)            # the NHWC conv: the exporter refuses it
    ok, why = _InductorOnCpu().available()
    assert ok, why
    # Two subgraphs translated through ONNX into torch ops and compiled by inductor, against
    # TVM's build: conv+bias+relu, conv+bias+residual+relu, a transpose; then the dense
    # layers with both gelus and a batched matmul.
    for nodes, shape in ((range(8), (1, 8, 8, 8)), (range(9, 19), (1, 8, 8, 8))):
        func = extract_function(g, frozenset(nodes), lift_constants=False)[0]
        fn = _InductorOnCpu().lower(func)
        x = RNG.standard_normal(shape).astype("float32")
        got = fn(tvm.runtime.tensor(x))
        vm = relax.VirtualMachine(tvm.compile(tvm.IRModule({"main": func}), "llvm"), tvm.cpu())
        want = vm["main"](tvm.runtime.tensor(x))
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-4)
    with pytest.raises(TypeError, match="takes 1 tensors, got 2"):
        fn(tvm.runtime.tensor(x), tvm.runtime.tensor(x))
    # The whole model alone on the GPU runs as CUDA graphs (torch.compile's
    # "reduce-overhead"); a piece among other groups, or anything on the CPU, does not.
    assert InductorLowering().mode_for(sole=True) == "reduce-overhead"
    assert InductorLowering().mode_for(sole=False) == "default"
    assert _InductorOnCpu().mode_for(sole=True) == "default"
    # Without a GPU the backend says why, as cudnn and cublas do.
    if not HAVE_GPU:
        assert get_backend("inductor").available() == (False, NO_GPU_REASON)


def test_the_traced_graph_for_inductor_has_no_dead_scalar_reads():
    """onnx2torch's Reshape checks its shape input in Python (``any(shape == 0)``,
    ``torch.Size(shape)``); traced, those are ``.item()`` reads of constants whose results
    are unused, and each is a graph break for TorchDynamo (BERT-base's encoder, over a
    thousand of them, did not compile in 300 s on an H200). The trace drops them."""
    import onnx
    import torch
    from onnx import TensorProto, helper, numpy_helper

    from collage_tvm.backends import inductor as ind

    w = numpy_helper.from_array(RNG.standard_normal((8, 8)).astype("float32"), "w")
    shape = numpy_helper.from_array(np.array([0, 2, -1], dtype="int64"), "shape")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"]),
         helper.make_node("Reshape", ["y", "shape"], ["r"]),
         helper.make_node("Relu", ["r"], ["z"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 2, 4])], [w, shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    module = ind._onnx2torch()(model).eval()
    traced = ind._aten_graph(module, model, "cpu")
    targets = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert "aten.view.default" in targets or "aten._unsafe_view.default" in targets
    assert not any("_local_scalar_dense" in t for t in targets), targets
    x = torch.from_numpy(RNG.standard_normal((1, 8)).astype("float32"))
    with torch.no_grad():
        got, want = traced(x), module(x)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, want)


def test_bench_on_a_cuda_target_says_what_it_cannot_do(capsys):
    from collage_tvm.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "resnet_small", "--target", "cuda:sm_90", "--rewrite"])
    assert "--rewrite and --accuracy are CPU only for now" in capsys.readouterr().err
    if not HAVE_GPU:
        with pytest.raises(SystemExit):
            main(["bench", "resnet_small", "--target", "cuda"])
        assert "target 'cuda':" in capsys.readouterr().err


# ------------------------------------------------------------------ on a GPU

def _on_gpu(func, lowering, arrays):
    fn = lowering.lower(func)
    dev = tvm.cuda(0)
    out = fn(*[tvm.runtime.tensor(a, dev) for a in arrays])
    return out.numpy()


@gpu
def test_cudnn_numerics_on_the_gpu():
    import torch

    g = DataflowGraph(_cnn_and_mlp())
    func = extract_function(g, frozenset({3, 4, 5, 6}), lift_constants=False)[0]
    plan = analyse(func, "cudnn")
    x = RNG.standard_normal((1, 8, 8, 8)).astype("float32")
    got = _on_gpu(func, CudnnLowering(), [x, x] if plan.nparams == 2 else [x])
    t = torch.from_numpy
    want = torch.relu(torch.nn.functional.conv2d(t(x), t(plan.weight), t(plan.bias)) + t(x))
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)


@gpu
def test_cublas_numerics_on_the_gpu():
    import torch

    g = DataflowGraph(_cnn_and_mlp())
    func = extract_function(g, frozenset({10, 11, 12}), lift_constants=False)[0]
    plan = analyse(func, "cublas")
    x = RNG.standard_normal((8, 64)).astype("float32")
    got = _on_gpu(func, CublasLowering(), [x])
    t = torch.from_numpy
    want = torch.nn.functional.gelu(t(x) @ t(plan.weight).T + t(plan.bias), approximate="tanh")
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)


@gpu
def test_a_whole_build_on_cuda_matches_tvm_alone(tmp_path):
    import collage_tvm

    mod = tvm.IRModule({"main": _cnn_and_mlp()})
    res = collage_tvm.optimize(mod, "cuda", ["tvm", "cudnn", "cublas"], db=str(tmp_path / "c.db"),
                               progress=False, compare=True, graph_level=False)
    comp = records(res.report.comparison)
    assert "tvm-only" in comp and "collage" in comp
    assert all(r["match"] for r in comp.values()), comp


@gpu
def test_the_whole_model_on_inductor_replays_a_cuda_graph_and_hands_out_its_own_outputs():
    g = DataflowGraph(_cnn_and_mlp())
    nodes = frozenset(range(8))  # conv blocks: the exporter writes them all
    func = extract_function(g, nodes, lift_constants=False)[0]
    fn = InductorLowering().lower(func.with_attr("collage.sole_group", True))
    dev = tvm.cuda(0)
    x1, x2 = (RNG.standard_normal((1, 8, 8, 8)).astype("float32") for _ in range(2))
    first = fn(tvm.runtime.tensor(x1, dev))
    first_copy = first.numpy().copy()
    for _ in range(3):  # replays; the first result must not change under them
        second = fn(tvm.runtime.tensor(x2, dev))
    np.testing.assert_array_equal(first.numpy(), first_copy)
    vm = relax.VirtualMachine(tvm.compile(tvm.IRModule({"main": func}), "llvm"), tvm.cpu())
    for x, got in ((x1, first), (x2, second)):
        want = vm["main"](tvm.runtime.tensor(x)).numpy()
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=1e-4)


def test_a_cuda_build_without_external_calls_runs_as_cuda_graphs():
    from collage_tvm.target import make_target
    from collage_tvm.tuning.compile import CUDA_GRAPH, compile_module, cuda_graph_safe

    mod = tvm.IRModule({"main": _cnn_and_mlp()})
    assert cuda_graph_safe(mod)
    assert not cuda_graph_safe(mod.with_attr("collage.symbols", ["collage.cudnn.x.0"]))
    target = make_target("cuda:sm_90")
    with tvm.transform.PassContext(config={CUDA_GRAPH: True}), target:
        lowered = relax.get_default_pipeline(target)(mod)
    assert any("cuda_graph" in gv.name_hint for gv in lowered.get_global_vars())
    assert "cuda_graph" in compile_module(mod, target).as_text()  # compile_module sets it
    assert "cuda_graph" not in compile_module(mod, make_target("llvm")).as_text()


def test_the_gpu_machine_set_up_scripts_parse_and_refuse_a_wrong_step(tmp_path):
    import os
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for script in ("gpu_wheels.sh", "gpu_install.sh", "gpu_bench.sh"):
        path = os.path.join(root, "tools", script)
        assert subprocess.run(["bash", "-n", path]).returncode == 0, script
    bad = subprocess.run(["bash", os.path.join(root, "tools", "gpu_install.sh"), "part3"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "usage: tools/gpu_install.sh part1|part2" in bad.stderr
    bench = os.path.join(root, "tools", "gpu_bench.sh")
    assert subprocess.run(["bash", "-n", bench]).returncode == 0
    bad = subprocess.run(["bash", bench], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "usage: tools/gpu_bench.sh MODEL..." in bad.stderr
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    bad = subprocess.run(["bash", bench, "resnet50"], capture_output=True, text=True,
                         cwd=tmp_path, env=env)
    assert bad.returncode != 0 and "OUT is the folder" in bad.stderr


def test_an_uninstalled_checkout_finds_the_built_in_lowerings(tmp_path):
    # The GPU machine runs the source tree from PYTHONPATH, without installing it: the
    # built-in backends of collage_tvm/backends/ must resolve, patterns and lowerings.
    import os
    import site
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [root] + site.getsitepackages()
    code = ("import collage_tvm; from collage_tvm.registry import get_backend; "
            "print(get_backend('dnnl').available()[0], get_backend('cudnn').get_lowering().name)")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(paths)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "cudnn"]
