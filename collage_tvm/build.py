"""``collage_tvm.build``: the whole data flow of DESIGN.md for one model.

import -> candidates -> measure -> op-level placement (refined, calibrated) -> graph-level
placement -> final check -> partition and lower -> ``tvm.compile``. This module wires the
stages together; each stage lives in its own package and knows nothing of the later ones
(a stage that must run a later one's work gets it as a callback from here).
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np
import tvm
from tvm import relax

from ._memory import release_memory
from .check import (MODEL_FILE, file_label, first_line, floor, latency_evaluator,
                    never_slower, ops_per_backend, outputs_on, single_backend_builds,
                    tvm_reference)
from .frontend import ModelError, dynamic_input, load_model, normalize_for_collage
from .frontend.model_file import ModelFile, model_file
from .graph import DataflowGraph, NotDataflow
from .graph.subgraph import function_key, given_inputs
from .byoc import (candidate_vm, candidate_vm_for, compile_module, compile_placement,
                    forget_lowered, lower_placement, placement_runner)
from .measure.db import CostDB
from .measure.measurer import COST_MODEL, Measurer, target_json
from .measure.remote import RemoteDevices, RemoteError
from .measure.timing import BUSY_SHARE
from .options import SearchOptions
from .candidates import generate_candidates
from .placement import Placement, placement_from_record, placement_record, single_ops
from .placement_log import PlacementLog
from .placer import op_stage
from .placer.graph_level import GraphLevelSearch
from .placer.op_level import ensure_cover, place
from .placer.op_stage import OpLevel, dp_costs
from .precision import CHECK_SEEDS, cpu_precisions, parse_accuracy
from .registry import get_backend, list_backends, resolve_backends
from .target import device_fingerprint, make_target
from .tuning import TuningDB, active_database, default_dir, open_tuning_db, use_tuning_db

logger = logging.getLogger("collage_tvm")

DEFAULT_DB = os.path.join(os.path.expanduser("~"), ".cache", "collage-tvm", "costs.db")


@dataclass
class BuildReport:
    backends: list
    skipped: dict = field(default_factory=dict)      # backend -> reason it was left out
    candidates: int = 0
    distinct_measured: int = 0
    db_hits: int = 0
    failures: list = field(default_factory=list)
    kept_on_tvm: list = field(default_factory=list)  # ops no candidate could be measured for
    unrunnable: list = field(default_factory=list)  # those nodes: "op -> dtype" each
    epsilon: dict = field(default_factory=dict)
    switch: dict = field(default_factory=dict)  # (a, b) -> ms per change of runtime
    close_calls: int = 0   # alternative covers within 75% of the chosen one (refine)
    carved: dict = field(default_factory=dict)  # regions cut around TVM kernels (_carve)
    # measuring only what can win (placer.lean.LeanReport): measured, known, skipped, rounds
    lean: dict = field(default_factory=dict)
    side_by_side: int = 0  # sets of candidates re-timed side by side in this build
    calibration: list = field(default_factory=list)  # in-context rounds (placer.calibrate)
    placement_from_log: bool = False
    estimated_ms: float = math.nan
    ops_per_backend: dict = field(default_factory=dict)
    times: dict = field(default_factory=dict)        # stage -> seconds
    comparison: dict = field(default_factory=dict)   # build name -> {"ms", "match", "max_err"}
    shipped: str = "collage"                         # which build was shipped
    graph_level: dict = field(default_factory=dict)  # the evolutionary search: history, counts
    rewrite: dict = field(default_factory=dict)      # the rewrite search: applied, costs, counts
    tuning: dict = field(default_factory=dict)       # the tuning database used: path, records
    precision: dict = field(default_factory=dict)    # budget, and per precision why (not) used
    # The model runs whole on one graph library: TVM cannot import it, or the user's model
    # file run whole by it ("floor": True) was the fastest correct build of the final check.
    whole_model: dict = field(default_factory=dict)
    floor: str = ""  # why the user's model file was not among the contenders ("" if it was)
    # The shipped build runs one file whole on a graph library, and others ran it (or the
    # user's model file, "source": "model file") within a few percent in the final check:
    # {"backend", "ms"[, "source"]} each, timed again at load (``check.at_load``;
    # ``never_slower.close_calls``).
    alternates: list = field(default_factory=list)
    # The share of the machine's CPU other processes took during the final check: above
    # ``measure.timing.BUSY_SHARE`` its verdict is logged as unsure and checked again.
    other_load: float = math.nan
    rechecked: bool = False  # the placement log's unsure verdict was checked again
    # The RPC servers' device, where it is not this machine's (a search for a device of
    # another kind): whole builds were not run here (``_unjudged``).
    measured_elsewhere: str = ""
    # A model with dynamic dimensions (``collage_tvm.dynamic``): its ranges, the choice at
    # each representative point, the static build's specialization; {} for a static model.
    dynamic: dict = field(default_factory=dict)

    def summary(self) -> str:
        if self.placement_from_log:
            return "placement found in the placement log: measured nothing"
        if self.distinct_measured == 0 and self.side_by_side == 0:
            return f"all {self.db_hits} costs found in the cost DB: measured nothing"
        side = (f"; re-timed {self.side_by_side} close calls side by side"
                if self.side_by_side else "")
        return (f"measured {self.distinct_measured} candidates ({self.db_hits} from the cost "
                f"DB){side}")


@dataclass
class SearchResult:
    graph: DataflowGraph | None  # None: the model is not one dataflow block (kept on TVM)
    placement: Placement
    backends: dict              # name -> Backend, the ones available
    report: BuildReport
    target: tvm.target.Target
    module: tvm.IRModule        # the imported, normalized model
    tuning: object = None       # the TuningDB whose records TVM's kernels use, else None
    # The user's model file (ONNX ModelProto, at the input shapes the final check ran it)
    # where an alternate of the report runs it ("source": "model file"), else None
    model_file: object = None


@dataclass
class CollageResult:
    executable: object          # tvm.relax.VMExecutable
    module: tvm.IRModule        # partitioned, external groups lowered
    placement: Placement
    graph: DataflowGraph | None  # None: the whole model stayed on TVM (report.kept_on_tvm)
    report: BuildReport
    target: tvm.target.Target | None = None  # what TVM's kernels were compiled for
    model_file: object = None   # as ``SearchResult.model_file``: saved for the decision at load
    # A dynamic model's static build at the optimum, where it serves that shape (saved
    # beside the dispatch: ``collage_tvm.dynamic``), else None
    static: object = None

    def save(self, path, **kwargs):
        """``collage_tvm.save(self, path, ...)``: the build as a directory that
        ``collage_tvm.load`` runs in another process without searching."""
        from .artifact import save

        return save(self, path, **kwargs)


def _whole_on_a_library(err, backends: dict, input_shapes, report, target,
                        accuracy) -> tvm.IRModule:
    """The module running the ONNX model TVM's importer refused (``err``) wholly on the
    graph library among ``backends`` that runs it fastest here: each one that loads it,
    timed side by side on random inputs, its outputs checked against the first's within
    ``accuracy`` (``check.at_load.decide``); ``err`` again, with each library's reason
    added, when none loads it."""
    from .byoc.whole import NotWhole, whole_model_module

    reasons, mods = [], {}
    for name, backend in backends.items():
        if backend.kind != "graph" or not accuracy.allows(backend.precision):
            continue
        try:
            mods[name] = whole_model_module(err.proto, backend, input_shapes)
        except NotWhole as why:
            reasons.append(f"{name}: {why}")
    if not mods:
        if reasons:
            raise ModelError(f"{err}; no graph library runs it whole either "
                             f"({'; '.join(reasons)})") from err
        raise ModelError(f"{err}; a graph library could run the whole model: add onnxruntime "
                         "or openvino to the backends") from err
    name, timed = _fastest_whole(mods, target, accuracy)
    report.whole_model = {"backend": name, "why": first_line(err),
                          **({"timed": timed} if timed else {})}
    logger.warning("TVM cannot import the model (%s); it runs wholly on %s%s",
                   first_line(err), name, f" ({_ms_text(timed)})" if timed else "")
    return mods[name]


def _fastest_whole(mods: dict, target, accuracy) -> tuple:
    """(name, {name: ms}) of the fastest of ``mods`` (modules running one file whole on a
    library each), timed side by side here (nothing timed for one: {})."""
    from .byoc.external import release_with
    from .check.at_load import decide
    from .graph.subgraph import random_inputs

    if len(mods) == 1:
        return next(iter(mods)), {}
    first = next(iter(mods.values()))
    dev = tvm.cpu() if target.kind.name == "llvm" else tvm.cuda()
    args = [tvm.runtime.tensor(a, dev) for a in random_inputs(first["main"])]
    mains, executables = {}, {}
    for name, mod in mods.items():
        try:
            executables[name] = compile_module(mod, target)
            mains[name] = relax.VirtualMachine(executables[name], dev)["main"]
        except Exception as why:  # noqa: BLE001 - the others still run it
            logger.warning("the model whole on %s does not build: %s", name, first_line(why))
    chose, record = (decide(mains, args, accuracy) if len(mains) > 1
                     else (next(iter(mains or mods)), {}))
    for name, executable in executables.items():
        if name != chose:  # the losers' sessions go with their executables
            release_with(executable, mods[name])
    return chose, record.get("ms", {})


def _ms_text(timed: dict) -> str:
    return ", ".join(f"{n} {ms:.3f} ms" for n, ms in sorted(timed.items(), key=lambda kv: kv[1]))


def _floors(user_file: ModelFile, backends: dict, target, accuracy, input_shapes, main,
            report) -> dict:
    """name -> ``check.Floor``: the user's model file run whole by each graph library among
    ``backends`` (its f32 build), and on a CPU with bf16 instructions under the strict f32
    budget, by each library's reduced-precision variant too: timed for the report only, it
    says what ``--accuracy bf16`` would give (DESIGN.md, "never slower")."""
    if not user_file:
        report.floor = user_file.why
        return {}
    libs = {n: b for n, b in backends.items()
            if b.kind == "graph" and hasattr(b.get_lowering(), "compile")}
    floors = {file_label(n): floor(n, user_file, b, input_shapes, main, target)
              for n, b in libs.items()}
    if parse_accuracy(accuracy).strict:
        for name in list_backends():
            variant = get_backend(name)
            if (variant.variant_of in libs and variant.precision != "f32"
                    and variant.device == libs[variant.variant_of].device
                    and variant.available()[0]):
                floors[file_label(name)] = floor(name, user_file, variant, input_shapes,
                                                       main, target, budget=variant.precision)
    if not floors:
        report.floor = "no graph library among the backends runs a model file"
    return floors


def _floor_module(lib: str, user_file: ModelFile, input_shapes, graph) -> tvm.IRModule | None:
    """The module running the user's model file whole on ``lib``: the final check's verdict,
    to ship (or reuse from the placement log); None, with a warning, when it cannot be made
    now (no model file, the library gone)."""
    from .byoc.whole import NotWhole, whole_model_module

    if not user_file:
        logger.warning("the placement log ships the model file whole on %s, but there is no "
                       "model file now (%s): searching again", lib, user_file.why)
        return None
    try:
        backend = get_backend(lib)
        ok, why = backend.available()
        if not ok:
            raise NotWhole(why)
        return whole_model_module(user_file.load(), backend, input_shapes, like=graph.func,
                                  path=user_file.path)
    except Exception as err:  # noqa: BLE001 - searched again, nothing lost
        logger.warning("the model file whole on %s cannot be built now (%s): searching "
                       "again", lib, first_line(err))
        return None


def placement_key(main: relax.Function, target, backends: dict,
                  options: SearchOptions | None = None, tuning: str = "") -> str:
    """The placement-log key: the model, the target, each backend's library version, the
    cost model's revision (``measure.measurer.COST_MODEL``), every option that changes the
    search (``SearchOptions.key_variant``) and the tuning records TVM's kernels use
    (``TuningDB.digest``; "" when untuned)."""
    parts = [function_key(main), str(target)] + sorted(f"{n}={b.version()}" for n, b in backends.items())
    parts.append(f"costs={COST_MODEL}")
    if tuning:
        parts.append(f"tuning={tuning}")
    key = hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]
    variant = (options or SearchOptions()).key_variant()
    return hashlib.sha256(f"{key}{variant}".encode()).hexdigest()[:32] if variant else key


def open_db(db) -> CostDB:
    """A ``CostDB`` from a path (None: ``DEFAULT_DB``) or the DB itself; a damaged file is
    reported, moved aside and rebuilt."""
    if isinstance(db, CostDB):
        return db
    path = DEFAULT_DB if db is None else db
    cost_db = CostDB(path)
    if cost_db.recovered_from:
        logger.warning("cost DB %s was damaged; moved aside to %s and rebuilt",
                       path, cost_db.recovered_from)
    return cost_db


def open_placement_log(log, db: CostDB) -> PlacementLog:
    """A ``PlacementLog`` from a path or the log itself; None: next to the cost DB file
    (``<db>.placements.json``), in memory for an in-memory DB."""
    if isinstance(log, PlacementLog):
        return log
    if log is None:
        path = getattr(db, "path", None)
        log = None if path in (None, ":memory:") else f"{os.fspath(path)}.placements.json"
    return PlacementLog(log)


def open_tuning(options: SearchOptions, cost_db: CostDB, target, tuning_db=None):
    """The tuning database a build applies: ``tuning_db`` (a path or a ``TuningDB``), else
    the one next to the cost DB for this target (``collage-tvm tune`` fills it); None when
    ``options.tuning`` is off or the database holds no record."""
    if not options.tuning:
        return None
    if tuning_db is None:
        tuning_db = default_dir(getattr(cost_db, "path", None), target)
    db = tuning_db if isinstance(tuning_db, TuningDB) else open_tuning_db(tuning_db, target)
    return db if db is not None and len(db) else None


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
    """One search's state. The stages (``STAGES``) take it in order, each filling in what
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
        """What the stages of a new placement share (``_search``)."""
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
        for stage in STAGES:
            stage(state)
            if state.done is not None:
                state.done.model_file = _model_file_alternate(state)
                return state.done
        raise AssertionError("the last stage always finishes the search")
    finally:
        state.user_file.close()
        if state.devices is not None:
            state.devices.close()


def _model_file_alternate(state: SearchState):
    """The user's model file as the final check ran it (at the input shapes given), where an
    alternate of the report runs it: the saved build holds it for the decision at load."""
    if not any(a.get("source") == MODEL_FILE for a in state.report.alternates):
        return None
    from .byoc.whole import with_input_shapes

    try:
        return with_input_shapes(state.user_file.load(), state.input_shapes)
    except Exception as err:  # noqa: BLE001 - the alternate goes, the build stands
        logger.warning("the user's model file could not be read again (%s): its close call "
                       "is not saved for the decision at load", first_line(err))
        state.report.alternates = [a for a in state.report.alternates
                                   if a.get("source") != MODEL_FILE]
        return None


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
        state.mod = _whole_on_a_library(err, state.backends, state.input_shapes, state.report,
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
    state.recheck = bool(logged and logged.get("unsure") and state.options.compare)
    if logged and logged.get("whole_model") and not state.recheck:
        whole = _floor_module(logged["whole_model"], state.user_file, state.input_shapes,
                              state.graph)
        if whole is not None:
            report.placement_from_log = True
            report.comparison = logged.get("comparison", {})
            report.shipped = logged.get("shipped", "")
            report.whole_model = {"backend": logged["whole_model"], "floor": True,
                                  "why": "the placement log's verdict"}
            report.ops_per_backend = {logged["whole_model"]: len(state.graph)}
            state.done = state.result(module=whole)
            return
        logged = None
    state.placement = placement_from_record(logged, state.graph, state.backends)
    if state.placement is not None:
        report.placement_from_log = True
        report.estimated_ms = state.placement.cost
        report.comparison = logged.get("comparison", {})
        report.shipped = logged.get("shipped", "collage")
        report.graph_level = logged.get("graph_level", {})


def search_placement(state: SearchState) -> None:
    """Both levels and the final check (``_search``) when the log had no placement; the
    verdict goes to the placement log. The user's file whole on a library that won ships
    as it is (``done``)."""
    if state.placement is not None:
        return
    report, graph = state.report, state.graph
    floors = {}
    if state.options.compare:
        floors = _floors(state.user_file, state.backends, state.target, state.options.accuracy,
                         state.input_shapes, graph.func, report)
    else:
        report.floor = "the final check is off (--no-compare)"
    with use_tuning_db(state.tuning):
        try:
            placement, shipped_graph = _search(state.placing(), state.unrewritten, floors)
        except Exception as err:
            raise _unsupported(report, err) or err
    _log_verdict(state, placement, shipped_graph)


def recheck(state: SearchState) -> None:
    """A placement the log holds with an unsure verdict (the final check ran beside other
    work): the final check runs again on it, and the log keeps the new verdict."""
    if not state.recheck or state.placement is None:
        return
    report = state.report
    logger.warning("the placement log's verdict on this model was timed beside other work: "
                   "checking it again")
    floors = _floors(state.user_file, state.backends, state.target, state.options.accuracy,
                     state.input_shapes, state.graph.func, report)
    remote = bool(state.options.rpc_tracker)  # judged where the search measured
    with use_tuning_db(state.tuning):
        try:
            p = state.placing()
            judge = _remote_judge(p) if remote else None  # as ``_judged_there``
            placement, shipped_graph = _final_check(p, state.placement, floors, judge=judge)
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
    record = placement_record(placement, shipped_graph, state.target, report.comparison,
                              report.shipped, report.graph_level)
    record["other_load"] = report.other_load
    record["alternates"] = report.alternates
    if report.other_load > BUSY_SHARE:
        record["unsure"] = True
    if report.whole_model:  # the user's model file, whole on a library, won
        lib = report.whole_model["backend"]
        whole = _floor_module(lib, state.user_file, state.input_shapes, graph)
        if whole is not None:
            state.log.put(state.key, {**record, "whole_model": lib})
            report.ops_per_backend = {lib: len(graph)}
            logger.info("collage: %s", report.summary())
            state.done = state.result(placement=placement, module=whole)
            return
        # (it ran in the final check a moment ago; nothing is lost if it no longer loads)
        report.whole_model, report.shipped = {}, "tvm-only"
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


#: The search, stage by stage (``_search`` holds the stages of a new placement: candidates,
#: costs, op level, carve/refine/calibrate, graph level, final check).
STAGES = (import_model, rewrite_graph, open_stores, from_log, recheck, search_placement, finish)


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


@dataclass
class Placing:
    """What the stages of a new placement (``_search``) share: the graph they place, the
    backends it may run on, the target, the cost DB, the search's options, and the report
    each stage writes its record into. ``on(...)``: the same with some of them changed (the
    unrewritten graph, the f32 backends, a report of its own)."""

    graph: DataflowGraph
    backends: dict
    target: tvm.target.Target
    cost_db: CostDB
    options: SearchOptions
    report: BuildReport
    devices: RemoteDevices | None = None  # the search's RPC servers (``SearchState.remote``)

    def on(self, **changed) -> Placing:
        return dataclasses.replace(self, **changed)


def _search(p: Placing, unrewritten=None, floors: dict | None = None) -> tuple:
    """Both levels of the search and the final check, for a placement not in the log.
    Returns (placement, the graph its groups refer to). ``unrewritten``: the model's graph
    before the rewrites; the final check times its op-level placement too (costs from the
    rewrite search's measurements), and ships it if it is faster. ``floors``: the user's
    model file whole on each graph library (``_floors``); one that wins is named in
    ``report.whole_model``."""
    work = _op_level(p)
    if p.report.measured_elsewhere:
        return _judged_there(p, work.placement, floors or {})
    op_level = _calibrated(p, work)
    placement = _graph_level(p, op_level) if p.options.graph_level else op_level
    if p.options.compare:
        others = {}
        if unrewritten is not None:
            t0 = time.perf_counter()
            others["collage-unrewritten"] = (unrewritten, _op_level(
                p.on(graph=unrewritten, report=BuildReport(backends=[]))).placement)
            p.report.times["unrewritten"] = time.perf_counter() - t0
        return _final_check(p, placement, floors or {},
                            op_level if placement is not op_level else None, others)
    if _reduced(placement, p.backends):
        return _within_budget(p, placement, floors)
    return placement, p.graph


def _unjudged(p: Placing, placement):
    """``placement`` as the search placed it, for a search whose candidates were measured
    on RPC servers of another kind than this machine (``report.measured_elsewhere``) and
    whose final check is off or could not run on them (``_judged_there``): shipped
    unjudged end to end, with the reason in the report (the graph level's too, where it
    could not run there either)."""
    report = p.report
    why = (f"the candidates were measured on the RPC servers' device "
           f"({report.measured_elsewhere}), not on this machine ({device_fingerprint(p.target)})"
           f", and whole builds are not run there "
           f"({'the servers could not judge them' if p.options.compare else 'compare is off'})")
    logger.warning("%s: shipping the placement by their measurements, unjudged end to end",
                   why)
    if p.options.graph_level and not report.graph_level:
        report.graph_level = {"skipped": why}
    if p.options.compare:
        report.floor = f"the final check is off: {why}"
    if _reduced(placement, p.backends):
        logger.warning("reduced-precision groups in the placement: their outputs were not "
                       "checked against f32 (that runs whole builds too)")
    return placement


def _judged_there(p: Placing, placement, floors: dict) -> tuple:
    """The graph level and the final check of a search measured on RPC servers of another
    kind than this machine, run on them (``check.remote``): each placement the graph level
    tries is built and timed on a server; the final check times the placement beside the
    single-backend builds and the user's model file on each graph library on one. (The
    calibration is not run there yet: the op-level placement is not calibrated.) Where no
    server can judge, ``_unjudged``."""
    from .check.remote import remote_evaluator

    op_level = placement
    if p.options.graph_level:
        try:
            placement = _graph_level(p, placement, remote_evaluator(
                p.devices, p.graph, p.backends, p.target, p.options.accuracy, placement.groups))
        except RemoteError as err:  # the final check may still run
            logger.warning("the graph level cannot run on the RPC servers: %s", first_line(err))
            p.report.graph_level = {"skipped": f"no RPC server to run it: {first_line(err)}"}
            placement = op_level
    if not p.options.compare:
        return _unjudged(p, placement), p.graph
    judge = _remote_judge(p)
    try:
        return _final_check(p, placement, floors,
                            op_level if placement is not op_level else None, judge=judge)
    except Exception as err:  # noqa: BLE001 - the search's placement ships, unjudged
        logger.warning("the final check on the RPC servers failed: %s", first_line(err))
        return _unjudged(p, placement), p.graph


def _remote_judge(p: Placing):
    """The final check's ``judge`` on the search's RPC servers (``check.remote``)."""
    from .check.remote import remote_judge

    return remote_judge(p.devices, p.graph, p.backends, p.target, p.options.accuracy,
                        (p.report.lean or {}).get("alone_ms"))


def _final_check(p: Placing, placement, floors: dict, op_level=None, others=None,
                 judge=None) -> tuple:
    """``never_slower``'s verdict on ``placement``, written into the report (``judge``:
    where the builds are judged, ``_judged_there``). Returns (the placement to ship, the
    graph its groups refer to)."""
    report = p.report
    verdict = never_slower(p.graph, placement, p.backends, p.target, op_level,
                           accuracy=p.options.accuracy, others=others, floors=floors,
                           alone_ms=(report.lean or {}).get("alone_ms"), judge=judge)
    report.shipped, report.comparison = verdict.shipped, verdict.comparison
    report.alternates = [{"backend": b, "ms": ms, **({"source": src} if src else {})}
                         for b, ms, src in verdict.alternates]
    report.whole_model = {}
    if verdict.floor:
        report.whole_model = {"backend": verdict.floor, "floor": True,
                              "why": "the model file run whole by it was the fastest "
                                     "correct build"}
    report.times["compare"] = verdict.seconds
    report.other_load = verdict.other_load
    # A model file that won ships whole; the log keeps the placement it beat (checked
    # against it again when the verdict is unsure).
    return (placement if verdict.floor else verdict.placement), verdict.graph


OUTSIDE_BUDGET = "collage, reduced precision (outside the accuracy budget)"


def _reduced(placement, backends) -> bool:
    return any(backends[g.backend].precision != "f32" for g in placement.groups)


def _within_budget(p: Placing, placement, floors: dict | None = None) -> tuple:
    """A placement with reduced-precision groups, checked against TVM alone in f32 on the
    random inputs of ``CHECK_SEEDS`` (``compare=True`` does this beside its timings). One
    outside the accuracy budget is not shipped: the search runs again on f32 backends.
    Returns (placement, graph) as ``_search`` does."""
    t0 = time.perf_counter()
    report = p.report
    reference = tvm_reference(p.graph, p.backends, p.target, CHECK_SEEDS)
    exe, _ = compile_placement(p.graph, placement.groups, p.backends, p.target)
    result = {"ms": math.nan,  # checked, not timed
              **p.options.accuracy.check_seeds(outputs_on(exe, p.graph, p.target, CHECK_SEEDS),
                                               reference)}
    report.times["accuracy"] = time.perf_counter() - t0
    if result["match"]:
        report.comparison = {"collage": result}
        return placement, p.graph
    logger.warning("the placement's error (%.3g of the output scale) breaks the accuracy "
                   "budget %s: searching again with f32 backends only", result["rel_err"],
                   p.options.accuracy)
    report.comparison = {OUTSIDE_BUDGET: result}
    report.shipped = "collage on the f32 backends (the reduced-precision placement broke the budget)"
    f32 = {n: b for n, b in p.backends.items() if b.precision == "f32"}
    return _search(p.on(backends=f32),
                   floors={n: f for n, f in (floors or {}).items() if f.backend in f32})


def _op_level(p: Placing) -> OpLevel:
    """The op-level stage (``placer.op_stage``) with a ``Measurer`` whose TVM candidates use
    the active tuning database; a search whose RPC servers are of another kind than this
    machine is marked ``measured_elsewhere``."""
    t0 = time.perf_counter()
    tuning = active_database()
    measurer = Measurer.from_options(p.target, p.cost_db, candidate_vm_for(tuning), p.options,
                                     tuning=tuning, remote=p.devices)
    if measurer.remote is not None and measurer.device != device_fingerprint(p.target):
        p.report.measured_elsewhere = measurer.device
    try:
        work, dp_s = op_stage.op_level(p, measurer)
    finally:
        measurer.close()
    op_stage.record(p.report, measurer, work, dp_s, t0)
    return work


def _calibrated(p: Placing, work: OpLevel) -> Placement:
    """``placer.op_stage.calibrated``, its runs of the whole placement through BYOC."""
    return op_stage.calibrated(p, work, lambda: placement_runner(p.graph, p.backends, p.target))


def _graph_level(p: Placing, placement, evaluate=None):
    """The graph-level evolutionary search (``placer.graph_level``) from ``placement``: its
    best placement when that beat the seed end to end, else ``placement``. ``evaluate``:
    how a placement is judged (``check.remote.remote_evaluator``), else built and timed
    here (``latency_evaluator``)."""
    report = p.report
    libs = {n: b for n, b in p.backends.items() if b.kind == "graph"}
    if not libs:
        logger.warning("--graph-level: no graph library among the backends (%s); skipped",
                       ", ".join(p.backends))
        report.graph_level = {"skipped": "no graph library among the backends"}
        return placement
    t0 = time.perf_counter()
    gl = GraphLevelSearch(p.graph, placement, libs, evaluate or latency_evaluator(
        p.graph, p.backends, p.target, p.options.accuracy), call_ms=report.epsilon)
    timed = _timed_anyway(p, gl, placement)
    if timed:
        logger.info("graph-level: skipped: %s", timed)
        report.graph_level = {"libraries": sorted(libs), "genes": gl.n_genes,
                              "eligible_groups": len(gl.eligible), "skipped": timed}
        return placement
    res = gl.run(budget_s=p.options.budget, on_generation=p.options.on_generation)
    report.times["graph-level"] = time.perf_counter() - t0
    report.graph_level = {"libraries": sorted(libs), "genes": gl.n_genes,
                          "eligible_groups": len(gl.eligible), "seed_ms": res.seed_ms,
                          "best_ms": res.best_ms, "evaluated": res.evaluated,
                          "bounded": res.bounded,
                          "invalid": len(res.invalid), "stopped": res.stopped,
                          "history": res.history,
                          "invalid_reasons": sorted(set(res.invalid.values()))[:10]}
    if not res.best_ms < res.seed_ms:
        return placement
    return res.placement


def _timed_anyway(p: Placing, gl: GraphLevelSearch, placement) -> str:
    """Why the graph level can be left out: every placement its genes reach (a few
    groups' worth) is one the final check builds and times anyway (the op-level placement
    and the single-backend builds: a one-operator model's graph level only ever builds
    those); "" when it cannot (no final check, more to reach, or a placement of its own)."""
    if not p.options.compare or gl.n_genes == 0:
        return ""
    reach = gl.reachable()
    if reach is None:
        return ""
    timed = {gl.key(groups) for groups in single_backend_builds(p.graph, p.backends).values()}
    if not reach <= timed | {gl.key(placement.groups)}:
        return ""
    return (f"each of the {len(reach)} placements it can reach is a build the final check "
            "times anyway")


def optimize(model, target="llvm", backends=None, db=None, *, options: SearchOptions | None = None,
             placement_log=None, example_inputs=None, input_shapes=None, tuning_db=None,
             **option_fields) -> CollageResult:
    """Search a placement for ``model`` and build it.

    ``model``: ONNX path/ModelProto, torch.nn.Module (with ``example_inputs``) or IRModule.
    ``db``: cost DB path (default ``~/.cache/collage-tvm/costs.db``) or a ``CostDB``.
    ``placement_log``: path or ``PlacementLog`` (default: next to the DB).
    ``input_shapes``: input name -> static shape, for an ONNX model with dynamic inputs.
    ``tuning_db``: the tuning database TVM's kernels use (default: the one next to the cost
    DB, see ``collage_tvm.tune``).
    Search options (``SearchOptions``): ``options=`` and/or its fields by name
    (``backends``, ``graph_level=True``, ``budget=120``, ``compare=True``, ...).
    """
    options = SearchOptions.of(options, backends=backends, **option_fields)
    options = _own_precision(model, options)
    dynamic = _dynamic(model, target, options, db, placement_log, tuning_db, input_shapes,
                       example_inputs)
    if dynamic is not None:
        return dynamic
    found = search(model, target, options, db, placement_log, example_inputs, input_shapes,
                   tuning_db)
    with use_tuning_db(found.tuning):
        executable, lowered = _compile(found)
    _let_go()
    return CollageResult(executable, lowered, found.placement, found.graph, found.report,
                         found.target, found.model_file)


def _own_precision(model, options: SearchOptions) -> SearchOptions:
    """``options`` with the budget a quantized ONNX model is judged by
    (``precision.model_budget``: its own int8 precision, not f32 rounding) where the
    user left the strict default."""
    from .precision import model_budget

    if not options.accuracy.strict:
        return options
    header = None
    if isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".onnx"):
        import onnx

        try:
            header = onnx.load(os.fspath(model), load_external_data=False)
        except Exception:  # noqa: BLE001 - load_model names what is wrong
            return options
    elif type(model).__name__ == "ModelProto":
        header = model
    budget, why = model_budget(options.accuracy, header)
    if not why:
        return options
    logger.warning("%s", why)
    return dataclasses.replace(options, accuracy=budget)


def _dynamic(model, target, options, db, placement_log, tuning_db, input_shapes,
             example_inputs):
    """The build of an ONNX model with dynamic dimensions that ``input_shapes`` leaves
    dynamic (``collage_tvm.dynamic``): it serves every shape of its ranges; None for a
    static model, one the given shapes fix, or one no graph library among the backends runs
    (TVM's build over symbolic shapes then, as before)."""
    from .dynamic import dynamic_model
    from .dynamic.search import optimize_dynamic

    found = dynamic_model(model, options.shapes, input_shapes)
    if found is None:
        return None
    proto, path, ranges = found

    def static(shapes):  # Collage's build at the optimum's shapes
        return optimize(model, target, options=options, db=db, placement_log=placement_log,
                        input_shapes=shapes, tuning_db=tuning_db, example_inputs=example_inputs)

    result = optimize_dynamic(proto, path, ranges, target, options, static,
                              open_placement_log(placement_log, open_db(db)),
                              lambda backends: BuildReport(backends=backends))
    if result is not None:
        result = CollageResult(*result)
    if result is None:
        logger.warning("no graph library among the backends runs the model file: TVM builds "
                       "it over symbolic shapes (add onnxruntime or openvino to serve the "
                       "range with their kernels)")
    return result


def _compile(found: SearchResult) -> tuple:
    """(executable, lowered module) of the search's placement; TVM alone if it fails."""
    t0 = time.perf_counter()
    executable = lowered = None
    if found.graph is not None:
        try:
            executable, lowered = compile_placement(found.graph, found.placement.groups,
                                                    found.backends, found.target, keep=True)
        except Exception as err:  # noqa: BLE001 - nothing is lost: TVM alone still builds it
            why = first_line(err)
            logger.warning("the placement failed to compile (%s); building with TVM alone", why)
            found.report.kept_on_tvm.append(f"the whole model: the placement failed to compile: {why}")
            found.report.shipped = "tvm-only"
    if executable is None:
        try:
            executable, lowered = compile_module(found.module, found.target), found.module
        except Exception as err:
            raise _unsupported(found.report, err) or err
    found.report.times["compile"] = time.perf_counter() - t0
    return executable, lowered


class UnsupportedOperator(ModelError):
    """No backend can run some operators of the model: TVM could not build them, and no
    other backend offered to (or could) run them."""


def _unsupported(report: BuildReport, err: BaseException) -> UnsupportedOperator | None:
    """The clear error for a build that failed (``err``) where some nodes had no backend
    that could run them alone (TVM's candidate failed too): it names them."""
    if not report.unrunnable:
        return None
    return UnsupportedOperator(
        f"no backend of {', '.join(report.backends)} can run "
        f"{', '.join(sorted(set(report.unrunnable)))}: TVM fails on it "
        f"({first_line(err)}) and no other backend offers to run it")


def optimize_module(mod, target, options: SearchOptions, db=None, placement_log=None):
    """(the partitioned module with external groups lowered, the tuning database whose
    records its TVM kernels use or None), for ``collage_tvm.pipeline``."""
    found = search(mod, target, options, db, placement_log)
    if found.graph is None:
        return found.module, found.tuning
    lowered = lower_placement(found.graph, found.placement.groups, found.backends)
    _let_go()
    return lowered, found.tuning


def _let_go() -> None:
    """Once the shipped build is made: the contenders that lost hold their libraries' copies
    of the weights in the lowering cache, gigabytes for a large model, kept for nothing (the
    shipped build's own callables live on with it)."""
    forget_lowered()
    release_memory()


def build(model, target="llvm", backends=None, db=None, **kwargs):
    """Build ``model`` with Collage: the returned executable runs in ``relax.VirtualMachine``.
    Arguments as ``optimize``."""
    return optimize(model, target, backends, db, **kwargs).executable
