"""Build processes: TVM candidates built side by side before they are timed
(``Measurer.prebuild``), loaded by the measuring process instead of built there."""
import math
import os

import numpy as np
import pytest
import tvm
from tvm import relax

from collage_tvm.graph import DataflowGraph
from collage_tvm.measure.db import CostDB
from collage_tvm.measure.builds import default_build_jobs
from collage_tvm.measure.measurer import Measurer
from collage_tvm.candidates import generate_candidates
from collage_tvm.registry import get_backend
from collage_tvm.target import make_target


def _model() -> relax.Function:
    rng = np.random.default_rng(0)
    x = relax.Var("x", relax.TensorType((1, 8, 8, 8), "float32"))
    bb = relax.BlockBuilder()
    op = relax.op
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(op.nn.conv2d(x, relax.const(rng.standard_normal((8, 8, 3, 3), "float32")),
                                     padding=[1, 1, 1, 1]))
            y = bb.emit(op.add(y, relax.const(rng.standard_normal((1, 8, 1, 1), "float32"))))
            y = bb.emit(op.nn.relu(y))
            y = bb.emit(op.sigmoid(y))
            y = bb.emit(op.reshape(y, (8, 64)))
            y = bb.emit(op.matmul(y, relax.const(rng.standard_normal((64, 16), "float32"))))
            out = bb.emit_output(op.nn.softmax(y))
        bb.emit_func_output(out)
    return bb.get()["main"]


def _costs(build_vm, jobs, isolate=True):
    graph = DataflowGraph(_model())
    backends = {"tvm": get_backend("tvm")}
    cands = generate_candidates(graph, backends.values())
    m = Measurer(make_target("llvm"), CostDB(None), build_vm, isolate=isolate, progress=False,
                 build_jobs=jobs)
    try:
        costs = m.costs(graph, cands, backends)
        left = sorted(os.listdir(m._prebuilt)) if os.path.isdir(m._prebuilt) else []
        return costs, m, left
    finally:
        m.close()


def test_build_processes_build_what_the_measuring_process_then_loads():
    from collage_tvm.byoc import candidate_vm

    costs, m, left = _costs(candidate_vm, 2)
    assert m.prebuilt == m.measured > 4  # every TVM kernel came built
    assert left == []  # each export was loaded, and deleted once loaded
    assert not os.path.exists(m._prebuilt)  # the folder goes with the measurer
    assert m.seconds["parallel builds"] > 0
    assert all(math.isfinite(v) for v in costs.values())
    # In process too: the measurer points this process's runner at the folder, then back.
    costs_here, m_here, _ = _costs(candidate_vm, 2, isolate=False)
    assert m_here.prebuilt == m.prebuilt and set(costs_here) == set(costs)
    assert all(math.isfinite(v) for v in costs_here.values())
    from collage_tvm.measure import runner

    assert runner._prebuilt_root is None


def test_a_build_that_fails_in_a_build_process_is_built_again_where_it_is_timed(monkeypatch):
    # The build function travels by reference: the build processes import it from here.
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.abspath(__file__)))
    from _crashing_lowering import build_vm_refusing_sigmoid

    costs, m, left = _costs(build_vm_refusing_sigmoid, 2)
    assert 0 < m.prebuilt < m.measured  # the sigmoid candidates were not exported...
    assert all(math.isfinite(v) for v in costs.values())  # ...and measured all the same
    assert left == []


def test_build_jobs_default_to_the_cores_on_a_gpu_target_and_none_on_a_small_cpu(monkeypatch):
    from collage_tvm.measure import builds

    monkeypatch.setattr(builds, "host_cores", lambda: 2)
    assert default_build_jobs(make_target("llvm")) == 0
    assert default_build_jobs(make_target("cuda:sm_90")) == 2
    monkeypatch.setattr(builds, "host_cores", lambda: 64)
    assert default_build_jobs(make_target("llvm")) == 16


@pytest.mark.slow  # ~25 s of torch.compile on the CPU: `make test-slow`
def test_build_processes_fill_a_librarys_compile_cache_for_the_measuring_process(tmp_path,
                                                                                  monkeypatch):
    # torch.compile (inductor, here on the CPU) caches what it compiled on disk: a build
    # process compiles each region, and the measuring process (this one: isolate=False)
    # then finds every one of them in the cache instead of compiling it again.
    from torch._dynamo.utils import counters

    from collage_tvm.byoc import candidate_vm
    from collage_tvm.patterns.graph_rule import exportable
    from collage_tvm.registry import Backend, PatternRule

    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    lib = Backend(name="cpu_inductor", kind="graph", lowering="_cpu_inductor:InductorOnCpu",
                  rules=[PatternRule(valid_op=exportable, regions=1, regions_only=True)])
    ok, why = lib.available()
    assert ok, why
    graph = DataflowGraph(_model())
    cands = generate_candidates(graph, [lib])
    assert len(cands) >= 2 and all(c.label == "cpu_inductor.region" for c in cands)
    counters.clear()
    m = Measurer(make_target("llvm"), CostDB(None), candidate_vm, isolate=False, progress=False,
                 build_jobs=1)
    try:
        costs = m.costs(graph, cands, {"cpu_inductor": lib})
    finally:
        m.close()
    assert all(math.isfinite(v) for v in costs.values())
    assert m.prebuilt == m.measured == len({frozenset(c.nodes) for c in cands})
    assert counters["inductor"]["fxgraph_cache_miss"] == 0, dict(counters["inductor"])
    assert counters["inductor"]["fxgraph_cache_hit"] >= m.prebuilt


def test_a_worker_pool_answers_every_request_when_a_child_dies(monkeypatch):
    import json

    from collage_tvm.graph.subgraph import extract_function
    from collage_tvm.byoc import candidate_vm
    from collage_tvm.measure.worker import WorkerPool
    from collage_tvm.registry import Backend

    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.abspath(__file__)))
    graph = DataflowGraph(_model())
    tvm_b = get_backend("tvm")
    crash = Backend(name="crashlib", lowering="_crashing_lowering:SegfaultingLowering")
    funcs = [extract_function(graph, frozenset([i]))[0] for i in (0, 2, 3, 6)]
    request = lambda b, f: [(b, tvm.ir.save_json(tvm.IRModule({"main": f})), None)]  # noqa: E731
    requests = [request(tvm_b, funcs[0]), request(crash, funcs[1]), request(tvm_b, funcs[2]),
                request(crash, funcs[1]), request(tvm_b, funcs[3])]
    target_json = json.dumps(dict(make_target("llvm").export()), default=list)
    pool = WorkerPool(2)
    try:
        replies = dict(pool.map("measure_function", requests, target_json, candidate_vm))
    finally:
        pool.close()
    assert sorted(replies) == list(range(len(requests)))  # every request answered once
    for i in (1, 3):  # the segfaulting library: its child died, and a fresh one went on
        assert math.isinf(replies[i][0]) and "died" in replies[i][1], replies[i]
    assert all(math.isfinite(replies[i][0]) for i in (0, 2, 4)), replies
