"""Candidates holding large weights are timed with cold caches where the model's weights do
not fit the last-level cache (``Measurer.costs``): in a whole run their weights come from
memory on every inference, not from the cache a back-to-back timing loop keeps warm."""
import math

import numpy as np
import tvm
from tvm import relax

from collage_tvm.graph import DataflowGraph
from collage_tvm.byoc import candidate_vm
from collage_tvm.measure import measurer as measurer_mod
from collage_tvm.measure.db import CostDB
from collage_tvm.measure.keys import COLD_KEY
from collage_tvm.measure.measurer import Measurer
from collage_tvm.measure.timing import time_main, time_side_by_side
from collage_tvm.candidates import generate_candidates
from collage_tvm.registry import get_backend
from collage_tvm.target import cache_bytes, make_target

_RNG = np.random.default_rng(0)


def _graph():
    """A 256x512 matmul (512 KiB of weights) then cheap elementwise operators."""
    x = relax.Var("x", relax.TensorType((4, 256), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            m = bb.emit(relax.op.matmul(x, relax.const(_RNG.normal(0, 0.05, (256, 512))
                                                       .astype("float32"))))
            r = bb.emit(relax.op.nn.relu(m))
            out = bb.emit_output(relax.op.sigmoid(r))
        bb.emit_func_output(out)
    return DataflowGraph(bb.get()["main"])


def test_the_machine_says_its_cache_sizes():
    assert 64 << 10 <= cache_bytes(2) <= cache_bytes(3) <= 4 << 30


def _records(monkeypatch, llc: int, l2: int):
    monkeypatch.setattr(measurer_mod, "cache_bytes", {2: l2, 3: llc}.get)
    graph = _graph()
    backends = {"tvm": get_backend("tvm")}
    db = CostDB(None)
    m = Measurer(make_target("llvm"), db, candidate_vm, isolate=False, progress=False)
    try:
        costs = m.costs(graph, generate_candidates(graph, backends.values()), backends)
    finally:
        m.close()
    assert all(math.isfinite(v) for v in costs.values())
    return {r["key"]: r for r in db.rows() if r["backend"] == "tvm"}, m


def test_a_model_larger_than_the_cache_times_its_heavy_candidates_cold(monkeypatch):
    # As if the caches were tiny: the model's 512 KiB of weights pass half the last level.
    rows, m = _records(monkeypatch, llc=256 << 10, l2=64 << 10)
    assert m.flush_bytes == 512 << 10
    cold = {k: r for k, r in rows.items() if k.endswith(COLD_KEY)}
    warm = {k: r for k, r in rows.items() if not k.endswith(COLD_KEY)}
    assert cold and warm  # the matmul groups cold, the elementwise ones warm
    # A cold sample is one call after a flush; a warm one batches the calls of a ~1 ms sample.
    assert all(r["extra"]["repeats"] <= 20 for r in cold.values()), cold
    assert all(r["extra"]["repeats"] > 20 for r in warm.values()), warm


def test_a_model_the_cache_holds_is_timed_warm(monkeypatch):
    rows, _ = _records(monkeypatch, llc=32 << 20, l2=1 << 20)
    assert rows and not any(k.endswith(COLD_KEY) for k in rows)


def test_timing_loops_flush_the_caches_when_asked():
    graph = _graph()
    func = graph.func
    vm = candidate_vm(func, get_backend("tvm"), make_target("llvm"))
    args = [tvm.runtime.tensor(_RNG.standard_normal((4, 256)).astype("float32"))]
    ms, _, extra = time_main(vm, args, tvm.cpu(), flush_bytes=1 << 20)
    assert ms > 0 and extra["repeats"] <= 20
    both = time_side_by_side([(vm["main"], args), (vm["main"], args)], rounds=3,
                             flush_bytes=1 << 20)
    assert len(both) == 2 and all(t > 0 for t in both)


def test_a_flush_writes_every_byte_of_its_buffer_on_every_thread():
    """The flush before a cold sample is split over the cores; every part is written
    each time (a part left out would leave its share of the cache warm)."""
    from collage_tvm.measure.timing import _Flush

    for threads in (1, 2, 3):
        flush = _Flush((1 << 20) + 24, threads=threads)
        try:
            assert len(flush.parts) == threads
            buf = flush.buf
            flush()
            flush()
            assert buf.size == ((1 << 20) + 24) // 8 and (buf == 2).all()
        finally:
            flush.close()
        assert flush.buf is None  # its megabytes let go with it


def test_cold_samples_come_three_a_batch():
    """A cold sample's cost is its flush: batches of ``LONG_REPEAT`` however short the
    call, until two batches' medians agree."""
    from collage_tvm.measure.timing import LONG_REPEAT

    vm = _SleepVM(0.2)
    ms, _, extra = time_main(vm, [], None, flush_bytes=1 << 16)
    assert 0.15 < ms < 20 and extra["repeats"] % LONG_REPEAT == 0, (ms, extra)
    assert extra["repeats"] <= 4 * LONG_REPEAT
    assert not vm.batches  # timed here, one call after each flush, not by TVM's evaluator


def test_other_load_counts_other_processes_busy_beside_a_timing():
    """The final check's verdict is unsure when other processes kept the CPU busy
    (``OtherLoad``): a spinning process on every core is seen as most of the machine."""
    import os
    import subprocess
    import sys
    import time

    from collage_tvm.measure.timing import OtherLoad

    spin = "import time\nt = time.time()\nwhile time.time() - t < 20: pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)  # started and spinning
        with OtherLoad() as load:
            time.sleep(1.5)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert load.share > 0.5 and load.busy, load.share


class _SleepVM:
    """A stand-in for a built candidate: ``main`` sleeps ``ms``; ``time_evaluator`` times it
    as TVM's does (``repeat`` samples of ``number`` calls, seconds per call)."""

    def __init__(self, ms: float):
        import time

        self.sleep = lambda: time.sleep(ms / 1e3)
        self.batches = []

    def __getitem__(self, name):
        return lambda *args: self.sleep()

    def time_evaluator(self, name, dev, number=1, repeat=1):
        import time

        def run(*args):
            out = []
            for _ in range(repeat):
                t0 = time.perf_counter()
                for _ in range(number):
                    self.sleep()
                out.append((time.perf_counter() - t0) / number)
            self.batches.append(repeat)
            return type("R", (), {"results": out})()
        return run


def test_a_long_call_is_timed_in_short_batches():
    # A call past LONG_MS (a library region of a large model) needs fewer samples to settle
    # its median: batches of LONG_REPEAT; a short one keeps batches of 5.
    from collage_tvm.measure import timing

    long_vm, short_vm = _SleepVM(2 * timing.LONG_MS), _SleepVM(0.05)
    ms, _, extra = time_main(long_vm, [], tvm.cpu())
    assert ms >= 2 * timing.LONG_MS * 0.9 and long_vm.batches
    assert set(long_vm.batches) == {timing.LONG_REPEAT} and extra["repeats"] <= 4 * 3
    time_main(short_vm, [], tvm.cpu())
    assert set(short_vm.batches) == {5}
