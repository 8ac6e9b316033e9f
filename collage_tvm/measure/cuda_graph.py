"""A whole executable as one CUDA graph (issue #19, part 3: launch overhead).

At batch 1 a GPU kernel runs in microseconds, as long as it takes Python and the VM to
launch it: a placement that mixes TVM kernels with cuDNN, cuBLAS and inductor calls made
through torch loses most of its time between kernels. :func:`capture` records one call of
``vm["main"]`` into a CUDA graph with torch (``torch.cuda.graph``), TVM's kernels on the
same capture stream (``tvm_ffi.use_torch_stream``), and replays it: one launch a call.

What keeps a replay correct:

* torch's allocations during the capture (the outputs of cuDNN and cuBLAS calls, cuDNN's
  workspace, inductor's buffers) come from the graph's private memory pool, which torch
  keeps for the graph's replays;
* TVM's allocations during the capture come from TVM's pooled allocator, which takes back
  what the VM frees at the end of the call and would hand it to the next build on the
  device while the graph still writes into it on each replay. The capture therefore holds
  every storage and tensor the VM allocated (seen through the VM's instrument hook) for as
  long as the graph lives;
* the inputs are copied into tensors the graph owns before each replay; the outputs are
  the graph's own tensors, overwritten by the next replay (``Main.__call__`` hands out
  copies; the timing loops use ``Main.replay``);
* warm-up calls come first, outside the capture (cuDNN's algorithm search, cuBLAS handles,
  inductor's compile); the capture is then checked: a replay must give the eager call's
  outputs, else the build runs uncaptured.

Not captured (run as they are, the reason in ``Main.why``): a build on another device; a
build TVM compiled with its own CUDA graphs (``RewriteCUDAGraph``, a build with no external
call: its static regions are one launch already, and a capture cannot hold another); a
build calling a library that replays its own CUDA graph (the whole model on inductor in
``reduce-overhead`` mode: its callable says ``captures_itself``); anything that fails while
capturing or whose replay disagrees with the eager call.
"""
from __future__ import annotations

import logging
import os

import numpy as np

logger = logging.getLogger("collage_tvm")

#: ``COLLAGE_TVM_CUDA_GRAPHS=0`` in the environment: no capture, every build launch by launch
#: (to compare, or to rule the capture out when something on a GPU goes wrong).
SWITCH = "COLLAGE_TVM_CUDA_GRAPHS"

#: Calls that mean TVM runs CUDA graphs of its own inside the executable.
TVM_GRAPH_CALLS = ("vm.builtin.cuda_graph.",)


def flat_numpy(out) -> list:
    """A VM result (a tensor, a scalar, a shape, or a tuple of them) as a flat list of numpy
    arrays."""
    flat: list = []

    def walk(o):
        if hasattr(o, "numpy"):
            flat.append(o.numpy())
        elif isinstance(o, (int, float, bool, np.number)):  # a scalar result (PrimValue)
            flat.append(np.asarray(o))
        elif type(o).__name__ == "Shape":  # a shape result: its dimensions
            flat.append(np.asarray(list(o), "int64"))
        else:  # a tuple of results
            for x in o:
                walk(x)

    walk(out)
    return flat


def note(state) -> str:
    """A build's ``"cuda_graph"`` entry (None off the GPU, True, or why not) for a table."""
    if state is None:
        return ""
    return "  (one CUDA graph)" if state is True else f"  (launch by launch: {state})"


#: Symbols of registered callables that replay a CUDA graph of their own (the whole model
#: on inductor in ``reduce-overhead`` mode): a capture of an executable calling one cannot
#: hold it. ``byoc.external.register`` adds them (the callable's ``captures_itself``).
_SELF_REPLAYING: set = set()


def replays_its_own_graph(symbol: str, replays: bool = True) -> None:
    """Mark (or, released, unmark) the callable registered as ``symbol``."""
    if replays:
        _SELF_REPLAYING.add(symbol)
    else:
        _SELF_REPLAYING.discard(symbol)


def captures_itself(symbol: str) -> bool:
    """Whether the callable registered as ``symbol`` replays a CUDA graph of its own."""
    return symbol in _SELF_REPLAYING


def refusal(symbols) -> str | None:
    """Why a build calling ``symbols`` (the VM's calls, in order) cannot be captured by
    torch, or None when it can."""
    for s in symbols:
        if s.startswith(TVM_GRAPH_CALLS):
            return "TVM runs its own CUDA graphs in this build (RewriteCUDAGraph)"
        if captures_itself(s):
            return f"{s} replays a CUDA graph of its own"
    return None


class Main:
    """``vm["main"]`` on fixed inputs, replayed from one CUDA graph where it could be
    captured (``captured``; else ``why`` says why not and calls run the VM as it is).

    ``replay()``: one run on the inputs given at capture (or the last ``__call__``'s),
    results left in the graph's outputs; what the timing loops call. ``__call__(*args)``:
    one run on new inputs (same shapes), returning copies of the outputs."""

    def __init__(self, vm, args, why: str | None = None, gpu: bool = True):
        self.vm, self.args, self.why, self.gpu = vm, list(args), why, gpu
        self.captured = False
        self._graph = None
        self._static: list = []
        self._outputs = None
        self._held: list = []
        main = vm["main"]
        self._eager = lambda: main(*self.args)

    @property
    def state(self):
        """What a comparison reports: None off the GPU, True when captured, else why not."""
        if not self.gpu:
            return None
        return True if self.captured else self.why

    def _uncaptured(self, why: str) -> None:
        """Run launch by launch from now on, for ``why``: the graph and what it held let go."""
        self._graph, self._held, self.why = None, [], why

    def replay(self):
        if self._graph is None:
            return self._eager()
        self._graph.replay()
        return self._outputs

    def __call__(self, *args):
        if self._graph is None:
            return self.vm["main"](*args) if args else self._eager()
        if args and len(args) != len(self._static):
            raise TypeError(f"the captured main takes {len(self._static)} inputs, "
                            f"got {len(args)}")
        for dst, src in zip(self._static, args):
            dst.copyfrom(src)
        self._graph.replay()
        return _copies(self._outputs)

    def outputs(self) -> list:
        """The outputs of one run on the fixed inputs, as numpy arrays."""
        out = self.replay()
        if self._graph is not None:
            _sync()
        return flat_numpy(out)


def _copies(out):
    """Copies of a VM result's tensors on their device (scalars and shapes as they are)."""
    import tvm

    if hasattr(out, "numpy"):
        copy = tvm.runtime.empty(out.shape, out.dtype, out.device)
        copy.copyfrom(out)
        return copy
    if isinstance(out, (int, float, bool, np.number)) or type(out).__name__ == "Shape":
        return out
    return tuple(_copies(o) for o in out)


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def capture(vm, args, target) -> Main:
    """``vm["main"](*args)`` as one CUDA graph on a cuda ``target`` (module doc); on any
    other target, or where it cannot be captured, the VM's own call (``Main.why``). The
    result is kept on the VM: a second call with the same VM returns it. ``target``: a
    ``tvm.target.Target`` or a string (``"cuda"``, ``"llvm"``).

    As ``collage_tvm.capture_cuda_graph`` for a user's own runs of a build::

        vm = relax.VirtualMachine(result.executable, tvm.cuda())
        main = collage_tvm.capture_cuda_graph(vm, [x], "cuda")
        y = main(x2)  # a replay on new inputs; copies of the outputs
    """
    known = getattr(vm, "_collage_main", None)
    if known is not None:
        return known
    if isinstance(target, str):
        from ..target import make_target

        target = make_target(target)
    if target.kind.name != "cuda":
        main = Main(vm, args, why=f"not a CUDA target ({target.kind.name})", gpu=False)
    elif os.environ.get(SWITCH, "1").strip() == "0":
        main = Main(vm, args, why=f"switched off ({SWITCH}=0)")
    else:
        main = Main(vm, args)
        try:
            _capture(main)
        except Exception as err:  # noqa: BLE001 - run uncaptured, with the reason
            text = str(err).strip()
            main._uncaptured(f"capture failed: {type(err).__name__}: "
                             f"{text.splitlines()[0] if text else ''}")
        if main.why is not None:
            logger.info("CUDA graph: not captured (%s)", main.why)
    try:
        vm._collage_main = main
    except AttributeError:  # a VM type without a __dict__: not kept
        pass
    return main


def _capture(main: Main) -> None:
    import torch
    import tvm_ffi

    vm, args = main.vm, main.args
    symbols: list = []

    def scan(func, symbol, before, ret, *call_args):
        if before:
            symbols.append(str(symbol))
        return 0  # VMInstrumentReturnKind.NO_OP

    vm.set_instrument(scan)
    try:
        vm["main"](*args)  # warm-up 1: lazy initialisation, cuDNN's algorithm search
    finally:
        vm.set_instrument(None)
    main.why = refusal(symbols)
    if main.why is not None:
        return
    main._static = [_copies(a) for a in args]
    fn = vm["main"]
    expected = flat_numpy(fn(*main._static))  # warm-up 2, on the graph's own inputs
    _sync()
    held = main._held

    def hold(func, symbol, before, ret, *call_args):
        held.extend(call_args)
        if not before and ret is not None:
            held.append(ret)
        return 0

    graph = torch.cuda.CUDAGraph()
    vm.set_instrument(hold)
    try:
        with tvm_ffi.use_torch_stream(torch.cuda.graph(graph, capture_error_mode="relaxed")):
            outputs = fn(*main._static)
    finally:
        vm.set_instrument(None)
    held.append(outputs)
    main._graph, main._outputs = graph, outputs
    got = main.outputs()
    from ..precision import compare_outputs

    ok, err = compare_outputs(got, expected)
    if not ok:
        main._uncaptured(f"a replay's outputs differ from the eager call's (max err {err:.3g})")
        return
    main.captured = True
