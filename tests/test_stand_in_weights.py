"""Candidates reach the measuring process without their large weights (random ones of the
same shapes and scales stand in): a model's gigabytes are not copied per candidate."""
import math

import numpy as np
import tvm
from tvm import relax

from collage_tvm.graph import DataflowGraph
from collage_tvm.graph.subgraph import (PART_ATTR, STAND_INS_ATTR, extract_function,
                                        function_key, with_stand_ins, without_weights)
from collage_tvm.byoc import candidate_vm
from collage_tvm.measure.db import CostDB
from collage_tvm.measure.measurer import Measurer
from collage_tvm.measure.worker import Worker
from collage_tvm.candidates import generate_candidates
from collage_tvm.registry import get_backend
from collage_tvm.target import make_target

_RNG = np.random.default_rng(0)


def _graph():
    """matmul by a 256x512 weight (131072 floats: lifted), + a 512 bias (kept), then a take
    by 70000 int64 indices (kept: integers are values, not weights)."""
    x = relax.Var("x", relax.TensorType((4, 256), "float32"))
    w = relax.const(_RNG.normal(0, 0.03, (256, 512)).astype("float32"))
    b = relax.const(_RNG.normal(0, 1, (512,)).astype("float32"))
    idx = relax.const(_RNG.integers(0, 2048, 70000).astype("int64"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            m = bb.emit(relax.op.matmul(x, w))
            a = bb.emit(relax.op.add(m, b))
            flat = bb.emit(relax.op.reshape(a, (2048,)))
            out = bb.emit_output(relax.op.take(flat, idx, axis=0))
        bb.emit_func_output(out)
    return DataflowGraph(bb.get()["main"])


def _run(func, x):
    ex = tvm.compile(tvm.IRModule({"main": func}), "llvm")
    return relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x)).numpy()


def test_large_float_weights_travel_as_shapes_and_come_back_as_random_ones_of_their_scale():
    graph = _graph()
    func = extract_function(graph, frozenset(range(len(graph))))[0]
    light = without_weights(func)
    assert len(light.params) == len(func.params) + 1  # only the 256x512 weight left
    (scale,) = [float(s) for s in light.attrs[STAND_INS_ATTR]]
    assert abs(scale - 0.03) < 0.003
    full_json = tvm.ir.save_json(tvm.IRModule({"main": func}))
    light_json = tvm.ir.save_json(tvm.IRModule({"main": light}))
    assert len(full_json) - len(light_json) > 256 * 512 * 4  # base64 of the weight: gone
    back = with_stand_ins(tvm.ir.load_json(light_json)["main"])
    assert len(back.params) == len(func.params)
    assert STAND_INS_ATTR not in (back.attrs or {})
    assert function_key(back) == function_key(func)  # the same cost-DB entry
    x = _RNG.normal(0, 1, (4, 256)).astype("float32")
    real, standin = _run(func, x), _run(back, x)
    assert real.shape == standin.shape
    assert 0.5 < standin.std() / real.std() < 2  # same scale, other values
    assert not np.allclose(real, standin)
    # A function with no large float weight is sent as it is.
    small = extract_function(graph, frozenset([1]))[0]
    assert without_weights(small).same_as(small) and with_stand_ins(small).same_as(small)


def test_the_worker_times_a_candidate_whose_weights_it_never_received(tmp_path, monkeypatch):
    graph = _graph()
    tvm_b = get_backend("tvm")
    sent = []
    call = Worker.call

    def spy(self, what, entries, *rest, **kw):
        sent.extend(j for _, j, _ in entries)
        return call(self, what, entries, *rest, **kw)

    monkeypatch.setattr(Worker, "call", spy)
    m = Measurer(make_target("llvm"), CostDB(str(tmp_path / "c.db")), candidate_vm,
                 isolate=True, progress=False)
    try:
        cands = [c for c in generate_candidates(graph, [tvm_b])  # the take holds 560 KB of ints
                 if 0 in c.nodes and 3 not in c.nodes]
        costs = m.costs(graph, cands, {"tvm": tvm_b})
    finally:
        m.close()
    assert cands and all(math.isfinite(costs[c]) and costs[c] > 0 for c in cands)
    assert sent and max(map(len, sent)) < 256 * 512 * 4  # the weight's 512 KB stayed here
    assert all(PART_ATTR in j for j in sent)  # pieces of the model: timed as they run in place
