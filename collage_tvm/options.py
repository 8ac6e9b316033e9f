"""What a search takes, in one object: ``build``, ``optimize``, ``pipeline``, the CLI and the
bench all pass a ``SearchOptions``.

Each field declares whether it changes which placement the search finds, and so belongs to
the placement-log key (``key_variant``), or why not. A field without that declaration is
an error the first time a key is made (and a test), so a new option cannot be forgotten
in the key.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

from .precision import parse_accuracy

# Seconds of graph-level search (and of rewrite search) when none is given: a small model
# saturates well within it; a paper-size one gets about a dozen generations.
DEFAULT_BUDGET = 60.0


def _flag(token: str, default: bool):
    """A switch that changes the search; in the key as ``token`` when on."""
    return field(default=default, metadata={"key": lambda v: token if v else ""})


def _rounds(token: str, default: int):
    """A number of rounds that changes the search; in the key as ``token<n>`` when not 0."""
    return field(default=default, metadata={"key": lambda v: f"{token}{v}" if v else ""})


def _not_key(default, why: str):
    """A field that does not change which placement is found (``why`` says why)."""
    return field(default=default, metadata={"key": None, "why": why})


def _shape_specs(shapes) -> tuple:
    """``SearchOptions.shapes`` as ((name, (min, opt, max)), ...), from "NAME=MIN:OPT:MAX"
    strings, a dict, or that tuple itself (``collage_tvm.dynamic.shapes.parse_shapes``)."""
    from .dynamic.shapes import ShapeError, parse_shapes

    if not shapes:
        return ()
    if isinstance(shapes, str):
        shapes = [shapes]
    if isinstance(shapes, dict):
        items = []
        for name, value in shapes.items():
            if isinstance(value, str):
                items.append((name, parse_shapes([f"{name}={value}"])[name]))
            else:
                if value and not isinstance(value[0], (tuple, list)):
                    three = (tuple(int(d) for d in value),) * 3
                else:
                    three = tuple(tuple(int(d) for d in s) for s in value)
                if len(three) != 3:
                    raise ShapeError(f"shapes[{name!r}]: expected (min, opt, max) shapes or "
                                     f"one shape, got {value!r}")
                items.append((name, three))
        return tuple(items)
    items = list(shapes)
    if all(isinstance(i, str) for i in items):
        return tuple(parse_shapes(items).items())
    return tuple((name, tuple(tuple(s) for s in three)) for name, three in items)


@dataclass(frozen=True)
class FinalCheck:
    """The final check's thresholds (``check.never_slower``), in one object passed in: a
    test that needs other rounds or pauses makes its own. Each figure's evidence is beside
    it."""

    # A build whose first run is this many times slower than the Collage placement's is
    # timed once (it cannot win; an untuned TVM build of a big model takes minutes per run).
    slow_build_factor: float = 10.0
    # A "<lib>+tvm" build whose TVM kernels do at least this share of the model's FLOPs is
    # judged by tvm-only's time (``never_slower._hopeless_like_tvm_only``).
    hopeless_share: float = 0.9
    # A single-backend build that by the search's measurements takes at least this many
    # times the placement's first time is not built (``_hopeless_by_estimate``): the
    # re-timing takes the builds within 2x of the fastest, so it could not win; a margin
    # over that for the estimate's noise ...
    alone_factor: float = 2.5
    # ... and at least this many ms: a build that quick costs little to build and time, and
    # an estimate (call overheads left out) is least sure where they are most of the time.
    alone_min_ms: float = 1.0
    # A final check timed while other processes took over ``retry_share`` of the CPU times
    # its contenders again once, after ``busy_retry_s``, those within ``busy_factor`` of the
    # fastest (wider than the first re-timing's 2x: a build timed in a busy stretch can read
    # several times its speed). The timm suite's vit_tiny_patch16_224 under --accuracy bf16
    # on the Xeon had 14% of the CPU go to other guests while the model file on OpenVINO
    # timed 29.3 ms against 21.6 for the import on ONNX Runtime, which shipped; the row's
    # interleaved timing then had 17.9 and 20.4.
    retry_share: float = 0.10
    busy_retry_s: float = 10.0
    busy_factor: float = 4.0
    # The runoff (``check.runoff``): contenders within ``runoff_margin`` of the fastest after
    # the re-timing, timed in ``runoff_rounds`` rounds. A close call the runoff leaves open
    # is timed on, ``runoff_step`` rounds at a time, up to ``runoff_max_rounds`` (the rounds
    # a suite row's close figures get). A large model's single-call batches swing by ~10% a
    # round on a shared VM: 15 rounds leave a standard error of ~3% on the ratio of two
    # builds, as large as the gaps between the libraries' whole-model runs the check ranks.
    runoff_margin: float = 0.10
    runoff_rounds: int = 15
    runoff_max_rounds: int = 45
    runoff_step: int = 10
    # Two builds surely within this share of each other need no more rounds: either ships
    # within the 0.97x the suites hold Collage to.
    same_share: float = 0.03
    # A contender whose fastest batch (of ``timing.DROP_AFTER`` or more) is over this share
    # slower than the leader's median is timed no further: the rounds go to the builds that
    # can still win.
    drop_margin: float = 0.05
    # A round's batch of each build lasts ``batch_ms``; where the fastest build's call takes
    # microseconds, ``batch_calls`` of them and at least ``short_batch_ms``. A 6-us model's
    # 200-ms batch is 33,000 calls: the verdict rests on the rounds, paired, and their count
    # stays; shorter batches put a round's builds closer in time.
    batch_ms: float = 200.0
    short_batch_ms: float = 50.0
    batch_calls: int = 1000
    # What one build of a model holds, in multiples of its weights' bytes: an ONNX Runtime
    # session of torchvision's vit_b_32 took 1.8x, an OpenVINO model compiled from it 2.5x,
    # OpenVINO's bf16 compile 3x; at 5x, with the builds' pages given back after the check,
    # ViT-L/32's check under bf16 peaked at 19.9 GB of 24 (``check.memory``).
    build_holds: float = 5.0
    # The builds that run the shipped build's file whole on another graph library within
    # this share of it are raced again by the saved build's first calls where it is
    # served (``check.race``): the check runs in the process that searched, a build is served
    # elsewhere, and two libraries 2-10% apart here were ranked the other way round in a
    # suite row's timing process (docs/COVERAGE.md): the runoff's margin.
    at_load_share: float = 0.10


@dataclass(frozen=True)
class Evolution:
    """The graph level's evolutionary search (``placer.graph_level.GraphLevelSearch.run``):
    ``population`` individuals a generation, crossover and mutation probabilities
    (``cxpb``, ``mutpb``: DEAP's ``varAnd``), ``immigrants`` fresh random individuals a
    generation, and ``patience``: generations without a 0.1% gain before it stops."""

    population: int = 12
    patience: int = 5
    cxpb: float = 0.6
    mutpb: float = 0.4
    immigrants: int = 2

    def __post_init__(self):
        if int(self.population) < 2 or int(self.patience) < 1 or int(self.immigrants) < 0:
            raise ValueError(f"evolution: population must be >= 2, patience >= 1 and "
                             f"immigrants >= 0, got {self}")
        if not (0.0 <= self.cxpb <= 1.0 and 0.0 <= self.mutpb <= 1.0):
            raise ValueError(f"evolution: cxpb and mutpb are probabilities (0..1), got {self}")

    def key(self) -> str:
        """Its part of the placement-log key: "" at the defaults (the keys of logs written
        before it was an option stay as they were)."""
        if self == Evolution():
            return ""
        return "|evolution=" + ",".join(f"{f.name}={getattr(self, f.name)}"
                                       for f in dataclasses.fields(self))


# ``SearchOptions.schedule``'s values, the default first.
SCHEDULES = ("auto", "concurrent", "sequential")

# The settings a check takes when none are passed (``SearchOptions.final_check``).
DEFAULT_FINAL_CHECK = FinalCheck()


def final_check_settings(settings: FinalCheck | None = None) -> FinalCheck:
    """``settings``, or the default ones."""
    return settings if settings is not None else DEFAULT_FINAL_CHECK


@dataclass(frozen=True)
class SearchOptions:
    """How Collage searches a placement (docs/DESIGN.md's data flow, one build)."""

    # Backends to place on; ``tvm`` is always added. Unavailable ones are skipped with a
    # reason. Empty (the default): every registered backend for the target's device that
    # loads on this machine (``registry.resolve_backends``).
    backends: tuple = _not_key((), "in the key as each resolved backend's name "
                               "and library version (build.placement_key)")
    # The op-level DP charges the measured cost of changing runtime between consecutive
    # kernels (``Measurer.switch_costs``); False: the paper's additive model.
    switching: bool = _flag("|switching", True)
    # After the op-level DP, the evolutionary graph-level placer over the graph libraries.
    graph_level: bool = _flag("|graph-level", True)
    # Before placement, the verified graph rewrites (``collage_tvm.rewrite``: TASO-style
    # substitutions proved with z3, a cost-based backtracking search over them).
    rewrite: bool = _flag("|rewrite", False)
    # TVM's kernels built with the tuning database's records (``collage-tvm tune``), when
    # it has any; False: untuned TVM, as if no tuning had happened. The records themselves
    # are in the key too (``build.placement_key``).
    tuning: bool = field(default=True, metadata={"key": lambda v: "" if v else "|untuned"})
    # The accuracy budget (``collage_tvm.precision``): "f32" (strict, every candidate
    # f32), "bf16" (bf16 variants of the named libraries too, the build within 2e-2 of the
    # output scale) or a tolerance. In the key when not strict.
    accuracy: object = field(default="f32", metadata={"key": lambda v: v.key()})
    # Measure only what the op-level DP can still choose on the floors of the rest
    # (``placer.lean``; the default: docs/BENCHMARKS.md "Search time" has what it saves);
    # False: measure every candidate before the
    # DP, as the paper does. In the key when off (a log written before it was the default,
    # by a search that measured everything, still answers: its placement is the one the
    # floors approximate).
    lean: bool = field(default=True, metadata={"key": lambda v: "" if v else "|measure-all"})
    # Rounds of side-by-side re-timing of the op-level placement's alternative covers, each
    # followed by a DP re-run (``placer.alternatives.refine``); 0 turns it off.
    refine_rounds: int = _rounds("|refined", 2)
    # Rounds of in-context calibration of the op-level placement (``placer.calibrate``).
    calibrate_rounds: int = _rounds("|calibrated", 4)
    # The graph level's evolutionary search: population, patience, crossover and mutation
    # probabilities (``Evolution``); in the key when not the defaults.
    evolution: Evolution = field(default_factory=Evolution, metadata={"key": lambda v: v.key()})
    # Seconds the graph-level search may take; the rewrite search (rewrite=True) too.
    budget: float = _not_key(DEFAULT_BUDGET, "a bound on the search's time; the placement found "
                             "within it stands for later builds")
    # Time the placement end to end beside every single-backend build and the user's model
    # file run whole by each graph library; ship the fastest correct one.
    compare: bool = _not_key(True, "judges a placement after the search; the logged "
                             "record keeps the verdict")
    # Independent regions run at the same time (``collage_tvm.schedule``, issue #80):
    # "auto" (the default) plans the placement's schedule from measured stages and, where a
    # concurrent stage measured faster, the final check times that build beside the
    # sequential one and ships it only when faster end to end; "concurrent" ships it
    # whenever the plan has a concurrent stage and its outputs match (the other builds
    # timed beside it for the report, not judged against it); "sequential" plans
    # none. In the key when not "auto" (a placement log's record holds its stages).
    schedule: str = field(default="auto", metadata={
        "key": lambda v: "" if v == "auto" else f"|schedule={v}"})
    # Measure in a child process (a crashing backend costs inf, not the search).
    isolate: bool = _not_key(True, "where measuring runs, not what it finds")
    # Processes that build the TVM candidates before they are timed (``Measurer.prebuild``);
    # None: ``default_build_jobs`` (a GPU target, or 8 cores and more: one per core).
    build_jobs: int | None = _not_key(None, "where candidates are built, not what they cost")
    # Measure on the TVM RPC servers registered under ``rpc_key`` at the tracker
    # ``rpc_tracker`` ("HOST:PORT"; ``collage_tvm.measure.remote`` starts a server): the
    # candidates spread over them, their costs keyed by the servers' device; the graph
    # level's latencies and the final check are timed on a server too (``check.remote``).
    rpc_tracker: str = _not_key("", "where measuring runs; the servers' kind is rpc_key")
    rpc_key: str = field(default="", metadata={"key": lambda v: f"|rpc={v}" if v else ""})
    # A model with dynamic dimensions: per input, the range it is built for, as TensorRT's
    # profiles ("input_ids=1x1:1x128:8x512": min, opt, max; one shape: that shape alone),
    # a list of such strings or {name: (min, opt, max)}; the axes not given get defaults
    # read from the model (``collage_tvm.dynamic.shapes``).
    shapes: tuple = _not_key((), "the search runs at the optimum's static shapes, keyed by "
                             "them; the choice per shape is keyed by the ranges")
    # The shapes a server saw, with counts (a file, a dict or a list:
    # ``collage_tvm.dynamic.weights``): default ranges widened to them, the optimum at the
    # heaviest, and the report's expected cost per call weighted by them.
    shape_weights: object = _not_key(None, "it moves the ranges and the optimum, which key "
                                     "the search and the choice per shape")
    # ``accuracy="int8"``: the inputs the quantization is calibrated on (an .npz keyed by
    # input name, each array one input or a stack of them; None: random inputs, said in the
    # report; ``collage_tvm.quantize``).
    calibration_inputs: object = _not_key(None, "it changes the quantized model, keyed by "
                                          "its content")
    # The final check's thresholds (``FinalCheck``).
    final_check: FinalCheck = field(default_factory=lambda: DEFAULT_FINAL_CHECK,
                                    metadata={"key": None, "why": "judges a placement after "
                                              "the search, as ``compare``"})
    progress: bool = _not_key(True, "display only")
    on_generation: Callable | None = _not_key(None, "a callback: sees the graph-level search")
    on_calibration: Callable | None = _not_key(None, "a callback: sees each calibration round")

    def __post_init__(self):
        backends = self.backends
        if isinstance(backends, str):
            backends = [b for b in backends.split(",") if b]
        object.__setattr__(self, "backends", tuple(backends))
        object.__setattr__(self, "accuracy", parse_accuracy(self.accuracy))
        object.__setattr__(self, "shapes", _shape_specs(self.shapes))
        from .dynamic.weights import read_shape_weights

        object.__setattr__(self, "shape_weights", read_shape_weights(self.shape_weights))
        if isinstance(self.evolution, dict):  # evolution={"population": 20}
            object.__setattr__(self, "evolution", Evolution(**self.evolution))
        for name in ("refine_rounds", "calibrate_rounds"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.build_jobs is not None and int(self.build_jobs) < 0:
            raise ValueError(f"build_jobs must be >= 0 (0: build where timed), got "
                             f"{self.build_jobs}")
        if self.budget <= 0:
            raise ValueError(f"budget must be > 0 seconds, got {self.budget}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got "
                             f"{self.schedule!r}")
        if bool(self.rpc_tracker) != bool(self.rpc_key):
            raise ValueError("measuring through an RPC tracker needs both rpc_tracker "
                             f"(HOST:PORT) and rpc_key, got {self.rpc_tracker!r} and "
                             f"{self.rpc_key!r}")

    @classmethod
    def of(cls, options: "SearchOptions | None" = None, **changes) -> "SearchOptions":
        """``options`` (default: the defaults) with ``changes``; an unknown name is a
        TypeError that lists the known ones. ``None`` values leave a field as it is."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown search option(s) {', '.join(unknown)}; "
                            f"known: {', '.join(sorted(known))}")
        base = options if options is not None else cls()
        return dataclasses.replace(base, **{k: v for k, v in changes.items() if v is not None})

    def key_variant(self) -> str:
        """The part of the placement-log key these options contribute."""
        parts = []
        for f in dataclasses.fields(self):
            if "key" not in f.metadata:
                raise TypeError(f"SearchOptions.{f.name} does not say whether it belongs to "
                                "the placement-log key (use _flag, _rounds or _not_key)")
            if f.metadata["key"] is not None:
                parts.append(f.metadata["key"](getattr(self, f.name)))
        return "".join(parts)
