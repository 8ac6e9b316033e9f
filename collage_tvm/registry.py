"""Backend registry: the data a pattern file declares (Collage paper §3, Listing 1).

A backend is a name, a kind (``op`` library or ``graph`` library), a device, a
lowering (how a chosen subgraph becomes something runnable) and what it can run:
explicit ``tvm.relax.dpl`` patterns and/or a pattern rule that the generator
expands over the model's graph.
"""
from __future__ import annotations

import importlib
import logging
import os
import runpy
import traceback
from dataclasses import dataclass, field
from typing import Callable

from .lowering import Lowering, missing_methods
from .precision import PRECISIONS, parse_accuracy
from .target import device_kind, tvm_threads

logger = logging.getLogger("collage_tvm")

KINDS = ("op", "graph")
DEVICES = ("cpu", "cuda")


class PatternFileError(Exception):
    """A pattern file could not be loaded; the message names its path and line."""


@dataclass
class PatternEntry:
    """One explicit pattern: ``check(ctx)`` may reject a match (attrs, shapes, dtypes)."""

    name: str
    pattern: object  # tvm.relax.dpl.DFPattern
    annotations: dict = field(default_factory=dict)
    check: Callable | None = None


@dataclass
class PatternRule:
    """A pattern rule (paper Fig. 4): which ops the backend runs and which groups it fuses.

    ``valid_op(node) -> bool`` says whether one node can run on the backend.
    ``fusion_rule(nodes) -> bool`` says whether a connected group of valid nodes
    (in topological order) can run as one kernel; ``None`` means single ops only.
    ``regions``: for a graph library, also offer whole regions as candidates: the graph in
    topological order cut into 1, 2, 4, ... ``2 ** regions`` equal ranges, each range's
    maximal runs of valid nodes one candidate (the whole model on the library among them),
    so the op-level DP weighs one call over a region against many small ones. 0: none.
    ``regions_only``: offer the regions alone, no single operators or fused groups: for a
    library whose every build takes seconds (``torch.compile``), where a candidate per
    operator would cost the search more than it could find (the graph-level placer still
    offloads any group of valid nodes, and the never-slower check times the whole model).
    """

    valid_op: Callable
    fusion_rule: Callable | None = None
    max_size: int = 8
    regions: int = 0
    regions_only: bool = False


@dataclass
class Backend:
    name: str
    kind: str = "op"
    device: str = "cpu"
    lowering: object = None  # Lowering instance, class or "module:Class"; None = TVM's own codegen
    # The precision it computes in (collage_tvm.precision); f32 inputs and outputs always.
    precision: str = "f32"
    # A reduced-precision backend is a variant of a library: ``--backends openvino`` with
    # a bf16 accuracy budget places on ``openvino_bf16`` too.
    variant_of: str | None = None
    patterns: list = field(default_factory=list)
    rules: list = field(default_factory=list)
    source: str | None = None  # the pattern file that registered it
    _lowering_obj: object = field(default=None, repr=False)

    def get_lowering(self):
        """The lowering object (resolved lazily so a missing library fails late, with a reason).

        Raises ``TypeError`` naming the backend when the lowering does not implement the
        interface of :class:`collage_tvm.lowering.Lowering`.
        """
        low = self._resolve()
        if low is not None:
            self._check_lowering(low)
        return low

    def _resolve(self):
        """The lowering object, made once from the spec (instance, class or "module:Class")."""
        if self._lowering_obj is None and self.lowering is not None:
            low = self.lowering
            if isinstance(low, str):
                mod_name, _, cls_name = low.partition(":")
                low = getattr(importlib.import_module(mod_name), cls_name)
            if isinstance(low, type):
                if issubclass(low, Lowering):
                    self._check_lowering(low)  # an abstract Lowering cannot be made at all
                low = low()
            self._lowering_obj = low
        return self._lowering_obj

    def _check_lowering(self, low) -> None:
        missing = missing_methods(low)
        if missing:
            what = low.__name__ if isinstance(low, type) else type(low).__name__
            raise TypeError(f"backend {self.name!r}: lowering {what} does not implement the "
                            f"lowering interface (collage_tvm.lowering.Lowering): missing "
                            f"{', '.join(missing)}")

    def available(self) -> tuple[bool, str]:
        """(True, "") or (False, reason); never raises. A reduced-precision backend on the
        CPU needs the CPU's instructions for it (``precision.cpu_precisions``)."""
        if self.precision != "f32" and self.device == "cpu":
            from .precision import cpu_precisions

            ok, why = cpu_precisions()[self.precision]
            if not ok:
                return False, f"{self.precision}: {why}"
        if self.lowering is None:
            return True, ""
        try:
            low = self._resolve()
            # A library that says it is missing is reported as missing, whatever else the
            # lowering lacks; one that is there must implement the whole interface.
            ok, why = low.available() if callable(getattr(low, "available", None)) else (True, "")
            if not ok:
                return False, why
            self._check_lowering(low)
            return True, ""
        except Exception as err:  # a missing library must not stop the build
            return False, f"{type(err).__name__}: {err}"

    def version(self) -> str:
        if self.lowering is None:
            import tvm

            # "+fused": built through TVM's CPU pipeline, fused operators one kernel
            # (collage_tvm.tuning.compile); "+tN": run on N threads (collage_tvm/__init__:
            # before, TVM's pool had half the cores). Costs measured otherwise are not reused.
            return f"tvm-{tvm.__version__}+fused+t{tvm_threads()}"
        return self.get_lowering().version()

    @property
    def is_external(self) -> bool:
        return self.lowering is not None


_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, kind: str = "op", device: str = "cpu", lowering=None,
                     replace: bool = True, precision: str = "f32",
                     variant_of: str | None = None) -> Backend:
    """Declare a backend. Re-registering replaces its patterns (a pattern file may be reloaded).

    ``lowering``: a :class:`collage_tvm.lowering.Lowering` (instance or class), a
    ``"module:Class"`` string (imported when first used), or None for TVM's own codegen.
    The built-in backends are registered first, so registering a built-in's name replaces it.
    ``precision``: what it computes in (``collage_tvm.precision.PRECISIONS``); a backend
    other than f32 is used only under an accuracy budget that allows it. ``variant_of``:
    the library it is a variant of (its backends list names the library).
    """
    ensure_builtin_backends()
    if not name or not name.replace("_", "").isalnum():
        raise ValueError(f"backend name {name!r} must be a non-empty identifier")
    if kind not in KINDS:
        raise ValueError(f"backend {name!r}: kind must be one of {KINDS}, got {kind!r}")
    if device not in DEVICES:
        raise ValueError(f"backend {name!r}: device must be one of {DEVICES}, got {device!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"backend {name!r}: precision must be one of {PRECISIONS}, "
                         f"got {precision!r}")
    if name in _BACKENDS and not replace:
        raise ValueError(f"backend {name!r} is already registered")
    backend = Backend(name=name, kind=kind, device=device, lowering=lowering,
                      precision=precision, variant_of=variant_of,
                      source=_LOADING[-1] if _LOADING else None)
    _BACKENDS[name] = backend
    return backend


def _backend(name: str) -> Backend:
    if name not in _BACKENDS:
        raise KeyError(f"unknown backend {name!r}; registered: {sorted(_BACKENDS)}")
    return _BACKENDS[name]


def add_backend_pattern(backend: str, pattern, check: Callable | None = None,
                        name: str | None = None, annotations: dict | None = None) -> PatternEntry:
    """Add an explicit ``tvm.relax.dpl`` pattern; the match's root is the group's output."""
    from tvm.relax.dpl import DFPattern

    ensure_builtin_backends()
    b = _backend(backend)
    if not isinstance(pattern, DFPattern):
        raise TypeError(f"backend {backend!r}: pattern must be a tvm.relax.dpl pattern, "
                        f"got {type(pattern).__name__}")
    entry = PatternEntry(name or f"{backend}.pattern{len(b.patterns)}", pattern,
                         dict(annotations or {}), check)
    b.patterns.append(entry)
    return entry


def add_backend_pattern_rule(backend: str, valid_op: Callable, fusion_rule: Callable | None = None,
                             max_size: int = 8, regions: int = 0,
                             regions_only: bool = False) -> PatternRule:
    """Add a pattern rule the generator expands over the graph (paper Fig. 4);
    ``regions``, ``regions_only``: see ``PatternRule``."""
    ensure_builtin_backends()
    if not callable(valid_op):
        raise TypeError(f"backend {backend!r}: valid_op must be callable")
    if not isinstance(regions, int) or not 0 <= regions <= 8:
        raise ValueError(f"backend {backend!r}: regions must be an int from 0 to 8, "
                         f"got {regions!r}")
    if regions_only and not regions:
        raise ValueError(f"backend {backend!r}: regions_only needs regions >= 1 (with no "
                         "regions it would offer nothing)")
    rule = PatternRule(valid_op, fusion_rule, max_size, regions, bool(regions_only))
    _backend(backend).rules.append(rule)
    return rule


# Prefixes of the pattern tables TVM ships -> the module that registers them on import.
TVM_PATTERN_MODULES = {
    "cublas": "tvm.relax.backend.cuda.cublas",
    "cudnn": "tvm.relax.backend.cuda.cudnn",
    "cutlass": "tvm.relax.backend.cuda.cutlass",
    "tensorrt": "tvm.relax.backend.contrib.tensorrt",
    "nnapi": "tvm.relax.backend.contrib.nnapi",
    "hipblas": "tvm.relax.backend.rocm.hipblas",
    "openclml": "tvm.relax.backend.adreno.clml",
}


def add_backend_patterns_from_tvm(backend: str, prefix: str, module=None) -> list[PatternEntry]:
    """Add TVM's own pattern table of a codegen (``FusionPattern`` s named ``<prefix>...``)
    as ``backend``'s explicit patterns, checks and annotations included, in TVM's priority
    order (highest first).

    ``module`` (a module or its dotted name) is imported first, as it registers the table;
    by default the module of a known prefix (:data:`TVM_PATTERN_MODULES`: cublas, cudnn,
    cutlass, tensorrt, ...). Raises ``ValueError`` when TVM has no pattern with ``prefix``.
    """
    ensure_builtin_backends()
    _backend(backend)
    if module is None:
        module = TVM_PATTERN_MODULES.get(prefix.split(".", 1)[0])
    if isinstance(module, str):
        importlib.import_module(module)
    from tvm.relax.backend.pattern_registry import get_patterns_with_prefix

    table = list(get_patterns_with_prefix(prefix))
    if not table:
        raise ValueError(f"backend {backend!r}: TVM has no pattern named {prefix!r}... "
                         f"(imported: {getattr(module, '__name__', module)})")
    return [add_backend_pattern(backend, fp.pattern, check=fp.check, name=str(fp.name),
                                annotations={str(k): v for k, v in fp.annotation_patterns.items()})
            for fp in table]


def get_backend(name: str) -> Backend:
    ensure_builtin_backends()
    return _backend(name)


def list_backends() -> list[str]:
    ensure_builtin_backends()
    return sorted(_BACKENDS)


def known_backend(name: str) -> Backend:
    """``get_backend``, its unknown name a ``ValueError`` naming the registered ones."""
    try:
        return get_backend(name)
    except KeyError as err:
        raise ValueError(str(err).strip("'\"")) from None


def every_backend(target) -> list:
    """The default backends: every registered f32 backend for ``target``'s device (the
    reduced-precision variants join under a budget that allows them); one that does not load
    here is skipped with its reason."""
    device = device_kind(target)
    return [n for n in list_backends() if get_backend(n).device == device
            and get_backend(n).precision == "f32" and get_backend(n).variant_of is None]


def resolve_backends(names, target, accuracy=None) -> tuple[dict, dict]:
    """(available backends by name, skipped name -> reason). ``tvm`` is always included;
    no ``names``: every backend for the target's device (``every_backend``).

    A backend for another device than ``target``'s (a CUDA library on an ``llvm`` target)
    is skipped with that reason. ``accuracy`` (``precision.Accuracy``, default strict f32):
    the reduced-precision variants of the named libraries (``openvino_bf16`` of
    ``openvino``) join when the budget allows their precision; naming one the budget does
    not allow is an error that says which budget would.
    """
    device = device_kind(target)
    named = {n: known_backend(n) for n in dict.fromkeys(["tvm", *(names or every_backend(target))])}
    variants = {v: get_backend(v) for v in list_backends()
                if get_backend(v).variant_of in named and v not in named}
    accuracy = parse_accuracy(accuracy)
    for name, b in named.items():
        if not accuracy.allows(b.precision):
            raise ValueError(f"backend {name!r} computes in {b.precision}; the accuracy budget "
                             f"{accuracy} does not allow it (use --accuracy {b.precision}, "
                             f"accuracy={b.precision!r} in Python)")
    chosen = {**named, **{v: b for v, b in variants.items() if accuracy.allows(b.precision)}}
    backends, skipped = {}, {}
    for name, b in chosen.items():
        ok, why = ((False, f"runs on {b.device}, the target is {device}")
                   if name != "tvm" and b.device != device else b.available())
        if not ok:
            skipped[name] = why
            logger.warning("backend %s skipped: %s", name, why)
            continue
        backends[name] = b
    return backends, skipped


_LOADING: list[str] = []


def load_pattern_file(path: str | os.PathLike) -> list[str]:
    """Run a pattern file; return the backends it registered.

    Errors name the file and line, e.g. ``mylib.py:12: NameError: ...``.
    """
    ensure_builtin_backends()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise PatternFileError(f"{path}: pattern file not found")
    before = {k: id(v) for k, v in _BACKENDS.items()}
    _LOADING.append(os.path.abspath(path))
    stem = os.path.basename(path)[:-3]
    if stem == "patterns":  # a backend folder's file (backends/<name>/patterns.py): its name
        stem = os.path.basename(os.path.dirname(os.path.abspath(path)))
    try:
        runpy.run_path(path, run_name=f"collage_pattern_file_{stem}")
    except SyntaxError as err:
        raise PatternFileError(f"{path}:{err.lineno}: SyntaxError: {err.msg}") from err
    except PatternFileError:
        raise
    except Exception as err:
        line = _line_in(path, err)
        raise PatternFileError(f"{path}:{line}: {type(err).__name__}: {err}") from err
    finally:
        _LOADING.pop()
    return sorted(k for k, v in _BACKENDS.items() if before.get(k) != id(v))


def _line_in(path: str, err: BaseException) -> int | str:
    """The deepest traceback line that lies in the pattern file itself."""
    line: int | str = "?"
    apath = os.path.abspath(path)
    for frame in traceback.extract_tb(err.__traceback__):
        if os.path.abspath(frame.filename) == apath:
            line = frame.lineno
    return line


def builtin_pattern_dir() -> str:
    """Where the built-in backends live (``collage_tvm/backends/``): one folder each, its
    pattern file ``<name>/patterns.py`` beside its lowering."""
    cand = os.path.join(os.path.dirname(os.path.abspath(__file__)), "backends")
    if os.path.isdir(cand):
        return cand
    raise FileNotFoundError("built-in backends directory not found in collage_tvm")


def builtin_pattern_files() -> list[str]:
    """Every built-in pattern file, ``backends/<name>/patterns.py``, sorted by backend name
    (names starting with ``_`` are helpers, not backends)."""
    bdir = builtin_pattern_dir()
    return [os.path.join(bdir, name, "patterns.py") for name in sorted(os.listdir(bdir))
            if not name.startswith("_") and os.path.isfile(os.path.join(bdir, name, "patterns.py"))]


_BUILTINS_LOADED = False


def ensure_builtin_backends() -> None:
    """Load every ``backends/<name>/patterns.py`` once, through the same loader users call.

    Every public registry function calls it first, so the built-in backends exist before
    a user's pattern file extends (or replaces) one of them."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:  # also while loading: the pattern files call the registry back
        return
    _BUILTINS_LOADED = True
    try:
        files = builtin_pattern_files()
    except FileNotFoundError as err:
        logger.warning("no built-in backends: %s", err)
        return
    for path in files:
        try:
            load_pattern_file(path)
        except PatternFileError as err:
            logger.warning("skipping built-in pattern file: %s", err)
