"""The final check on the RPC servers, for a search measured on another kind of device
(issue #35; ``measure.remote``).

A search whose candidates were measured on servers of another kind than this machine
cannot run its whole builds here: the final check (``never_slower``) sends them to one of
the servers instead. The request carries the model's module with its weights, each build
as groups of the graph's node indices, the floors as (library, accuracy budget) with the
user's model file, and the accuracy budget; the server's measuring child rebuilds the graph
(the same nodes in the same order), builds, checks and times the contenders exactly as the
final check does here (``judge_builds``), and answers their results. The verdict is then
taken here from them. The calibration and the graph level, which run whole builds many
times, are not run on the servers (yet).
"""
from __future__ import annotations

import logging

import tvm

from ..measure.measurer import target_json
from ..measure.remote import RemoteDevices, RemoteError
from ..measure.worker import CALLBACK_TIMEOUT_S, _message
from ..registry import get_backend
from .never_slower import floor, judge_builds

logger = logging.getLogger("collage_tvm")

JUDGED = "judged remotely"  # the label of the groups rebuilt on the server


def remote_judge(tracker: str, key: str, graph, backends: dict, target, accuracy,
                 alone_ms: dict | None = None):
    """``never_slower``'s ``judge``: ``(builds, floors) -> (results, other_load)`` by one of
    the servers under ``key`` at ``tracker``; each result names the server ("server").
    Raises ``measure.remote.RemoteError`` when no server answers or the judging failed."""

    def judge(builds: dict, floors: dict) -> tuple:
        if any(groups is not None and any(n not in range(len(graph)) for g in groups
                                          for n in g.nodes) for groups in builds.values()):
            raise ValueError("a build's groups are not on the graph sent")
        spec = {name: None if groups is None else [(g.backend, sorted(g.nodes))
                                                   for g in groups]
                for name, groups in builds.items()}
        floor_spec = {name: (f.backend, None if f.budget is None else str(f.budget))
                      for name, f in floors.items()}
        model = shapes = None
        if floors:
            first = next(iter(floors.values()))
            shapes = first.input_shapes
            try:
                model = first.user_file.load().SerializeToString()
            except ValueError as err:  # protobuf writes no message over 2 GiB
                logger.warning("end to end: the model file is not sent to the RPC server (%s):"
                               " it is not among the contenders there", err)
                floor_spec = {}
                spec = {n: g for n, g in spec.items() if n not in floors}
        libs = {**backends, **{n: get_backend(n) for n in {"tvm", *(f.backend for f in
                                                                    floors.values())}
                               if n not in backends}}
        mod = tvm.IRModule({"main": graph.func})
        for gv, func in graph.globals.items():
            mod[gv] = func
        message = _message("run_callback", [(b, None, None) for b in libs.values()],
                           target_json(target), None,
                           (judge_here, tvm.ir.save_json(mod), spec, floor_spec, model, shapes,
                            str(accuracy), alone_ms))
        devices = RemoteDevices(tracker, key, target_json(target),
                                timeout_s=CALLBACK_TIMEOUT_S + 60)
        try:
            logger.info("end to end: the builds go to an RPC server under %r (%s)", key,
                        devices.device)
            results, reason, extra = devices.call(message)
        finally:
            devices.close()
        if not isinstance(results, dict):
            raise RemoteError(f"the final check failed on the RPC server "
                              f"{extra.get('server', '?')}: {reason}")
        for r in results.values():
            r["server"] = extra.get("server")
        return results, extra.get("other_load", float("nan"))

    return judge


def judge_here(funcs: list, target, module_json: str, spec: dict, floor_spec: dict,
               model: bytes | None, input_shapes, accuracy: str, alone_ms) -> tuple:
    """The server's side of ``remote_judge`` (run by ``measure.runner.run_callback`` in the
    measuring child): (results, None, {"other_load": share})."""
    from ..graph import DataflowGraph
    from ..placement import Candidate

    backends = {b.name: b for _, b, _ in funcs}
    graph = DataflowGraph.from_module(tvm.ir.load_json(module_json))
    builds = {name: None if groups is None else [Candidate(b, frozenset(nodes), JUDGED)
                                                 for b, nodes in groups]
              for name, groups in spec.items()}
    floors = {}
    if floor_spec:
        import onnx

        from ..frontend.model_file import ModelFile

        user_file = ModelFile(proto=onnx.load_from_string(model))
        for name, (lib, budget) in floor_spec.items():
            floors[name] = floor(lib, user_file, backends[lib], input_shapes, graph.func,
                                 target, budget)
    results, share = judge_builds(builds, {n: graph for n in builds}, floors, backends,
                                  target, accuracy, alone_ms)
    return results, None, {"other_load": share}
