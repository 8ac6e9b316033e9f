"""A whole executable as one CUDA graph (``collage_tvm.measure.cuda_graph``, issue #19 part 3).

Without a GPU: what refuses a capture (TVM's own CUDA graphs, a library replaying its own
graph), that a CPU build runs as it is (with the reason), and that the timing loop times a
captured build's replays instead of the VM. On a GPU (``gpu`` marker): a build mixing
cuDNN, cuBLAS and TVM kernels captured, replayed on new inputs, unharmed by another build
using the device in between; the builds that must not be captured are not.
"""
import numpy as np
import tvm
from tvm import relax

from collage_tvm.graph import DataflowGraph
from collage_tvm.byoc import compile_placement
from collage_tvm.byoc.external import _release, register
from collage_tvm.measure.cuda_graph import Main, capture, captures_itself, flat_numpy, refusal
from collage_tvm.measure.timing import time_main
from collage_tvm.registry import get_backend
from collage_tvm.target import make_target

from test_gpu_backends import _cnn_and_mlp, _cuda_partition, gpu

RNG = np.random.default_rng(1)


def test_tvm_graphs_and_self_replaying_libraries_refuse_a_capture():
    plain = ["vm.builtin.check_tensor_info", "vm.builtin.alloc_storage", "fused_conv2d_add"]
    assert refusal(plain) is None
    why = refusal(plain + ["vm.builtin.cuda_graph.run_or_capture"])
    assert "RewriteCUDAGraph" in why

    def replaying(*args):
        return args[0]

    replaying.captures_itself = True
    own, other = register("collage.test.replaying", replaying), register("collage.test.plain",
                                                                          lambda *a: a[0])
    try:
        assert captures_itself(own) and not captures_itself(other)
        assert own in refusal(plain + [other, own]) and refusal(plain + [other]) is None
    finally:
        _release([own, other])
    assert not captures_itself(own)  # released: nothing left to ask


def _cpu_build():
    func = _cnn_and_mlp()
    g = DataflowGraph(func)
    from collage_tvm.placement import single_ops

    target = make_target("llvm")
    executable, _ = compile_placement(g, single_ops(g), {"tvm": get_backend("tvm")}, target)
    vm = relax.VirtualMachine(executable, tvm.cpu())
    x = tvm.runtime.tensor(RNG.standard_normal((1, 8, 8, 8)).astype("float32"))
    return vm, [x], target


def test_a_cpu_build_runs_as_it_is_and_says_why():
    vm, args, target = _cpu_build()
    main = capture(vm, args, target)
    assert not main.captured and "not a CUDA target" in main.why
    assert main.state is None  # nothing to report off the GPU
    assert capture(vm, args, target) is main  # kept on the VM
    want = flat_numpy(vm["main"](*args))
    for got in (flat_numpy(main.replay()), main.outputs(), flat_numpy(main(*args))):
        np.testing.assert_array_equal(got[0], want[0])


def test_the_public_capture_takes_a_target_by_name():
    import collage_tvm

    vm, args, _ = _cpu_build()
    main = collage_tvm.capture_cuda_graph(vm, args, "llvm")
    assert not main.captured and main.why == "not a CUDA target (llvm)"
    np.testing.assert_array_equal(main(*args).numpy(), vm["main"](*args).numpy())


def test_the_capture_can_be_switched_off(monkeypatch):
    from collage_tvm.measure.cuda_graph import SWITCH

    vm, args, _ = _cpu_build()
    monkeypatch.setenv(SWITCH, "0")
    main = capture(vm, args, make_target("cuda:sm_90"))  # no device touched: switched off
    assert not main.captured and SWITCH in main.why
    assert main.state == main.why  # on a GPU target the comparison says why


def test_time_main_times_the_replays_of_a_captured_build():
    vm, args, target = _cpu_build()

    class Replayed(Main):  # a stand-in for a capture: counts its replays
        def __init__(self):
            super().__init__(vm, args)
            self.captured, self.calls = True, 0

        def replay(self):
            self.calls += 1
            return vm["main"](*args)

    run = Replayed()
    ms, why, extra = time_main(vm, args, tvm.cpu(), target_ms=2.0, run=run)
    assert why is None and extra["cuda_graph"] is True and ms > 0
    assert run.calls == extra["repeats"] + 3  # three warm-up calls, then every timed one
    uncaptured = Main(vm, args, why="no")
    _, _, extra = time_main(vm, args, tvm.cpu(), target_ms=2.0, run=uncaptured)
    assert "cuda_graph" not in extra


def test_the_final_check_says_nothing_of_cuda_graphs_on_a_cpu():
    from collage_tvm.check.evaluate import evaluate
    from collage_tvm.placement import single_ops

    g = DataflowGraph(_cnn_and_mlp())
    target = make_target("llvm")
    executable, _ = compile_placement(g, single_ops(g), {"tvm": get_backend("tvm")}, target)
    r = evaluate(executable, g, target)
    assert r["cuda_graph"] is None and r["ms"] > 0


# ------------------------------------------------------------------ on a GPU

def _gpu_mixed_build():
    g, placement, _ = _cuda_partition()
    backends = {n: get_backend(n) for n in ("tvm", "cudnn", "cublas")}
    target = make_target("cuda")
    executable, _ = compile_placement(g, placement.groups, backends, target)
    return g, executable, target


@gpu
def test_a_mixed_cuda_build_is_captured_and_replays_on_new_inputs():
    g, executable, target = _gpu_mixed_build()
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(executable, dev)
    x1, x2 = (RNG.standard_normal((1, 8, 8, 8)).astype("float32") for _ in range(2))
    main = capture(vm, [tvm.runtime.tensor(x1, dev)], target)
    assert main.captured, main.why
    eager = relax.VirtualMachine(executable, dev)
    for x in (x2, x1, x2):
        want = eager["main"](tvm.runtime.tensor(x, dev)).numpy()
        got = main(tvm.runtime.tensor(x, dev)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@gpu
def test_another_build_on_the_device_does_not_share_a_captured_builds_memory():
    """TVM's pooled allocator would hand a captured build's freed buffers to the next VM;
    the capture holds them, so another build's outputs survive the captured one's replays."""
    g, executable, target = _gpu_mixed_build()
    dev = tvm.cuda(0)
    x = RNG.standard_normal((1, 8, 8, 8)).astype("float32")
    main = capture(relax.VirtualMachine(executable, dev), [tvm.runtime.tensor(x, dev)], target)
    assert main.captured, main.why
    other = relax.VirtualMachine(executable, dev)
    kept = [other["main"](tvm.runtime.tensor(x * k, dev)) for k in (1.0, 2.0, 3.0)]
    copies = [t.numpy().copy() for t in kept]
    for _ in range(5):
        main.replay()
    import torch

    torch.cuda.synchronize()
    for t, c in zip(kept, copies):
        np.testing.assert_array_equal(t.numpy(), c)


@gpu
def test_tvm_alone_keeps_its_own_cuda_graphs_and_the_final_check_reports_the_capture():
    from collage_tvm.check.evaluate import evaluate
    from collage_tvm.tuning.compile import compile_module

    g, executable, target = _gpu_mixed_build()
    mixed = evaluate(executable, g, target)
    assert mixed["cuda_graph"] is True
    alone = compile_module(tvm.IRModule({"main": g.func}), target)
    r = evaluate(alone, g, target)
    assert isinstance(r["cuda_graph"], str) and "RewriteCUDAGraph" in r["cuda_graph"]


def test_the_bench_table_says_which_builds_ran_as_one_cuda_graph():
    from collage_tvm.tools.bench import markdown

    machine = {"cpu": "x", "cores": 16, "gpu": "H100", "tvm": "0.27", "onnxruntime": "1",
               "torch": "2"}
    comp = {"collage": {"ms": 1.0, "match": True, "cuda_graph": True},
            "tvm-only": {"ms": 2.0, "match": True,
                         "cuda_graph": "TVM runs its own CUDA graphs in this build "
                                       "(RewriteCUDAGraph)"},
            "cudnn+tvm": {"ms": 3.0, "match": True}}
    text = markdown({"machine": machine, "models": [
        {"model": "m", "op-level": {"comparison": comp, "shipped": "collage", "times": {}}}]})
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert rows["| collage  (one CUDA graph)"].endswith("| yes |")
    assert "launch by launch: TVM runs its own" in next(r for r in rows if "tvm-only" in r)
    assert "| cudnn+tvm" in rows  # off the GPU (no entry): nothing said
