"""The search, stage by stage: ``search`` runs ``stages()`` in order on one ``SearchState``;
each stage fills in what it found, and one that finishes the search early (the model runs
whole on a library, the placement log answers, ...) sets ``state.done``. A new placement's
own steps (op level, graph level, final check) are ``placing``."""
from __future__ import annotations

import dataclasses

import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np
import tvm

from ._memory import release_memory
from .byoc import candidate_vm
from .candidates import generate_candidates
from .check import first_line, from_records, ops_per_backend, records
from .check.floors import (floor_module, floors_for, model_file_for_alternates,
                           whole_on_a_library)
from .frontend import ModelError, dynamic_input, load_model, normalize_for_collage
from .frontend.model_file import ModelFile, model_file
from .graph import DataflowGraph, NotDataflow
from .graph.subgraph import given_inputs
from .measure.db import CostDB
from .measure.measurer import Measurer
from .measure.timers import target_json
from .measure.remote import RemoteDevices
from .measure.other_load import BUSY_SHARE
from .options import SearchOptions
from .placement import Placement, placement_from_record, placement_record, single_ops
from .placement_log import PlacementLog
from .placer.op_level import ensure_cover, place
from .placer.op_stage import dp_costs
from .placing import Placing, final_check, judge_remotely, search_new
from .precision import cpu_precisions
from .registry import resolve_backends
from .report import BuildReport, SearchResult, unsupported
from .stores import open_db, open_placement_log, open_tuning, placement_key
from .target import make_target
from .tuning import TuningDB, use_tuning_db

logger = logging.getLogger("collage_tvm")


def stages() -> tuple:
    """The search, stage by stage (each below, in this order)."""
    return (import_model, rewrite_graph, open_stores, from_log, recheck, search_placement,
            finish)


def search(model, target="llvm", options: SearchOptions | None = None, db=None,
           placement_log=None, example_inputs=None, input_shapes=None,
           tuning_db=None) -> SearchResult:
    """Import, generate candidates, measure (or reuse) costs, place; see ``SearchOptions``.

    A placement found in the placement log (same model, target, backend versions, search
    options and tuning records) is used as it is: nothing is measured. ``tuning_db``: see
    ``open_tuning``. ``example_inputs`` (arrays or tensors, one per model input): a torch
    module is traced with them, and every build is checked and timed on them first
    (``given_inputs``; the later check seeds stay random).
    """
    with given_inputs(example_arrays(example_inputs)):
        return _search_model(model, target, options, db, placement_log, example_inputs,
                             input_shapes, tuning_db)


def example_arrays(example_inputs) -> list | None:
    """The user's example inputs as numpy arrays (None when there are none)."""
    if example_inputs is None:
        return None
    items = list(example_inputs) if isinstance(example_inputs, (list, tuple)) else [example_inputs]
    out = []
    for a in items:
        if hasattr(a, "detach"):  # a torch tensor
            a = a.detach().cpu().numpy()
        elif hasattr(a, "numpy"):  # a tvm tensor
            a = a.numpy()
        out.append(np.asarray(a))
    return out


@dataclass
class SearchState:
    """One search's state. The stages (``stages()``) take it in order, each filling in what
    it found; one that finishes the search early (the model runs whole on a library, the
    placement log answers, ...) sets ``done``."""

    model: object                 # as the user gave it: ONNX path/proto, torch module, IRModule
    target: tvm.target.Target
    options: SearchOptions
    backends: dict                # name -> Backend, the ones that load here
    report: BuildReport
    user_file: ModelFile          # the user's model as a file a graph library runs whole
    example_inputs: object = None
    input_shapes: dict | None = None
    db: object = None             # the cost DB as given (path or CostDB)
    placement_log: object = None
    tuning_db: object = None
    t_start: float = field(default_factory=time.perf_counter)
    mod: tvm.IRModule | None = None          # the imported (and rewritten) model
    graph: DataflowGraph | None = None       # its dataflow graph
    original: tvm.IRModule | None = None     # before the rewrites, when they changed it
    unrewritten: DataflowGraph | None = None  # its graph
    cost_db: CostDB | None = None
    log: PlacementLog | None = None
    tuning: TuningDB | None = None
    key: str = ""                 # the placement log's key
    placement: Placement | None = None
    recheck: bool = False         # the log's verdict is unsure: the final check runs again
    devices: RemoteDevices | None = None  # the RPC servers (``remote``)
    done: SearchResult | None = None

    def result(self, graph=None, placement=None, module=None, tuning=None) -> SearchResult:
        return SearchResult(graph, Placement([], math.nan) if placement is None else placement,
                            self.backends, self.report, self.target,
                            self.mod if module is None else module, tuning)

    def placing(self) -> Placing:
        """What the stages of a new placement share (``placing.search_new``)."""
        return Placing(self.graph, self.backends, self.target, self.cost_db, self.options,
                       self.report, self.remote())

    def remote(self) -> RemoteDevices | None:
        """The RPC servers of ``options.rpc_tracker`` / ``rpc_key`` (None without them),
        opened once: the rewrite search, the op level, the graph level and the final check
        measure on the same sessions."""
        if self.devices is None and self.options.rpc_tracker:
            self.devices = RemoteDevices(self.options.rpc_tracker, self.options.rpc_key,
                                         target_json(self.target))
        return self.devices

    def imported(self) -> None:
        self.report.times["import"] = time.perf_counter() - self.t_start


def _search_model(model, target, options, db, placement_log, example_inputs, input_shapes,
                  tuning_db) -> SearchResult:
    state = start(model, target, options, example_inputs, input_shapes, db=db,
                  placement_log=placement_log, tuning_db=tuning_db)
    try:
        for stage in stages():
            stage(state)
            if state.done is not None:
                state.done.model_file = model_file_for_alternates(
                    state.report, state.user_file, state.input_shapes)
                return state.done
        raise AssertionError("the last stage always finishes the search")
    finally:
        state.user_file.close()
        if state.devices is not None:
            state.devices.close()


def start(model, target, options, example_inputs=None, input_shapes=None, **stores) -> SearchState:
    """The state a search starts from: the target, the backends that load, the report."""
    options = options or SearchOptions()
    t_start = time.perf_counter()
    target = make_target(target)
    backends, skipped = resolve_backends(options.backends, target, options.accuracy)
    return SearchState(model, target, options, backends,
                       BuildReport(backends=list(backends), skipped=skipped),
                       model_file(model, example_inputs), example_inputs, input_shapes,
                       t_start=t_start, **stores)


def import_model(state: SearchState) -> None:
    """The model as a normalized Relax module. One TVM cannot import runs whole on a
    graph library that can (``done``)."""
    try:
        state.mod = normalize_for_collage(load_model(state.model, state.example_inputs,
                                                     state.input_shapes))
        release_memory()  # the importer's copies of the weights are garbage now
    except ModelError as err:
        if err.proto is None:
            raise
        state.mod = whole_on_a_library(err, state.backends, state.input_shapes, state.report,
                                        state.target, state.options.accuracy)
        state.imported()
        state.done = state.result()
        return
    if state.options.accuracy.why:  # a quantized model, judged by its own precision
        state.report.precision = {"accuracy": str(state.options.accuracy),
                                  "why": state.options.accuracy.why}
    elif not state.options.accuracy.strict:
        state.report.precision = {"accuracy": str(state.options.accuracy), **{
            p: (why or "available") if ok else f"not used: {why}"
            for p, (ok, why) in cpu_precisions().items() if p != "f32"}}


def rewrite_graph(state: SearchState) -> None:
    """The verified rewrites (``options.rewrite``), then the dataflow graph. A model that
    is not one dataflow block stays on TVM whole (``done``)."""
    try:
        why = dynamic_input(state.mod["main"])
        if why:
            raise NotDataflow(why)
        if state.options.rewrite:
            rewritten = _rewrite(state)
            if rewritten is not state.mod:  # the fold or a searched rewrite changed it
                state.original, state.unrewritten = state.mod, DataflowGraph.from_module(state.mod)
                state.mod = rewritten
        state.graph = DataflowGraph.from_module(state.mod)
    except NotDataflow as err:  # compiled as TVM alone would: nothing to place
        logger.warning("the whole model stays on TVM: %s", err)
        state.report.kept_on_tvm = [f"the whole model: {err}"]
        state.imported()
        state.done = state.result()


def open_stores(state: SearchState) -> None:
    """The cost DB, the placement log, the tuning records; the placement log's key."""
    state.cost_db = open_db(state.db)
    state.log = open_placement_log(state.placement_log, state.cost_db)
    state.tuning = open_tuning(state.options, state.cost_db, state.target, state.tuning_db)
    if state.tuning is not None:
        state.report.tuning = {"path": state.tuning.path, "records": len(state.tuning)}
    state.key = placement_key(state.graph.func, state.target, state.backends, state.options,
                              state.tuning.digest() if state.tuning is not None else "")
    state.imported()


def from_log(state: SearchState) -> None:
    """The placement log's answer, when it has one: a placement (nothing is measured), or
    the user's file whole on a library (``done``)."""
    logged, report = state.log.get(state.key), state.report
    report.alternates = list((logged or {}).get("alternates", []))
    if logged and logged.get("unrewritten") and state.unrewritten is not None:
        state.graph, state.mod = state.unrewritten, state.original  # it beat the rewritten graph
    state.recheck = bool(logged and (logged.get("unsure") or shipped_dropped(logged))
                         and state.options.compare)
    if logged and logged.get("whole_model") and not state.recheck:
        whole = floor_module(logged["whole_model"], state.user_file, state.input_shapes,
                              state.graph)
        if whole is not None:
            report.placement_from_log = True
            report.comparison = from_records(logged.get("comparison"))
            report.shipped = logged.get("shipped", "")
            report.shipped_floor = logged["whole_model"]
            report.ops_per_backend = {logged["whole_model"]: len(state.graph)}
            state.done = state.result(module=whole)
            return
        logged = None
    state.placement = placement_from_record(logged, state.graph, state.backends)
    if state.placement is not None:
        report.placement_from_log = True
        report.estimated_ms = state.placement.cost
        report.comparison = from_records(logged.get("comparison"))
        report.shipped = logged.get("shipped", "collage")
        report.graph_level = logged.get("graph_level", {})


def search_placement(state: SearchState) -> None:
    """Both levels and the final check (``placing.search_new``) when the log had no placement; the
    verdict goes to the placement log. The user's file whole on a library that won ships
    as it is (``done``)."""
    if state.placement is not None:
        return
    report, graph = state.report, state.graph
    floors = {}
    if state.options.compare:
        floors = floors_for(state.user_file, state.backends, state.target, state.options.accuracy,
                         state.input_shapes, graph.func, report)
    else:
        report.no_floor = "the final check is off (--no-compare)"
    with use_tuning_db(state.tuning):
        try:
            placement, shipped_graph = search_new(state.placing(), state.unrewritten, floors)
        except Exception as err:
            raise unsupported(report, err) or err
    _log_verdict(state, placement, shipped_graph)


def shipped_dropped(logged: dict) -> bool:
    """Whether a logged verdict shipped a build the final check had dropped (it lost to the
    leader at its best in every round both were timed in): before ``runoff._tie_dropped``,
    such a build could ship on the median of its few rounds against a leader timed on into
    a slow stretch; its verdict is checked again like an unsure one."""
    shipped = (logged.get("comparison") or {}).get(logged.get("shipped", ""))
    return bool(isinstance(shipped, dict) and shipped.get("dropped"))


def recheck(state: SearchState) -> None:
    """A placement the log holds with an unsure verdict (the final check ran beside other
    work): the final check runs again on it, and the log keeps the new verdict."""
    if not state.recheck or state.placement is None:
        return
    report = state.report
    logger.warning("the placement log's verdict on this model was %s: checking it again",
                   "timed beside other work" if (state.log.get(state.key) or {}).get("unsure")
                   else "a build dropped while timed (it lost in every round)")
    floors = floors_for(state.user_file, state.backends, state.target, state.options.accuracy,
                     state.input_shapes, state.graph.func, report)
    remote = bool(state.options.rpc_tracker)  # judged where the search measured
    with use_tuning_db(state.tuning):
        try:
            p = state.placing()
            judge = judge_remotely(p) if remote else None  # as ``placing._judged_there``
            logged = state.placement  # a concurrent build it shipped is judged as one again
            staged = logged if logged.stages and not remote else None
            placement, shipped_graph = final_check(
                p, dataclasses.replace(logged, stages=[]), floors, judge=judge,
                scheduled=staged)
        except Exception as err:  # noqa: BLE001 - the log's placement ships as it was
            if not remote:
                raise
            logger.warning("the RPC servers could not check the placement again (%s): "
                           "shipping the placement log's", first_line(err))
            return
    report.rechecked = True
    _log_verdict(state, placement, shipped_graph)


def _log_verdict(state: SearchState, placement, shipped_graph) -> None:
    """The final check's verdict into the placement log (unsure when the machine was busy)
    and into the state: the user's file whole on a library that won ships as it is
    (``done``)."""
    report, graph = state.report, state.graph
    record = placement_record(placement, shipped_graph, state.target, records(report.comparison),
                              report.shipped, report.graph_level)
    record["other_load"] = report.other_load
    record["alternates"] = report.alternates
    if report.other_load > BUSY_SHARE:
        record["unsure"] = True
    if report.shipped_floor:  # the user's model file, whole on a library, won
        lib = report.shipped_floor
        whole = floor_module(lib, state.user_file, state.input_shapes, graph)
        if whole is not None:
            state.log.put(state.key, {**record, "whole_model": lib})
            report.ops_per_backend = {lib: len(graph)}
            logger.info("collage: %s", report.summary())
            state.done = state.result(placement=placement, module=whole)
            return
        # (it ran in the final check a moment ago; nothing is lost if it no longer loads)
        report.shipped_floor, report.shipped = "", "tvm-only"
        placement = Placement(single_ops(graph), math.nan)
    if shipped_graph is not graph:  # the unrewritten graph was faster
        state.graph, state.mod = shipped_graph, state.original
        record["unrewritten"] = True
    state.log.put(state.key, record)
    state.placement = placement


def finish(state: SearchState) -> None:
    """The search's result: the placement on its graph."""
    state.report.ops_per_backend = ops_per_backend(state.placement.groups)
    logger.info("collage: %s", state.report.summary())
    state.done = state.result(state.graph, state.placement, tuning=state.tuning)


def _rewrite(state: SearchState) -> tvm.IRModule:
    """The verified rewrites (``collage_tvm.rewrite``): the affine-tail fold (it only removes
    work), then the cost-based search over the others and the generator's proved rules
    (``rewrite.generated``), each graph costed as the op-level DP
    places it on ``backends`` with measured costs (new kernels are measured and cached): a
    rewrite is judged on the backends that will run it."""
    from .measure.measurer import DeadlinePassed
    from .rewrite import fold_conv_affine
    from .rewrite.generated import rewrites as generated_rewrites
    from .rewrite.backtrack import REWRITES, split_backtrack

    t0 = time.perf_counter()
    mod, backends, options = state.mod, state.backends, state.options
    folded = fold_conv_affine(mod)
    measurer = Measurer.from_options(state.target, open_db(state.db), candidate_vm, options,
                                     progress=False, remote=state.remote())
    try:
        eps = measurer.epsilon(backends.values())
        t_search = time.perf_counter()

        def cost(m) -> float:
            # Without the graph libraries' regions: a rewrite changes every region around
            # it, and each would be measured again (a whole-model session among them); a
            # local change is judged on the local candidates.
            graph = DataflowGraph.from_module(m)
            cands = generate_candidates(graph, backends.values(), regions=False)
            try:
                measured = measurer.costs(graph, cands, backends)
            except DeadlinePassed:  # the budget is spent: this graph is not costed
                return math.inf
            # The graph as imported (the first costed) is costed in full, whatever the
            # time; past the budget, a rewritten graph with a kernel not yet measured is
            # left uncosted, so the search stops within its budget.
            measurer.deadline = t_search + options.budget
            raw, _ = ensure_cover(len(graph), cands, measured)
            return place(graph.producers, cands, dp_costs(raw, eps), eps, exact=False).cost

        # 3%: below it, two measured placements are within the noise of these machines
        res = split_backtrack(folded, cost, REWRITES + generated_rewrites(),
                           budget_s=options.budget, min_gain=0.03)
    finally:
        measurer.close()
    report = state.report
    report.rewrite = {"folded_affine_tails": folded is not mod, "applied": res.applied,
                      "start_ms": res.start_cost, "best_ms": res.cost, "graphs": res.graphs,
                      "pruned": res.pruned,
                      "closed": res.closed, "stopped": res.stopped, "pieces": res.pieces,
                      "seconds": res.seconds}
    report.times["rewrite"] = time.perf_counter() - t0
    logger.info("rewrite: %s", report.rewrite)
    return res.module
