"""``torch.compile(model, backend="collage")``: each graph Dynamo captures, placed and built by
Collage (issue #36, part 4; docs/deploy_torch_compile.md).

PyTorch finds the backend by the ``torch_dynamo_backends`` entry point (setup.py) and calls
``collage(gm, example_inputs, options=...)`` once per captured graph (a graph break gives two
graphs, each compiled on its own). For each graph:

1. Its inputs are sorted: the parameters and buffers Dynamo lifts as inputs (marked static,
   ``tensor_dict["_dynamo_static_input_type"]``, as AOTAutograd reads them) are baked into the
   model as weights; the others are the model's inputs. A graph Collage cannot take (a
   symbolic size: ``dynamic=True`` or an automatic-dynamic recompile; autograd on; a tensor
   not on the CPU; an input mutated in place; a non-tensor output) runs eagerly.
2. It runs once eagerly on copies of the example inputs: the reference its build must match,
   and the check that it mutates none of them (version counters).
3. It is exported to ONNX (as ``collage_tvm.optimize`` exports a torch module for a graph
   library: ``frontend.model_file.export_torch``; ``torch.export`` when that exporter fails)
   and placed and built by ``collage_tvm.optimize`` with the options given, against the
   shared cost DB and placement log (default: ``~/.cache/collage-tvm``): a second process
   compiling the same model finds the placement in the log and measures nothing.
4. The build's outputs on the example inputs are checked against the eager ones (within the
   accuracy budget); a build that differs is not used.

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
    spec: object = None                          # the pytree spec of the graph's outputs
    leaves: list = field(default_factory=list)   # output leaves: None where a tensor goes
    tensor_leaves: list = field(default_factory=list)  # indices of leaves that are tensors
    names: list = field(default_factory=list)    # the built model's input names


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
    for pos, (node, x) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(x, torch.Tensor):
            raise _Eager(f"input {node.name!r} is a {type(x).__name__} ({x!r}): a dynamic "
                         "size; Collage builds static shapes: torch.compile(..., dynamic=False)")
        if _symbolic(node.meta.get("example_value")) or _is_fake(x):
            raise _Eager(f"input {node.name!r} has a symbolic shape: Collage builds static "
                         "shapes: torch.compile(..., dynamic=False)")
        if x.device.type != "cpu":
            raise _Eager(f"input {node.name!r} is on {x.device}: the backend builds for the CPU")
        if x.layout != torch.strided:
            raise _Eager(f"input {node.name!r} is a {x.layout} tensor")
        if (node.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type"):
            plan.static[pos] = x
        elif node.users:
            plan.used.append(pos)
            plan.names.append(node.name)
        else:
            plan.idle[pos] = x
    if torch.is_grad_enabled() and any(x.requires_grad for x in example_inputs):
        raise _Eager("autograd is on and an input requires grad; Collage builds for "
                     "inference: call the model under torch.no_grad() or torch.inference_mode()")
    if not plan.used:
        raise _Eager("the graph has no input but weights: nothing to place")
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


def _symbolic(value) -> bool:
    import torch

    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(d, torch.SymInt) for d in value.shape)
    return False


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
            for pos, x in plan.idle.items():
                self.register_buffer(f"x{pos}", x.detach())

        def forward(self, *xs):
            args = [None] * (len(plan.static) + len(plan.idle) + len(plan.used))
            for pos in plan.static:
                args[pos] = getattr(self, f"w{pos}")
            for pos in plan.idle:
                args[pos] = getattr(self, f"x{pos}")
            for pos, x in zip(plan.used, xs):
                args[pos] = x
            leaves = pytree.tree_leaves(self.gm(*args))
            return tuple(leaves[i] for i in plan.tensor_leaves)

    return Graph().eval()


def _reference(gm, example_inputs: list, plan: _Plan) -> list:
    """The graph's tensor outputs, run eagerly on copies of ``example_inputs``; ``_Eager`` when
    it changed one of them in place (the built model would not)."""
    import torch
    from torch.utils import _pytree as pytree

    # outside inference mode (where the call may be): the copies keep version counters
    with torch.inference_mode(False), torch.no_grad():
        copies = [x.detach().clone() for x in example_inputs]
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
    except RuntimeError:  # an inference tensor keeps no version counter
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
    tmp = tempfile.mkdtemp(prefix="collage-torch-compile-")
    try:
        try:
            path = _export_onnx(model, inputs, os.path.join(tmp, "graph.onnx"), plan.names,
                                len(reference))
            target_model, record.exporter, examples = path, "onnx", arrays
        except Exception as err:  # noqa: BLE001 - torch.export may still take it
            onnx_error = first_line(err, 200)
            logger.info("torch.compile(backend='collage'): %s: the ONNX export failed (%s); "
                        "importing with torch.export", record.name, onnx_error)
            target_model, record.exporter, examples = model, "torch.export", inputs
        try:
            with warnings.catch_warnings():
                # torch.export's own deprecation notices (pytree's LeafSpec)
                warnings.simplefilter("ignore", FutureWarning)
                result = optimize(target_model, s.target, db=s.db, options=s.search,
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
    fn = CompiledGraph(gm, vm, plan, record)
    if s.check:
        got = [o.numpy() for o in _flat(vm["main"](*[_to_tvm(x) for x in inputs]))]
        check = s.search.accuracy.check(got, [r.numpy() for r in reference])
        if not check["match"]:
            raise _Eager(f"its build's outputs differ from eager's on the example inputs "
                         f"(largest error {check['max_err']:.3g}; accuracy budget "
                         f"{s.search.accuracy})")
    return fn


def _export_onnx(model, inputs: tuple, path: str, names: list, n_outputs: int) -> str:
    """``model`` exported to ONNX at ``path`` as ``optimize`` exports a torch module
    (``export_torch``), checked to take every input and return every output. The exporter's
    dump of its graph on a failure (it enables its own log: torch's ``setup_onnx_logging``)
    is kept off stdout."""
    from .frontend.model_file import export_torch

    with _stdout_to_debug_log():
        export_torch(model, tuple(x.clone() for x in inputs), path, input_names=names,
                     output_names=[f"output{i}" for i in range(n_outputs)])
    _check_onnx_io(path, len(inputs), n_outputs)
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


def _check_onnx_io(path: str, n_inputs: int, n_outputs: int) -> None:
    """The exported file takes every input and returns every output (the exporter drops an
    input it finds unused, merges an output returned twice)."""
    import onnx

    proto = onnx.load(path, load_external_data=False)
    weights = {t.name for t in proto.graph.initializer}
    ins = [i.name for i in proto.graph.input if i.name not in weights]
    if len(ins) != n_inputs or len(proto.graph.output) != n_outputs:
        raise ValueError(f"the ONNX export has {len(ins)} inputs and {len(proto.graph.output)} "
                         f"outputs; the graph {n_inputs} and {n_outputs}")


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
        self._eager = False

    def __call__(self, *args):
        import torch
        from torch.utils import _pytree as pytree

        if self._eager or not self._same_weights(args):
            return self.gm(*args)
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
