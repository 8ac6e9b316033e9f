"""What a build found and how it went: ``BuildReport`` (every stage writes its record into
it), ``SearchResult`` (the search's answer), ``CollageResult`` (the built answer, what
``collage_tvm.optimize`` returns), and the error for a model no backend can run."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import tvm

from .check import first_line
from .frontend import ModelError
from .graph import DataflowGraph
from .placement import Placement


@dataclass
class BuildReport:
    backends: list
    skipped: dict = field(default_factory=dict)      # backend -> reason it was left out
    candidates: int = 0
    distinct_measured: int = 0
    db_hits: int = 0
    failures: list = field(default_factory=list)
    # backend -> why: a library that crashed its measuring process on this model (SIGSEGV,
    # ...): it runs no whole build, graph-level region or model file in the search's process
    crashed: dict = field(default_factory=dict)
    kept_on_tvm: list = field(default_factory=list)  # ops no candidate could be measured for
    unrunnable: list = field(default_factory=list)  # those nodes: "op -> dtype" each
    call_overhead: dict = field(default_factory=dict)  # backend -> ms per call (epsilon)
    switch_cost: dict = field(default_factory=dict)  # (a, b) -> ms per change of runtime
    alternative_covers: int = 0  # covers within 75% of the chosen one, re-timed (refine)
    carved: dict = field(default_factory=dict)  # regions cut around TVM kernels (_carve)
    # measuring only what can win (placer.lean.LeanReport): measured, known, skipped, rounds
    lean: dict = field(default_factory=dict)
    side_by_side: int = 0  # sets of candidates re-timed side by side in this build
    calibration: list = field(default_factory=list)  # in-context rounds (placer.calibrate)
    placement_from_log: bool = False
    estimated_ms: float = math.nan
    ops_per_backend: dict = field(default_factory=dict)
    times: dict = field(default_factory=dict)        # stage -> seconds
    # the final check's contenders: build name -> ``check.contender.Contender``
    comparison: dict = field(default_factory=dict)
    shipped: str = "collage"                         # which build was shipped
    graph_level: dict = field(default_factory=dict)  # the evolutionary search: history, counts
    rewrite: dict = field(default_factory=dict)      # the rewrite search: applied, costs, counts
    tuning: dict = field(default_factory=dict)       # the tuning database used: path, records
    precision: dict = field(default_factory=dict)    # budget, and per precision why (not) used
    # TVM cannot import the model: it runs whole on the graph library that can (fastest):
    # {"backend", "why"[, "timed"]} (``check.floors.whole_on_a_library``).
    whole_model: dict = field(default_factory=dict)
    # The graph library whose run of the user's model file (a floor) won the final check,
    # shipped as the build; "" when Collage's placement (or another build) shipped.
    shipped_floor: str = ""
    # Why the user's model file was not among the final check's contenders ("" if it was).
    no_floor: str = ""
    # The shipped build runs one file whole on a graph library, and others ran it (or the
    # user's model file, "source": "model file") within a few percent in the final check:
    # {"backend", "ms"[, "source"]} each, raced by the saved build's first calls where it
    # is served (``check.race``; ``check.floors.alternates``).
    alternates: list = field(default_factory=list)
    # The share of the machine's CPU other processes took during the final check: above
    # ``measure.other_load.BUSY_SHARE`` its verdict is logged as unsure and checked again.
    other_load: float = math.nan
    rechecked: bool = False  # the placement log's unsure verdict was checked again
    # The RPC servers' device, where it is not this machine's (a search for a device of
    # another kind): whole builds were not run here (``_unjudged``).
    measured_elsewhere: str = ""
    # A model with dynamic dimensions (``collage_tvm.dynamic``): its ranges, the choice at
    # each representative point, the static build's specialization; {} for a static model.
    dynamic: dict = field(default_factory=dict)
    # The placement's concurrent schedule (``collage_tvm.schedule``, issue #80): the plan's
    # figures (``Plan.summary``), whether its build entered the final check and shipped,
    # or why no schedule was planned; {} when none was asked for.
    schedule: dict = field(default_factory=dict)

    def summary(self) -> str:
        if self.placement_from_log:
            return "placement found in the placement log: measured nothing"
        if self.distinct_measured == 0 and self.side_by_side == 0:
            return f"all {self.db_hits} costs found in the cost DB: measured nothing"
        side = (f"; re-timed {self.side_by_side} sets of alternative covers side by side"
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


class UnsupportedOperator(ModelError):
    """No backend can run some operators of the model: TVM could not build them, and no
    other backend offered to (or could) run them."""


def unsupported(report: BuildReport, err: BaseException) -> UnsupportedOperator | None:
    """The clear error for a build that failed (``err``) where some nodes had no backend
    that could run them alone (TVM's candidate failed too): it names them."""
    if not report.unrunnable:
        return None
    return UnsupportedOperator(
        f"no backend of {', '.join(report.backends)} can run "
        f"{', '.join(sorted(set(report.unrunnable)))}: TVM fails on it "
        f"({first_line(err)}) and no other backend offers to run it")
