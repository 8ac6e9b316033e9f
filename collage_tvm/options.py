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
class SearchOptions:
    """How Collage searches a placement (DESIGN.md's data flow, one build)."""

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
    # Before placement, the verified graph rewrites (``collage_tvm.rewrite``; today: a
    # convolution's per-channel affine tail folded into its weights).
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
    # Rounds of side-by-side re-timing of the op-level placement's close calls, each
    # followed by a DP re-run (``placer.alternatives.refine``); 0 turns it off.
    refine_rounds: int = _rounds("|refined", 2)
    # Rounds of in-context calibration of the op-level placement (``placer.calibrate``).
    calibrate_rounds: int = _rounds("|calibrated", 4)
    # Seconds the graph-level search may take; the rewrite search (rewrite=True) too.
    budget: float = _not_key(DEFAULT_BUDGET, "a bound on the search's time; the placement found "
                             "within it stands for later builds")
    # Time the placement end to end beside every single-backend build and the user's model
    # file run whole by each graph library; ship the fastest correct one.
    compare: bool = _not_key(True, "judges a placement after the search; the logged "
                             "record keeps the verdict")
    # Measure in a child process (a crashing backend costs inf, not the search).
    isolate: bool = _not_key(True, "where measuring runs, not what it finds")
    # Processes that build the TVM candidates before they are timed (``Measurer.prebuild``);
    # None: ``default_build_jobs`` (a GPU target, or 8 cores and more: one per core).
    build_jobs: int | None = _not_key(None, "where candidates are built, not what they cost")
    # Measure on the TVM RPC servers registered under ``rpc_key`` at the tracker
    # ``rpc_tracker`` ("HOST:PORT"; ``collage_tvm.measure.remote`` starts a server): the
    # candidates spread over them, their costs keyed by the servers' device. The graph
    # level, the calibration and the final check still time on this machine.
    rpc_tracker: str = _not_key("", "where measuring runs; the servers' kind is rpc_key")
    rpc_key: str = field(default="", metadata={"key": lambda v: f"|rpc={v}" if v else ""})
    # A model with dynamic dimensions: per input, the range it is built for, as TensorRT's
    # profiles ("input_ids=1x1:1x128:8x512": min, opt, max; one shape: that shape alone),
    # a list of such strings or {name: (min, opt, max)}; the axes not given get defaults
    # read from the model (``collage_tvm.dynamic.shapes``).
    shapes: tuple = _not_key((), "the search runs at the optimum's static shapes, keyed by "
                             "them; the choice per shape is keyed by the ranges")
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
        for name in ("refine_rounds", "calibrate_rounds"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.build_jobs is not None and int(self.build_jobs) < 0:
            raise ValueError(f"build_jobs must be >= 0 (0: build where timed), got "
                             f"{self.build_jobs}")
        if self.budget <= 0:
            raise ValueError(f"budget must be > 0 seconds, got {self.budget}")
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
