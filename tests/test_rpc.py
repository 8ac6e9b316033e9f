"""Measuring on many devices through TVM's RPC tracker (#35): a tracker and two Collage
RPC servers on loopback (``collage_tvm.measure.remote``), real measurements.

- A search through the tracker spreads its candidates over both servers; every cost lands
  in the one cost DB; a search on this machine with the same DB (loopback: the same
  device) measures nothing and places the same.
- A server killed in the middle of a batch loses no candidate: its request goes to the
  other server.
- Clear errors: no server under the key, a tracker nobody answers, half the options.
"""
import json
import socket

import numpy as np
import onnx
import psutil
import pytest
from onnx import TensorProto, helper

import collage_tvm
from collage_tvm.measure.db import CostDB
from collage_tvm.options import SearchOptions
from collage_tvm.check.contender import records

pytest.importorskip("tornado")  # TVM's tracker needs it

remote = pytest.importorskip("collage_tvm.measure.remote")

KEY = "collage-test"
SEARCH = dict(backends=["tvm", "onnxruntime"], graph_level=False, compare=False,
              progress=False, calibrate_rounds=0, refine_rounds=0, switching=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tracker():
    from tvm.rpc.tracker import Tracker

    port = _free_port()
    tr = Tracker("127.0.0.1", port=port, port_end=port + 50, silent=True)
    yield tr
    tr.terminate()


def _servers(tracker, n: int) -> list:
    import time

    servers = [remote.start_server(f"127.0.0.1:{tracker.port}", KEY, host="127.0.0.1",
                                   port=_free_port(), port_end=65000) for _ in range(n)]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # registered with the tracker
        from tvm import rpc

        info = rpc.connect_tracker("127.0.0.1", tracker.port).summary()
        if sum(1 for s in info["server_info"] if s["key"].endswith(KEY)) >= n:
            break
        time.sleep(0.2)
    return servers


def _kill(server) -> None:
    """The server's process and every session process it forked, as if its machine died."""
    pid = server.proc._proc.pid
    procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _model(path) -> str:
    """conv -> relu -> conv -> add -> relu: a handful of candidates on each backend."""
    rng = np.random.default_rng(0)
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [8, 4, 3, 3],
                            rng.standard_normal(8 * 36).astype("float32") * 0.3)
    w2 = helper.make_tensor("w2", TensorProto.FLOAT, [8, 8, 1, 1],
                            rng.standard_normal(64).astype("float32") * 0.3)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"]),
             helper.make_node("Add", ["c2", "r1"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    graph = helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16, 16])],
        initializer=[w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, str(path))
    return str(path)


def test_a_search_through_the_tracker_spreads_candidates_and_places_as_locally(
        tracker, tmp_path):
    servers = _servers(tracker, 2)
    try:
        model = _model(tmp_path / "m.onnx")
        db = str(tmp_path / "c.db")
        res = collage_tvm.optimize(model, "llvm", db=db, rpc_tracker=f"127.0.0.1:{tracker.port}",
                                   rpc_key=KEY, placement_log=str(tmp_path / "p1.json"), **SEARCH)
        assert res.report.distinct_measured > 4
        with CostDB(db) as cdb:
            rows = cdb.rows()
        from collage_tvm.measure.keys import LEAN_KEY

        # (the lean search's verdict is a row of the DB too, but no measurement)
        served = [r["extra"].get("server") for r in rows
                  if r["extra"].get("label") and not r["key"].startswith(LEAN_KEY)]
        by_server = {s: served.count(s) for s in set(served)}
        assert None not in by_server, "a cost was measured here, not on a server"
        assert len(by_server) == 2, by_server  # both servers measured
        # This machine, same DB (loopback: the same device): nothing to measure, same answer.
        local = collage_tvm.optimize(model, "llvm", db=db, placement_log=str(tmp_path / "p2.json"),
                                     **SEARCH)
        assert local.report.distinct_measured == 0
        assert [(g.backend, g.nodes) for g in local.placement.groups] == \
            [(g.backend, g.nodes) for g in res.placement.groups]
    finally:
        for s in servers:
            s.terminate()


def test_a_server_killed_mid_batch_loses_no_candidate(tracker, tmp_path):
    from collage_tvm.candidates import generate_candidates
    from collage_tvm.frontend import load_model, normalize_for_collage
    from collage_tvm.graph import DataflowGraph
    from collage_tvm.graph.subgraph import extract_function
    from collage_tvm.byoc import candidate_vm
    from collage_tvm.measure.timers import function_json as _function_json
    from collage_tvm.measure.timers import target_json
    from collage_tvm.measure.worker import _message
    from collage_tvm.registry import get_backend
    from collage_tvm.target import make_target

    servers = _servers(tracker, 2)
    try:
        target = make_target("llvm")
        devices = remote.RemoteDevices(f"127.0.0.1:{tracker.port}", KEY, target_json(target))
        assert len(devices.sessions) == 2
        graph = DataflowGraph.from_module(normalize_for_collage(load_model(
            _model(tmp_path / "m.onnx"))))
        backends = {n: get_backend(n) for n in ("tvm", "onnxruntime")}
        cands = generate_candidates(graph, backends.values())
        messages = [_message("measure_function", [(backends[c.backend], _function_json(
            extract_function(graph, c.nodes)[0]), None)], devices.target_json, candidate_vm,
            (None, 0)) for c in cands]
        got = {}
        for i, reply in devices.map(messages):
            got[i] = reply
            if len(got) == 2:
                _kill(servers[0])
        assert sorted(got) == list(range(len(messages)))  # every candidate answered
        assert all(np.isfinite(r[0]) for r in got.values()), [r[1] for r in got.values()]
        assert len(devices.dropped) == 1 and len(devices.sessions) == 1
        assert devices.requeued >= 1  # what the dead server held went to the other
        assert {r[2]["server"] for r in got.values()} <= \
            {s.address for s in devices.sessions} | {devices.dropped[0][0]}
    finally:
        for s in servers:
            s.terminate()


def test_the_graph_level_evaluates_placements_on_a_server(tracker, tmp_path, monkeypatch):
    """``check.remote.remote_evaluator``: the graph level's placements built, checked against
    the seed's outputs and timed on a server; the model travels once per measuring process
    (the next request names it by its digest); a placement that cannot be built is
    invalid there with the reason."""
    import importlib

    from collage_tvm.check import graph_lib_groups
    from collage_tvm.frontend import load_model, normalize_for_collage
    from collage_tvm.graph import DataflowGraph
    from collage_tvm.measure.timers import target_json
    from collage_tvm.placement import Candidate, single_ops
    from collage_tvm.registry import get_backend
    from collage_tvm.target import make_target

    check_remote = importlib.import_module("collage_tvm.check.remote")
    sent: list = []
    message = check_remote._message

    def recording(what, entries, target_json, build_vm, extra):
        if extra[0] is check_remote.evaluate_here:
            sent.append(extra[2] is not None)  # the model itself went along
        return message(what, entries, target_json, build_vm, extra)

    monkeypatch.setattr(check_remote, "_message", recording)
    servers = _servers(tracker, 1)
    try:
        graph = DataflowGraph.from_module(normalize_for_collage(load_model(
            _model(tmp_path / "m.onnx"))))
        backends = {n: get_backend(n) for n in ("tvm", "onnxruntime")}
        seed = single_ops(graph)
        target = make_target("llvm")
        devices = remote.RemoteDevices(f"127.0.0.1:{tracker.port}", KEY, target_json(target))
        evaluate = check_remote.remote_evaluator(devices, graph, backends, target, None, seed)
        ms_seed, why_seed = evaluate(seed)
        ms_ort, why_ort = evaluate(graph_lib_groups(graph, backends["onnxruntime"]))
        # a group whose nodes are not convex (the first and last only): no build
        broken = [Candidate("onnxruntime", frozenset({0, len(graph) - 1}))] + [
            Candidate("tvm", frozenset({i})) for i in range(1, len(graph) - 1)]
        ms_bad, why_bad = evaluate(broken)
        assert why_seed is None and why_ort is None and 0 < ms_seed < 1e3 and 0 < ms_ort < 1e3
        assert ms_bad == float("inf") and why_bad
        assert sent == [False, True, False, False], sent  # the model sent once, when asked
    finally:
        for s in servers:
            s.terminate()


def test_clear_errors(tracker):
    with pytest.raises(remote.RemoteError, match="no server is registered under the key"):
        remote.RemoteDevices(f"127.0.0.1:{tracker.port}", "nobody-here", "{}")
    with pytest.raises(remote.RemoteError, match="cannot reach the RPC tracker"):
        remote.RemoteDevices(f"127.0.0.1:{_free_port()}", KEY, "{}")
    with pytest.raises(ValueError, match="HOST:PORT"):
        remote.parse_address("localhost")
    with pytest.raises(ValueError, match="needs both rpc_tracker"):
        SearchOptions(rpc_tracker="127.0.0.1:9190")


class _FakeSession:
    """A session answering at once, or one whose server dies on its first request after
    ``dies_after`` seconds (a stand-in for the network: the spreading logic alone)."""

    def __init__(self, address, dies_after=None, takes=0.0):
        import pickle

        self.address, self.device, self.dies_after = address, "dev", dies_after

        def measure(payload):
            import time

            time.sleep(takes)
            if self.dies_after is not None:
                time.sleep(self.dies_after)
                raise RuntimeError("Socket SockChannel::Recv Error: connection reset")
            return pickle.dumps((1.0, None, {}))

        self.measure = measure


def _devices(sessions):
    devices = remote.RemoteDevices.__new__(remote.RemoteDevices)
    devices.tracker, devices.key, devices.timeout_s = "fake:1", KEY, 30.0
    devices.sessions, devices.requeued, devices.dropped = list(sessions), 0, []
    return devices


def test_a_request_left_by_a_server_dying_on_the_last_one_goes_to_a_live_server():
    # The healthy session runs out of work while the other still holds the last request;
    # then that server dies: its request must reach the healthy one, not be stranded.
    # The healthy one takes 0.2 s a request, so the dying one surely holds one (with
    # instant answers the healthy thread could drain the queue before the other started).
    devices = _devices([_FakeSession("ok", takes=0.2), _FakeSession("dying", dies_after=0.5)])
    got = dict(devices.map(["a", "b", "c"]))
    assert sorted(got) == [0, 1, 2] and all(r[0] == 1.0 for r in got.values())
    assert {r[2]["server"] for r in got.values()} == {"ok"}
    assert devices.requeued == 1 and [a for a, _ in devices.dropped] == ["dying"]


def _elsewhere(monkeypatch):
    """The servers' device made another kind than this machine (the searching side's
    fingerprint differs), and any whole build run here an error."""
    import importlib

    build = importlib.import_module("collage_tvm.placing")  # where the search's device is told
    monkeypatch.setattr(build, "device_fingerprint", lambda target: "another-cpu|64c|llvm:")

    def judged_here(*a, **k):
        raise AssertionError("a whole build was judged on the searching machine")

    monkeypatch.setattr(importlib.import_module("collage_tvm.check.never_slower"),
                        "judge_builds", judged_here)
    monkeypatch.setattr(importlib.import_module("collage_tvm.placer.op_stage"), "calibrate",
                        judged_here)
    monkeypatch.setattr(build, "latency_evaluator", judged_here)


def test_a_search_for_a_device_of_another_kind_judges_whole_builds_on_a_server(
        tracker, tmp_path, monkeypatch):
    """Calibration, the graph level and the final check run whole builds, which for the
    servers' device cannot run here: the final check runs on a server (the placement, the
    single-backend builds, the model file on each graph library, checked and timed there),
    the verdict is taken from its results; the graph level's placements are built and
    timed there too; the calibration is left out. The search opens its sessions with the
    servers once, for all of it."""
    _elsewhere(monkeypatch)
    opened = []  # the searching side's sessions with the servers: once for the whole search
    init = remote.RemoteDevices.__init__

    def opening(self, *args, **kwargs):
        opened.append(args)
        init(self, *args, **kwargs)

    monkeypatch.setattr(remote.RemoteDevices, "__init__", opening)
    servers = _servers(tracker, 1)
    try:
        model = _model(tmp_path / "m.onnx")
        res = collage_tvm.optimize(
            model, "llvm", db=str(tmp_path / "c.db"), rpc_tracker=f"127.0.0.1:{tracker.port}",
            rpc_key=KEY, placement_log=str(tmp_path / "p.json"),
            **{**SEARCH, "graph_level": True, "compare": True, "calibrate_rounds": 1})
        rep = res.report
        assert rep.measured_elsewhere and rep.measured_elsewhere != "another-cpu|64c|llvm:"
        assert "skipped" not in rep.graph_level  # run on the server (or nothing to try)
        cmp = records(rep.comparison)
        assert {"collage", "tvm-only", "onnxruntime (model file)"} <= set(cmp), cmp
        served = {r.get("server") for r in cmp.values()}
        assert len(served) == 1 and None not in served, served  # all judged by one server
        for name in ("collage", "tvm-only", "onnxruntime (model file)"):
            r = cmp.get(cmp[name].get("same_as", name), cmp[name])
            assert r["match"] and 0 < r["ms"] < 1e3, (name, r)
        assert rep.shipped in cmp and cmp[rep.shipped]["ms"] == min(
            r["ms"] for r in cmp.values() if r["match"] and "outside_budget" not in r)
        assert not rep.no_floor and rep.distinct_measured > 4 and res.executable is not None
        assert len(opened) == 1, opened
        # The verdict marked unsure (as if timed beside other work): the next build checks
        # it again on a server, not here.
        log = json.loads((tmp_path / "p.json").read_text())
        for record in log["placements"].values():
            record["unsure"] = True
        (tmp_path / "p.json").write_text(json.dumps(log))
        again = collage_tvm.optimize(
            model, "llvm", db=str(tmp_path / "c.db"), rpc_tracker=f"127.0.0.1:{tracker.port}",
            rpc_key=KEY, placement_log=str(tmp_path / "p.json"),
            **{**SEARCH, "graph_level": True, "compare": True, "calibrate_rounds": 1})
        assert again.report.placement_from_log and again.report.rechecked
        assert {r.get("server") for r in records(again.report.comparison).values()} == served
    finally:
        for s in servers:
            s.terminate()


def test_with_no_server_to_judge_the_placement_ships_unjudged(
        tracker, tmp_path, monkeypatch):
    _elsewhere(monkeypatch)
    import importlib

    remote_check = importlib.import_module("collage_tvm.check.remote")

    def no_server(*a, **k):  # the servers measured, then died before any whole build
        raise remote.RemoteError("every server died")

    monkeypatch.setattr(remote_check, "_ask", no_server)
    servers = _servers(tracker, 1)
    try:
        model = _model(tmp_path / "m.onnx")
        for compare in (False, True):
            res = collage_tvm.optimize(
                model, "llvm", db=str(tmp_path / "c.db"),
                rpc_tracker=f"127.0.0.1:{tracker.port}", rpc_key=KEY,
                placement_log=str(tmp_path / f"p{compare}.json"),
                **{**SEARCH, "graph_level": True, "compare": compare, "calibrate_rounds": 1})
            rep = res.report
            assert "no RPC server to run it" in rep.graph_level["skipped"]
            assert not records(rep.comparison) and res.executable is not None
            assert ("could not judge" if compare else "--no-compare") in rep.no_floor, rep.no_floor
    finally:
        for s in servers:
            s.terminate()
