"""One measuring child per process (``measure.worker.shared_worker``, #35): the measurers
of one search, and of the searches after it, send their candidates to the same child
instead of each starting one (seconds a search), and none times what another built."""
import math
import os

from collage_tvm.candidates import generate_candidates
from collage_tvm.graph import DataflowGraph
from collage_tvm.measure.db import CostDB
from collage_tvm.measure.measurer import Measurer
from collage_tvm.measure.worker import shared_worker
from collage_tvm.registry import get_backend
from collage_tvm.target import make_target
from test_prebuild import _model


def _measurer(build_vm):
    return Measurer(make_target("llvm"), CostDB(None), build_vm, isolate=True, progress=False)


def _measure(m):
    graph = DataflowGraph(_model())
    backends = {"tvm": get_backend("tvm")}
    costs = m.costs(graph, generate_candidates(graph, backends.values()), backends)
    assert all(math.isfinite(v) and v > 0 for v in costs.values())
    return m._worker._proc.pid


def test_measurers_share_one_child_and_each_builds_its_own_candidates(tmp_path, monkeypatch):
    # The build function travels by reference: the child imports it from here.
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.abspath(__file__)))
    log = tmp_path / "builds.txt"
    monkeypatch.setenv("COLLAGE_TEST_BUILD_LOG", str(log))
    from _crashing_lowering import build_vm_logging

    first, second = _measurer(build_vm_logging), _measurer(build_vm_logging)
    try:
        pid = _measure(first)
        built = log.read_text().split()
        assert first.measured > 4 and len(built) >= first.measured and set(built) == {str(pid)}
        # The second measurer, the first still open: the same child, no start of seconds...
        assert _measure(second) == pid
        # ...which built every candidate again: nothing the first measurer left was timed.
        assert second.measured == first.measured
        assert len(log.read_text().split()) == 2 * len(built)
    finally:
        first.close()
        second.close()
    assert shared_worker().alive()  # the child outlives the measurers
    third = _measurer(build_vm_logging)
    try:
        assert _measure(third) == pid
    finally:
        third.close()
    assert len(log.read_text().split()) == 3 * len(built)


def test_a_changed_environment_gets_a_child_of_its_own(monkeypatch):
    w = shared_worker()
    assert shared_worker() is w
    monkeypatch.setenv("COLLAGE_TEST_SOMETHING", "1")  # a child started before cannot see it
    other = shared_worker()
    assert other is not w and not w.alive()


def test_a_closing_measurer_frees_the_library_callables_the_child_lowered_for_it(monkeypatch):
    """Each lowered library candidate holds the library's copy of its weights (a session):
    the shared child outlives the search, so a closing measurer's request empties that cache
    too, not only the built VMs (a ViT-L/32 search ran out of 24 GB with them kept)."""
    import pytest

    from collage_tvm.byoc import candidate_vm

    if not get_backend("onnxruntime").available()[0]:
        pytest.skip("no onnxruntime")
    monkeypatch.setenv("PYTHONPATH", os.path.dirname(os.path.abspath(__file__)))
    from _crashing_lowering import lowered_in_this_process

    m = _measurer(candidate_vm)

    def held():
        ms, why, _ = m._worker.call("run_callback", [], m.target_json, None,
                                    lowered_in_this_process, context=m._context())
        assert why is None, why
        return ms

    try:
        graph = DataflowGraph(_model())
        backends = {"tvm": get_backend("tvm"), "onnxruntime": get_backend("onnxruntime")}
        cands = [c for c in generate_candidates(graph, backends.values())
                 if c.backend == "onnxruntime"]
        costs = m.costs(graph, cands, backends)
        assert cands and all(math.isfinite(costs[c]) for c in cands)
        assert held() >= 1
    finally:
        m.close()
    assert held() == 0  # the same measurer's token: only the closing request emptied it
