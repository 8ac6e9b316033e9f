"""Whole builds judged on the RPC servers, for a search measured on another kind of device
(issue #35; ``measure.remote``).

A search whose candidates were measured on servers of another kind than this machine
cannot run its whole builds here; the graph level and the final check send them to the
servers instead, through the measuring child of a server (``measure.runner.run_callback``,
this module's functions pickled by reference):

- ``remote_judge``, the final check (``never_slower``'s ``judge``): the model's module with
  its weights, each contender as groups of the graph's node indices, the floors as
  (library, accuracy budget) with the user's model file, and the accuracy budget go to one
  server, which rebuilds the graph (the same nodes in the same order) and builds, checks and
  times the contenders exactly as the final check does here (``judge_builds``); the verdict
  is taken here from their results.
- ``remote_evaluator``, the graph level's evaluator (``latency_evaluator``): each placement
  built, checked against the seed's outputs and timed on a server, whose measuring child
  keeps the model between requests (it travels once per process).

The calibration, which runs the placement whole with each library call timed, is not run
on the servers yet.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math

import tvm

from ..measure.timers import target_json
from ..measure.remote import RemoteDevices, RemoteError
from ..measure.worker import CALLBACK_TIMEOUT_S, _message
from ..options import FinalCheck
from ..precision import parse_accuracy
from ..registry import get_backend
from .contender import records
from .floors import floor
from .never_slower import judge_builds

logger = logging.getLogger("collage_tvm")

JUDGED = "judged remotely"  # the label of the groups rebuilt on the server


def remote_judge(devices: RemoteDevices, graph, backends: dict, target, accuracy,
                 alone_ms: dict | None = None, settings=None):
    """``never_slower``'s ``judge``: ``(builds, floors) -> (results, other_load)`` by one of
    the search's RPC servers (``devices``); each result (a ``Contender``'s record) names the
    server ("server"). ``settings``: the thresholds (``options.FinalCheck``), sent along.
    Raises ``measure.remote.RemoteError`` when no server answers or the judging failed."""

    def judge(builds: dict, floors: dict) -> tuple:
        if any(groups is not None and any(n not in range(len(graph)) for g in groups
                                          for n in g.nodes) for groups in builds.values()):
            raise ValueError("a build's groups are not on the graph sent")
        spec = {name: None if groups is None else _spec(groups)
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
        libs = _with(backends, "tvm", *(f.backend for f in floors.values()))
        message = _message("run_callback", _entries(libs), target_json(target), None,
                           (judge_here, module_json(graph), spec, floor_spec, model, shapes,
                            str(parse_accuracy(accuracy)), alone_ms,
                            None if settings is None else dataclasses.asdict(settings)))
        logger.info("end to end: the builds go to an RPC server under %r (%s)", devices.key,
                    devices.device)
        results, reason, extra = _ask(devices, message)
        if not isinstance(results, dict):
            raise RemoteError(f"the final check failed on the RPC server "
                              f"{extra.get('server', '?')}: {reason}")
        for r in results.values():
            r["server"] = extra.get("server")
        return results, extra.get("other_load", float("nan"))

    return judge


def judge_here(funcs: list, target, module_json: str, spec: dict, floor_spec: dict,
               model: bytes | None, input_shapes, accuracy: str, alone_ms,
               settings: dict | None = None) -> tuple:
    """The server's side of ``remote_judge`` (run by ``measure.runner.run_callback`` in the
    measuring child): (results, None, {"other_load": share})."""
    backends = {b.name: b for _, b, _ in funcs}
    graph = _graph(module_json)
    builds = {name: None if groups is None else _groups(groups)
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
                                  target, parse_accuracy(accuracy), alone_ms,
                                  None if settings is None else FinalCheck(**settings))
    return records(results), None, {"other_load": share}


def remote_evaluator(devices: RemoteDevices, graph, backends: dict, target, accuracy,
                     seed_groups):
    """The graph level's ``evaluate(groups) -> (ms, reason)`` (``latency_evaluator``) run
    on the search's RPC servers (``devices``); ``seed_groups``: the search's seed, whose
    outputs are the reference there (a server's measuring child keeps the model and the
    reference between requests; one that lacks them, new or restarted, is sent the model
    again). Raises ``measure.remote.RemoteError`` when no server is left."""
    model = module_json(graph)
    digest = hashlib.sha256(model.encode()).hexdigest()
    entries, seed = _entries(_with(backends, "tvm")), _spec(seed_groups)

    def evaluate_groups(groups) -> tuple:
        for sent in (None, model):
            reply, reason, extra = _ask(devices, _message(
                "run_callback", entries, target_json(target), None,
                (evaluate_here, digest, sent, seed, _spec(groups), str(parse_accuracy(accuracy)))))
            if reply != UNKNOWN:
                break
        if not isinstance(reply, tuple):
            return math.inf, f"the RPC server {extra.get('server', '?')} failed: {reason}"
        return reply

    return evaluate_groups


def _ask(devices: RemoteDevices, message) -> tuple:
    """A whole-build request's reply from one of ``devices``: given the time the server's
    measuring child allows such a request, and a minute for the way there and back."""
    return devices.call(message, timeout_s=CALLBACK_TIMEOUT_S + 60)


UNKNOWN = "unknown model"  # ``evaluate_here``'s reply when it was not sent the model
_evaluating: dict = {}  # in a measuring child: model digest -> its evaluator (the last one)


def evaluate_here(funcs: list, target, digest: str, model: str | None, seed: list,
                  groups: list, accuracy: str) -> tuple:
    """The server's side of ``remote_evaluator``: ((ms, reason), None, {}), or ``UNKNOWN``
    when this process has not the model ``digest`` and was not sent it."""
    from .evaluate import latency_evaluator

    evaluate = _evaluating.get(digest)
    if evaluate is None:
        if model is None:
            return UNKNOWN, None, {}
        _evaluating.clear()
        graph = _graph(model)
        evaluate = latency_evaluator(graph, {b.name: b for _, b, _ in funcs}, target, accuracy)
        evaluate(_groups(seed))  # the seed first: its outputs are the reference
        _evaluating[digest] = evaluate
    return evaluate(_groups(groups)), None, {}


def module_json(graph) -> str:
    """``graph``'s function with the functions it calls, as a module in TVM's JSON (its
    weights included)."""
    mod = tvm.IRModule({"main": graph.func})
    for gv, func in graph.globals.items():
        mod[gv] = func
    return tvm.ir.save_json(mod)


def _graph(model: str):
    from ..graph import DataflowGraph

    return DataflowGraph.from_module(tvm.ir.load_json(model))


def _with(backends: dict, *names) -> dict:
    """``backends`` and the registered backends ``names`` it lacks."""
    return {**backends, **{n: get_backend(n) for n in names if n not in backends}}


def _entries(backends: dict) -> list:
    """The worker's entries that carry ``backends`` (and no function)."""
    return [(b, None, None) for b in backends.values()]


def _spec(groups) -> list:
    """Groups as they travel: (backend, node indices)."""
    return [(g.backend, sorted(g.nodes)) for g in groups]


def _groups(spec) -> list:
    from ..placement import Candidate

    return [Candidate(b, frozenset(nodes), JUDGED) for b, nodes in spec]
