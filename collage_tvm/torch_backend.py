"""``torch.compile(model, backend="collage")``: each graph Dynamo captures, placed and built by
Collage (issue #36, part 4; docs/deploy_torch_compile.md).

PyTorch finds the backend by the ``torch_dynamo_backends`` entry point (setup.py) and calls
``collage(gm, example_inputs, options=...)`` once per captured graph (a graph break gives two
graphs, each compiled on its own). For each graph:

1. Its inputs are sorted: the parameters and buffers Dynamo lifts as inputs (marked static,
   ``tensor_dict["_dynamo_static_input_type"]``, as AOTAutograd reads them) are baked into the
   model as weights; the others are the model's inputs. A graph Collage cannot take (autograd
   on; a tensor not on the CPU; an input mutated in place; a non-tensor output; a symbolic
   int that is no size of a tensor input) runs eagerly.
2. It runs once eagerly on copies of the example inputs: the reference its build must match,
   and the check that it mutates none of them (version counters).
3. It is exported to ONNX (as ``collage_tvm.optimize`` exports a torch module for a graph
   library: ``frontend.model_file.export_torch``; ``torch.export`` when that exporter fails)
   and placed and built by ``collage_tvm.optimize`` with the options given, against the
   shared cost DB and placement log (default: ``~/.cache/collage-tvm``): a second process
   compiling the same model finds the placement in the log and measures nothing.
4. The build's outputs on the example inputs are checked against the eager ones (within the
   accuracy budget); a build that differs is not used.

Symbolic sizes (``dynamic=True``, or Dynamo's automatic dynamic shapes: the recompile after
a second input shape; issue #77, part 4) are built once for a range (``collage_tvm.dynamic``):
the SymInt inputs Dynamo passes are dropped (the build reads each from its tensor's shape),
each symbol becomes a named dynamic axis of the ONNX export (one name per symbol, shared
between inputs), and its range (``_ranges``) goes to ``SearchOptions.shapes``: the example's
size the optimum, Dynamo's bounds the ends (its least is usually 2: it fixes 0 and 1), an
unbounded end a default as Collage reads one from a model (a batch up to 8, a sequence up to
512; an image's spatial axis, or a size a guard ties to another, the example's size alone),
``options={"shapes": {"x": "2x8:4x8:32x8"}}`` where the user gives one (by the argument's
name or the graph's, ``l_x_``). Python floats Dynamo passes as 0-d tensors are baked in (a
call with another value runs eagerly). The build is checked at the example's shapes and at
the range's least; a call outside the range runs the graph eagerly, logged once
(``DynamicGraph``). ``builds()`` gives the range of each such graph (``GraphBuild.shapes``).

A graph that fails any step runs as Dynamo captured it (``gm.forward``), the reason logged
once (``logging.warning`` on the ``collage_tvm`` logger). The returned callable takes and
returns torch tensors (DLPack both ways, no copy unless an input is strided or misaligned),
in the structure the graph returns. A weight changed after the build (another tensor, or
updated in place) is seen on the next call: that graph then runs eagerly.

The builds of this process are listed by ``builds()``: per graph, whether Collage built it,
the ``BuildReport`` (``report.placement_from_log``: placed from the log) or why it runs
eagerly, and the seconds it took.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field

from ._errors import first_line
from .options import SearchOptions

logger = logging.getLogger("collage_tvm")

# torch.compile options that are not search options: where the build's state lives, what it
# targets, and the final check against eager (on by default).
BUILD_OPTIONS = {
    "db": "cost DB path (default ~/.cache/collage-tvm/costs.db, shared by every process)",
    "placement_log": "placement log path (default: next to the cost DB)",
    "tuning_db": "tuning database TVM's kernels use (default: next to the cost DB)",
    "target": "TVM target (default 'llvm': this CPU)",
    "check": "check the build's outputs against eager on the example inputs (default True)",
}


@dataclass(frozen=True)
class Settings:
    """``torch.compile(..., options=...)`` read: the search options and the build options."""

    search: SearchOptions
    db: object = None
    placement_log: object = None
    tuning_db: object = None
    target: object = "llvm"
    check: bool = True


def valid_options() -> list:
    """The names ``torch.compile(backend="collage", options=...)`` takes."""
    return sorted({f.name for f in dataclasses.fields(SearchOptions)} | set(BUILD_OPTIONS))


def settings(options: dict | None) -> Settings:
    """``options`` (a dict of ``SearchOptions`` fields and ``BUILD_OPTIONS``) read; an unknown
    name or a bad value is an error that names the valid ones."""
    options = dict(options or {})
    unknown = sorted(k for k in options if k not in valid_options())
    if unknown:
        raise TypeError(f"torch.compile(backend='collage'): unknown option(s) "
                        f"{', '.join(map(repr, unknown))}; valid options: "
                        f"{', '.join(valid_options())}")
    build = {k: options.pop(k) for k in list(options) if k in BUILD_OPTIONS}
    try:
        search = SearchOptions.of(None, **options)
    except (TypeError, ValueError) as err:
        raise type(err)(f"torch.compile(backend='collage'): {err}") from None
    if search.backends:  # an unknown backend name is the user's error, not a fallback
        from .registry import known_backend

        for name in search.backends:
            try:
                known_backend(name)
            except ValueError as err:
                raise ValueError(f"torch.compile(backend='collage'): option 'backends': "
                                 f"{err}") from None
    return Settings(search=search, **build)


@dataclass
class GraphBuild:
    """One graph Dynamo handed to the backend, as ``builds()`` lists it."""

    name: str
    ops: int                       # the graph's call nodes
    inputs: int                    # the built model's inputs (weights baked in)
    weights: int                   # inputs Dynamo lifted that were baked in as weights
    seconds: float = math.nan      # compile time: the checks, the export, the search, the build
    report: object = None          # the BuildReport; None when the graph runs eagerly
    fallback: str = ""             # why the graph runs eagerly ("" when Collage built it)
    exporter: str = ""             # "onnx" or "torch.export"
    shapes: str = ""               # the range a graph with symbolic sizes was built for
                                   # (ShapeRanges.describe: "s77 2..8 (opt 2)"); "" if static

    @property
    def built(self) -> bool:
        return self.report is not None and not self.fallback


_BUILDS: list = []
_WARNED: set = set()
_LOCK = threading.Lock()


def builds() -> list:
    """The graphs this process compiled with the backend, in order (``GraphBuild`` each)."""
    with _LOCK:
        return list(_BUILDS)


def clear_builds() -> None:
    """Forget ``builds()`` and which reasons were logged (tests; ``torch._dynamo.reset()``
    forgets the compiled graphs themselves)."""
    with _LOCK:
        _BUILDS.clear()
        _WARNED.clear()


class _Eager(Exception):
    """The graph runs eagerly; the message says why."""


def collage(gm, example_inputs, options: dict | None = None, mode: str | None = None):
    """The Dynamo backend: ``gm`` (a ``torch.fx.GraphModule``) built by Collage for
    ``example_inputs``; what cannot be built runs eagerly (``gm.forward``). ``options``: the
    dict of ``torch.compile(..., options=)`` (``valid_options()``); ``mode`` is accepted and
    ignored (Collage's search is what it is)."""
    s = settings(options)  # the user's error: raised, not a fallback
    with _LOCK:
        name = f"graph {len(_BUILDS)}"
    t0 = time.perf_counter()
    record = GraphBuild(name=name, ops=_count_ops(gm), inputs=0, weights=0)
    try:
        compiled = _build(gm, list(example_inputs), s, record)
    except _Eager as why:
        compiled = _eager(gm, record, str(why))
    except Exception as err:  # noqa: BLE001 - any failure of Collage leaves the graph eager
        compiled = _eager(gm, record, f"Collage could not build it: {first_line(err, 300)}")
    record.seconds = time.perf_counter() - t0
    with _LOCK:
        _BUILDS.append(record)
    if record.built:
        logger.info("torch.compile(backend='collage'): %s built in %.1f s (%s)", name,
                    record.seconds, record.report.summary())
    return compiled


def _eager(gm, record: GraphBuild, why: str):
    record.fallback = why
    _warn_once(gm, f"torch.compile(backend='collage'): a graph of {record.ops} op(s) runs "
                   f"eagerly: {why}")
    return gm.forward


def _warn_once(gm, message: str) -> None:
    key = (hash(getattr(gm, "code", "")), message)
    with _LOCK:
        if key in _WARNED:
            return
        _WARNED.add(key)
    logger.warning("%s", message)


def _count_ops(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))


# --------------------------------------------------------------------------- the graph

@dataclass
class _Plan:
    """What of the graph's inputs and outputs the built model takes and returns."""

    static: dict = field(default_factory=dict)   # input position -> weight tensor (baked)
    used: list = field(default_factory=list)     # positions of the built model's inputs
    idle: dict = field(default_factory=dict)     # unused non-weight inputs: position -> example
    # Python numbers Dynamo passes as 0-d tensors (unspecialized: dynamic=True), baked in as
    # the example's value; a call with another value runs eagerly: position -> example
    scalars: dict = field(default_factory=dict)
    spec: object = None                          # the pytree spec of the graph's outputs
    leaves: list = field(default_factory=list)   # output leaves: None where a tensor goes
    tensor_leaves: list = field(default_factory=list)  # indices of leaves that are tensors
    names: list = field(default_factory=list)    # the built model's input names
    # Symbolic sizes (dynamic=True, automatic dynamic shapes): the SymInt inputs are not
    # inputs of the built model; each is a dimension of one of its inputs (or a constant).
    sizes: dict = field(default_factory=dict)    # SymInt input position -> (j, axis) | int
    dims: list = field(default_factory=list)     # per built input: dims, int or symbol name
    hints: dict = field(default_factory=dict)    # symbol -> its size in the example inputs
    bounds: dict = field(default_factory=dict)   # symbol -> (lower, upper or None): Dynamo's
    env: object = None                           # Dynamo's ShapeEnv (its guards)

    @property
    def dynamic(self) -> bool:
        return any(isinstance(d, str) for dims in self.dims for d in dims)


def _plan(gm, example_inputs: list) -> _Plan:
    """The plan of ``gm``'s inputs and outputs, or ``_Eager`` with the reason it cannot be
    built."""
    import torch
    from torch.utils import _pytree as pytree

    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        raise _Eager(f"{len(example_inputs)} example inputs for {len(placeholders)} graph inputs")
    if _count_ops(gm) == 0:
        raise _Eager("the graph computes nothing")
    plan = _Plan()
    symints = {}  # position -> (node, SymInt)
    for pos, (node, x) in enumerate(zip(placeholders, example_inputs)):
        value = node.meta.get("example_value")
        if isinstance(x, torch.SymInt) or (isinstance(value, torch.SymInt)
                                           and isinstance(x, int)):
            symints[pos] = (node, value if isinstance(value, torch.SymInt) else x)
            continue
        if not isinstance(x, torch.Tensor):
            raise _Eager(f"input {node.name!r} is a {type(x).__name__} ({x!r}): Collage "
                         "builds a graph of tensor inputs (and sizes of theirs)")
        if _is_fake(x):
            raise _Eager(f"input {node.name!r} is a fake tensor: the backend needs real "
                         "example inputs (it is called by Dynamo, not behind AOTAutograd)")
        if x.device.type != "cpu":
            raise _Eager(f"input {node.name!r} is on {x.device}: the backend builds for the CPU")
        if x.layout != torch.strided:
            raise _Eager(f"input {node.name!r} is a {x.layout} tensor")
        if (node.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type"):
            plan.static[pos] = x
        elif getattr(node.meta.get("grapharg"), "pass_arg_as_tensor", False) and x.dim() == 0:
            plan.scalars[pos] = x.detach().clone()
        elif node.users:
            plan.used.append(pos)
            plan.names.append(node.name)
            plan.dims.append(_dims(node, value, x, plan))
        else:
            plan.idle[pos] = x
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                       for x in example_inputs):
        raise _Eager("autograd is on and an input requires grad; Collage builds for "
                     "inference: call the model under torch.no_grad() or torch.inference_mode()")
    if not plan.used:
        raise _Eager("the graph has no input but weights: nothing to place")
    for pos, (node, size) in symints.items():
        plan.sizes[pos] = _size_source(node, size, plan)
    (out_node,) = gm.graph.find_nodes(op="output")
    leaves, plan.spec = pytree.tree_flatten(out_node.args[0])
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.fx.Node):
            value = leaf.meta.get("example_value")
            if not isinstance(value, torch.Tensor):
                raise _Eager(f"output {leaf.name!r} is a {type(value).__name__}, not a tensor")
            plan.tensor_leaves.append(i)
            plan.leaves.append(None)
        else:
            plan.leaves.append(leaf)
    if not plan.tensor_leaves:
        raise _Eager("the graph returns no tensor")
    return plan


def _dims(node, value, x, plan: _Plan) -> list:
    """The dims of the built model's input ``node`` (``x`` the example, ``value`` Dynamo's
    fake tensor): an int where the size is static (or a guard fixed it), else the name of
    its symbol; the symbol's example size and Dynamo's bounds go to ``plan``. ``_Eager``
    for a size that is an expression of other sizes (no axis of its own to export)."""
    import torch

    if not isinstance(value, torch.Tensor):
        return [int(d) for d in x.shape]
    dims = []
    for axis, (d, size) in enumerate(zip(value.shape, x.shape)):
        expr = _expr(d)
        if expr is None:
            dims.append(int(size))
            continue
        if not expr.is_Symbol:
            raise _Eager(f"input {node.name!r}: its size {axis} is {expr}, not a size of its "
                         "own; Collage exports one symbol per axis: torch.compile(..., "
                         "dynamic=False)")
        name = str(expr)
        dims.append(name)
        plan.env = plan.env or getattr(d.node, "shape_env", None)
        plan.hints.setdefault(name, int(size))
        plan.bounds.setdefault(name, _bounds(d, expr))
    return dims


def _expr(d):
    """The sympy expression of a size (the shape env's replacements applied: a guard that
    fixed it makes it a number); None for a static size."""
    import torch

    if not isinstance(d, torch.SymInt):
        return None
    node = d.node
    expr = node.expr
    env = getattr(node, "shape_env", None)
    if env is not None:
        try:
            expr = env.replace(expr)
        except Exception:  # noqa: BLE001 - the expression as recorded
            pass
    if expr.is_number:
        return None
    return expr


def _bounds(d, expr) -> tuple:
    """(lower, upper or None) Dynamo knows of the symbol ``expr`` (a ``SymInt``'s)."""
    env = getattr(d.node, "shape_env", None)
    lower, upper = 1, None
    try:
        r = env.bound_sympy(expr)
        if r.lower.is_finite:
            lower = int(r.lower)
        if r.upper.is_finite:
            upper = int(r.upper)
    except Exception:  # noqa: BLE001 - no bounds known: the defaults
        pass
    return max(1, lower), upper


def _size_source(node, size, plan: _Plan):
    """Where the SymInt input ``node`` comes from in the built model's inputs: (j, axis) of
    ``plan.used[j]``, or its value where a guard fixed it; ``_Eager`` for a size that is no
    dimension of a tensor input (the built model could not recompute it)."""
    expr = _expr(size)
    if expr is None:  # an int, or a size a guard fixed
        return _hint(size)
    if expr.is_Symbol:
        for j, dims in enumerate(plan.dims):
            if str(expr) in dims:
                return j, dims.index(str(expr))
    if not node.users:  # unused: any value serves
        return _hint(size)
    raise _Eager(f"input {node.name!r} is a symbolic int ({expr}) that is no size of a tensor "
                 "input: the built model could not recompute it; torch.compile(..., "
                 "dynamic=False)")


def _hint(size) -> int:
    """The example's value of a ``SymInt`` (its size hint)."""
    import torch

    if not isinstance(size, torch.SymInt):
        return int(size)
    from torch.fx.experimental import symbolic_shapes

    # (torch 2.13: guarding_hint_or_throw; hint_int before it)
    hint = getattr(symbolic_shapes, "guarding_hint_or_throw", None) or symbolic_shapes.hint_int
    return int(hint(size))


def _is_fake(x) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(x, FakeTensor)


def _model(gm, plan: _Plan):
    """A ``torch.nn.Module`` taking the graph's used non-weight inputs and returning its tensor
    outputs, flat: the weights are its buffers (constants of the built model)."""
    import torch
    from torch.utils import _pytree as pytree

    class Graph(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gm = gm
            for pos, w in plan.static.items():
                self.register_buffer(f"w{pos}", w.detach())
            for pos, x in {**plan.idle, **plan.scalars}.items():
                self.register_buffer(f"x{pos}", x.detach())

        def forward(self, *xs):
            args = [None] * _n_args(plan)
            for pos in plan.static:
                args[pos] = getattr(self, f"w{pos}")
            for pos in {**plan.idle, **plan.scalars}:
                args[pos] = getattr(self, f"x{pos}")
            for pos, x in zip(plan.used, xs):
                args[pos] = x
            for pos, source in plan.sizes.items():  # a size: read from its input's shape
                args[pos] = source if isinstance(source, int) else xs[source[0]].shape[source[1]]
            leaves = pytree.tree_leaves(self.gm(*args))
            return tuple(leaves[i] for i in plan.tensor_leaves)

    return Graph().eval()


def _n_args(plan: _Plan) -> int:
    return (len(plan.static) + len(plan.idle) + len(plan.scalars) + len(plan.used)
            + len(plan.sizes))


def _reference(gm, example_inputs: list, plan: _Plan) -> list:
    """The graph's tensor outputs, run eagerly on copies of ``example_inputs``; ``_Eager`` when
    it changed one of them in place (the built model would not)."""
    import torch
    from torch.utils import _pytree as pytree

    # outside inference mode (where the call may be): the copies keep version counters
    with torch.inference_mode(False), torch.no_grad():
        copies = [x.detach().clone() if isinstance(x, torch.Tensor) else _hint(x)
                  for x in example_inputs]
        versions = [_version(c) for c in copies]
        out = gm(*copies)
    for node, c, v in zip(gm.graph.find_nodes(op="placeholder"), copies, versions):
        if v is not None and _version(c) != v:
            raise _Eager(f"the graph changes its input {node.name!r} in place")
    leaves = pytree.tree_leaves(out)
    return [leaves[i].detach() for i in plan.tensor_leaves]


def _version(t):
    try:
        return t._version
    except (RuntimeError, AttributeError):  # an inference tensor keeps no version counter
        return None


# --------------------------------------------------------------------------- the build

def _build(gm, example_inputs: list, s: Settings, record: GraphBuild):
    import tvm
    from tvm import relax

    from .build import optimize

    plan = _plan(gm, example_inputs)
    record.inputs, record.weights = len(plan.used), len(plan.static)
    reference = _reference(gm, example_inputs, plan)
    model = _model(gm, plan)
    inputs = tuple(example_inputs[p].detach() for p in plan.used)
    arrays = [x.numpy() for x in inputs]
    search, axes, dynamic_axes = s.search, None, None
    if plan.dynamic:
        axes = _ranges(gm, plan, s.search.shapes)
        search = dataclasses.replace(s.search, shapes=_shape_specs(plan, axes))
        dynamic_axes = {name: {k: d for k, d in enumerate(dims) if isinstance(d, str)}
                        for name, dims in zip(plan.names, plan.dims)}
        if any(axes[sym][1] != hint for sym, hint in plan.hints.items()):
            arrays = None  # the search runs at the optimum: not the example's shapes
    tmp = tempfile.mkdtemp(prefix="collage-torch-compile-")
    try:
        try:
            path = _export_onnx(model, inputs, os.path.join(tmp, "graph.onnx"), plan.names,
                                len(reference), dynamic_axes)
            target_model, record.exporter, examples = path, "onnx", arrays
        except Exception as err:  # noqa: BLE001 - torch.export may still take it
            onnx_error = first_line(err, 200)
            if plan.dynamic:
                raise _Eager(f"it has symbolic sizes and its ONNX export with dynamic axes "
                             f"failed ({onnx_error}); torch.export's import builds static "
                             "shapes: torch.compile(..., dynamic=False)") from err
            logger.info("torch.compile(backend='collage'): %s: the ONNX export failed (%s); "
                        "importing with torch.export", record.name, onnx_error)
            target_model, record.exporter, examples = model, "torch.export", inputs
        try:
            with warnings.catch_warnings():
                # torch.export's own deprecation notices (pytree's LeafSpec)
                warnings.simplefilter("ignore", FutureWarning)
                result = optimize(target_model, s.target, db=s.db, options=search,
                                  placement_log=s.placement_log, tuning_db=s.tuning_db,
                                  example_inputs=examples)
        except Exception as err:
            if record.exporter == "onnx":
                raise
            why = first_line(err, 300).split(" (exporting to ONNX first")[0]
            raise _Eager(f"Collage could not import it: the ONNX export failed "
                         f"({onnx_error}), and {why}") from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record.report = result.report
    vm = relax.VirtualMachine(result.executable, tvm.cpu())
    if not plan.dynamic:
        fn = CompiledGraph(gm, vm, plan, record)
        if s.check:
            _check(vm, inputs, reference, s, "on the example inputs")
        return fn
    ranges = _built_ranges(result.report, plan, axes, inputs)
    record.shapes = "; ".join(str(a) for a in ranges.axes.values())
    fn = DynamicGraph(gm, vm, plan, record, ranges)
    if s.check:
        example = {sym: plan.hints[sym] for sym in ranges.axes}
        if _inside(ranges, inputs):
            _check(vm, inputs, reference, s, "on the example inputs")
        else:
            _check_at(gm, vm, plan, ranges, ranges.opt(), s, "at the range's optimum")
        least = {sym: a.min for sym, a in ranges.axes.items()}
        if least != example:
            _check_at(gm, vm, plan, ranges, least, s, "at the range's least shape")
    return fn


def _check(vm, inputs, reference: list, s: Settings, where: str) -> None:
    """``_Eager`` when the build's outputs on ``inputs`` differ from ``reference``."""
    got = [o.numpy() for o in _flat(vm["main"](*[_to_tvm(x) for x in inputs]))]
    check = s.search.accuracy.check(got, [r.numpy() for r in reference])
    if not check["match"]:
        raise _Eager(f"its build's outputs differ from eager's {where} "
                     f"(largest error {check['max_err']:.3g}; accuracy budget "
                     f"{s.search.accuracy})")


def _check_at(gm, vm, plan: _Plan, ranges, point: dict, s: Settings, where: str) -> None:
    """The build checked against eager on inputs of the sizes ``point`` (random floats,
    zero integers); skipped where the graph itself does not run on them."""
    import torch
    from torch.utils import _pytree as pytree

    gen = torch.Generator().manual_seed(0)
    inputs = []
    for (_, dtype, _), shape in zip(ranges.inputs, ranges.shapes(point).values()):
        dtype = getattr(torch, dtype)
        inputs.append(torch.randn(shape, generator=gen, dtype=dtype) if dtype.is_floating_point
                      else torch.zeros(shape, dtype=dtype))
    try:
        with torch.no_grad():
            leaves = pytree.tree_leaves(gm(*_graph_args(plan, inputs)))
    except Exception as err:  # noqa: BLE001 - the graph's own limits: nothing to check there
        logger.debug("the check %s is skipped: the graph does not run there (%s)", where,
                     first_line(err, 200))
        return
    _check(vm, inputs, [leaves[i].detach() for i in plan.tensor_leaves], s, where)


def _graph_args(plan: _Plan, inputs: list) -> list:
    """The graph's arguments for the built model's ``inputs``: the weights, the unused
    inputs' examples, and each size read from its input's shape."""
    args = [None] * _n_args(plan)
    for pos, w in {**plan.static, **plan.idle, **plan.scalars}.items():
        args[pos] = w
    for pos, x in zip(plan.used, inputs):
        args[pos] = x
    for pos, source in plan.sizes.items():
        args[pos] = source if isinstance(source, int) else int(inputs[source[0]].shape[source[1]])
    return args


def _inside(ranges, inputs) -> bool:
    from .dynamic.shapes import ShapeError

    try:
        ranges.point_of([tuple(x.shape) for x in inputs])
        return True
    except ShapeError:
        return False


# --------------------------------------------------------------------------- symbolic sizes

def _source_name(name: str) -> str:
    """The user's name of a graph input: Dynamo's ``l_x_`` (``L['x']``) is ``x``."""
    return name[2:-1] if name.startswith("l_") and name.endswith("_") and len(name) > 3 else name


def _ranges(gm, plan: _Plan, given: tuple) -> dict:
    """symbol -> (min, opt, max): the sizes the graph is built for. Per symbol, the optimum
    is the example's size; min and max are Dynamo's bounds (min at least 1: Dynamo fixes
    the sizes 0 and 1, so its least is usually 2), an unbounded max a default as Collage
    reads one from a model (``dynamic.shapes.default_axis``): a batch (the first axis of an
    input) up to 8, an image's spatial axis (2 or 3 of a 4-D input) the example's size
    alone, any other (a sequence) up to 512. ``given``: ``SearchOptions.shapes``, per input
    (the graph's name, ``l_x_``, or the user's, ``x``) its min, opt and max shapes: those
    win for the symbols of that input; a name that is no input of this graph is logged."""
    from .dynamic.shapes import BATCH_RANGE, SEQUENCE_MAX

    axes = {}
    for sym, hint in plan.hints.items():
        lower, upper = plan.bounds[sym]
        where = [(len(dims), k) for dims in plan.dims for k, d in enumerate(dims) if d == sym]
        if any(k == 0 for _, k in where):
            top = BATCH_RANGE[2]
        elif all(rank == 4 and k in (2, 3) for rank, k in where):
            top, lower = hint, (lower if upper is not None else hint)
        else:
            top = SEQUENCE_MAX
        hi = upper if upper is not None else max(top, hint)
        axes[sym] = (min(lower, hint), hint, max(hi, hint))
    for sym, guard in _related(plan).items():
        logger.info("torch.compile(backend='collage'): %s is built at its example size %d "
                    "alone: Dynamo's guard %s ties it to another size", sym, plan.hints[sym],
                    guard)
        axes[sym] = (plan.hints[sym],) * 3
    by_name = {}
    for j, name in enumerate(plan.names):
        by_name[name] = j
        by_name.setdefault(_source_name(name), j)
    unknown = []
    for name, three in given or ():
        j = by_name.get(name)
        if j is None:
            unknown.append(name)
            continue
        dims = plan.dims[j]
        if any(len(shape) != len(dims) for shape in three):
            raise _Eager(f"option shapes[{name!r}]: the input has {len(dims)} dimensions "
                         f"({'x'.join(map(str, dims))}), got {list(three[0])}")
        for k, d in enumerate(dims):
            lo, opt, hi = (int(shape[k]) for shape in three)
            if not isinstance(d, str):  # fixed in this graph (a guard, or not symbolic)
                if not lo == opt == hi == d:
                    logger.info("option shapes[%r]: dimension %d is %d in this graph; its "
                                "range %d:%d:%d is not used", name, k, d, lo, opt, hi)
                continue
            if not 1 <= lo <= opt <= hi:
                raise _Eager(f"option shapes[{name!r}]: dimension {k} needs 1 <= min <= opt "
                             f"<= max, got {lo}:{opt}:{hi}")
            axes[d] = (lo, opt, hi)
    if unknown:
        names = ", ".join(f"{_source_name(n)} ({n})" for n in plan.names)
        _warn_once(gm, f"torch.compile(backend='collage'): option shapes names "
                       f"{', '.join(unknown)}: no input of a graph whose inputs are {names}; "
                       "its default ranges are used")
    return axes


def _related(plan: _Plan) -> dict:
    """symbol -> a guard of Dynamo's that ties it to another size or fixes it other than by
    a bound (``Eq(s27*s53, 32)``: a reshape to a fixed width): a range of it alone would
    hold shapes the graph never gets (Dynamo recompiles for them) and may not run."""
    out = {}
    for guard in getattr(plan.env, "guards", None) or ():
        expr = getattr(guard, "expr", None)
        syms = {str(x) for x in getattr(expr, "free_symbols", ())} & set(plan.hints)
        if not syms or (len(syms) == 1 and _is_bound(expr)):
            continue
        for sym in syms:
            out.setdefault(sym, expr)
    return out


def _is_bound(expr) -> bool:
    """Whether ``expr`` bounds one symbol (``s0 < 16``, ``s0 >= 2``, ``Ne(s0, 1)``)."""
    import sympy

    if not isinstance(expr, (sympy.StrictLessThan, sympy.LessThan, sympy.StrictGreaterThan,
                             sympy.GreaterThan, sympy.Unequality)):
        return False
    lhs, rhs = expr.lhs, expr.rhs
    return (lhs.is_Symbol and rhs.is_number) or (rhs.is_Symbol and lhs.is_number)


def _shape_specs(plan: _Plan, axes: dict) -> tuple:
    """``SearchOptions.shapes`` of the ranges ``axes``: per input with a symbolic size, its
    (min, opt, max) shapes."""
    specs = []
    for name, dims in zip(plan.names, plan.dims):
        if any(isinstance(d, str) for d in dims):
            specs.append((name, tuple(tuple(axes[d][i] if isinstance(d, str) else d
                                            for d in dims) for i in range(3))))
    return tuple(specs)


def _built_ranges(report, plan: _Plan, axes: dict, inputs):
    """The ``ShapeRanges`` the build serves: the report's (the search may narrow a range
    where the model does not run at its end), else ``axes``."""
    from .dynamic.shapes import Axis, ShapeRanges

    dyn = getattr(report, "dynamic", None)
    if dyn and dyn.get("ranges"):
        return ShapeRanges.from_json(dyn["ranges"])
    return ShapeRanges([(n, str(x.dtype).removeprefix("torch."), list(d))
                        for n, x, d in zip(plan.names, inputs, plan.dims)],
                       {sym: Axis(sym, *three) for sym, three in axes.items()},
                       set(axes))


def _export_onnx(model, inputs: tuple, path: str, names: list, n_outputs: int,
                 dynamic_axes: dict | None = None) -> str:
    """``model`` exported to ONNX at ``path`` as ``optimize`` exports a torch module
    (``export_torch``), checked to take every input and return every output; with
    ``dynamic_axes`` (input name -> {axis: symbol}), checked to name each of those axes.
    The exporter's dump of its graph on a failure (it enables its own log: torch's
    ``setup_onnx_logging``) is kept off stdout."""
    from .frontend.model_file import export_torch

    more = {"dynamic_axes": dynamic_axes} if dynamic_axes else {}
    with _stdout_to_debug_log():
        export_torch(model, tuple(x.clone() for x in inputs), path, input_names=names,
                     output_names=[f"output{i}" for i in range(n_outputs)], **more)
    _check_onnx_io(path, len(inputs), n_outputs, dynamic_axes)
    return path


@contextlib.contextmanager
def _stdout_to_debug_log():
    """What is written to file descriptor 1 inside the block (C++ code writes there directly)
    goes to the debug log instead."""
    import sys

    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no real stdout: nothing to redirect
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        try:
            yield
        finally:
            try:
                sys.stdout.flush()
            except ValueError:
                pass
            os.dup2(saved, 1)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace").strip()
            if text:
                logger.debug("the ONNX exporter wrote: %s", text[:4000])


def _check_onnx_io(path: str, n_inputs: int, n_outputs: int,
                   dynamic_axes: dict | None = None) -> None:
    """The exported file takes every input and returns every output (the exporter drops an
    input it finds unused, merges an output returned twice), and names each dynamic axis."""
    import onnx

    proto = onnx.load(path, load_external_data=False)
    weights = {t.name for t in proto.graph.initializer}
    ins = [i for i in proto.graph.input if i.name not in weights]
    if len(ins) != n_inputs or len(proto.graph.output) != n_outputs:
        raise ValueError(f"the ONNX export has {len(ins)} inputs and {len(proto.graph.output)} "
                         f"outputs; the graph {n_inputs} and {n_outputs}")
    for vi in ins:
        dims = vi.type.tensor_type.shape.dim
        for axis, symbol in (dynamic_axes or {}).get(vi.name, {}).items():
            if axis >= len(dims) or dims[axis].dim_param != symbol:
                raise ValueError(f"the ONNX export's input {vi.name} has no dynamic axis "
                                 f"{axis} named {symbol} (it has "
                                 f"{[d.dim_param or d.dim_value for d in dims]})")


def _to_tvm(x):
    """A torch tensor as a TVM tensor, sharing its memory when it is contiguous and aligned
    as TVM requires (64 bytes); else a contiguous copy."""
    import tvm

    x = x.detach()
    if not x.is_contiguous() or x.data_ptr() % 64:
        x = x.contiguous().clone()
    return tvm.runtime.from_dlpack(x)


def _flat(out) -> list:
    """The VM's result (a tensor or nested tuples of them) as a flat list of TVM tensors."""
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return [out]
    flat = []
    for o in out:
        flat += _flat(o)
    return flat


class CompiledGraph:
    """The callable Dynamo gets for a graph Collage built: torch tensors in (the graph's
    inputs, weights included), its outputs out in the graph's structure."""

    def __init__(self, gm, vm, plan: _Plan, record: GraphBuild):
        self.gm, self.vm, self.plan, self.record = gm, vm, plan, record
        self._main = vm["main"]
        self._weights = [(pos, w.data_ptr(), _version(w)) for pos, w in plan.static.items()]
        self._scalars = [(pos, x.item()) for pos, x in plan.scalars.items()]
        self._eager = False

    def __call__(self, *args):
        if self._eager or not self._same_weights(args) or not self._same_scalars(args):
            return self.gm(*args)
        return self._run(args)

    def _same_scalars(self, args) -> bool:
        """Whether each number baked in has the example's value in this call (else the call
        runs eagerly)."""
        for pos, value in self._scalars:
            if args[pos].item() != value:
                _warn_once(self.gm, f"torch.compile(backend='collage'): {self.record.name} "
                                    f"was built with {self.plan_input_name(pos)} = {value}; "
                                    "a call with another value runs eagerly")
                return False
        return True

    def _run(self, args):
        import torch
        from torch.utils import _pytree as pytree

        plan = self.plan
        out = _flat(self._main(*[_to_tvm(args[p]) for p in plan.used]))
        leaves = list(plan.leaves)
        for i, o in zip(plan.tensor_leaves, out):
            leaves[i] = torch.from_dlpack(o)
        return pytree.tree_unflatten(leaves, plan.spec)

    def _same_weights(self, args) -> bool:
        for pos, ptr, version in self._weights:
            w = args[pos]
            if w.data_ptr() != ptr or (version is not None and _version(w) != version):
                self._eager = True
                self.record.fallback = (f"a weight ({self.plan_input_name(pos)}) changed "
                                        "after the build")
                _warn_once(self.gm, f"torch.compile(backend='collage'): {self.record.name} "
                                    f"runs eagerly from now on: {self.record.fallback}; "
                                    "torch._dynamo.reset() and a new call rebuild it")
                return False
        return True

    def plan_input_name(self, pos: int) -> str:
        return list(self.gm.graph.find_nodes(op="placeholder"))[pos].name


class DynamicGraph(CompiledGraph):
    """The callable of a graph with symbolic sizes, built once for ``ranges``
    (``ShapeRanges``): Dynamo's arguments in, the sizes among them dropped (the build reads
    them from the tensors' shapes). A call whose shapes are outside the ranges (or that the
    build fails on) runs the graph eagerly, logged once: the model always runs."""

    def __init__(self, gm, vm, plan: _Plan, record: GraphBuild, ranges):
        super().__init__(gm, vm, plan, record)
        self.ranges = ranges
        self._outside: dict = {}   # input shapes -> why the build does not serve them ("")
        self._warned = False

    def __call__(self, *args):
        from .dynamic.shapes import ShapeError

        if self._eager or not self._same_weights(args) or not self._same_scalars(args):
            return self.gm(*args)
        shapes = tuple(tuple(args[p].shape) for p in self.plan.used)
        why = self._outside.get(shapes)
        if why is None:
            try:
                self.ranges.point_of(shapes)
                why = ""
            except ShapeError as err:
                why = first_line(err, 300)
            if len(self._outside) < 4096:
                self._outside[shapes] = why
        if not why:
            try:
                return self._run(args)
            except Exception as err:  # noqa: BLE001 - eager serves the call: the model runs
                why = first_line(err, 300)
                self._outside[shapes] = why
        self._eager_call(shapes, why)
        return self.gm(*args)

    def _eager_call(self, shapes, why: str) -> None:
        if self._warned:
            return
        self._warned = True
        logger.warning("torch.compile(backend='collage'): %s was built for %s; a call with "
                       "input shapes %s runs eagerly (%s); so does any other the build does "
                       "not serve (options={'shapes': ...} widens the range)", self.record.name,
                       self.record.shapes, ", ".join("x".join(map(str, s)) for s in shapes), why)
