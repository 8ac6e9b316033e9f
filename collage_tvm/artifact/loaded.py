"""``LoadedModule``: a loaded build's call. numpy arrays or DLPack tensors in, checked
against the manifest's inputs; the Relax VM's ``main`` on them, or, where the build is one
file run whole by a graph library, that library's own call (``_direct_call``)."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

class LoadedModule:
    """A saved build, loaded: call it with numpy arrays or DLPack tensors (torch) in the
    model's input order (or by input name); it returns the same kind, one output or a
    tuple. ``vm``: the Relax VM (``vm["main"](*tvm_tensors)``); ``manifest``: what the
    artifact says about itself; ``load_seconds``: how long ``load`` took; ``race``: the
    ``check.race.Race`` between the shipped build and its alternates that the first calls
    decide (None where there is none); ``decided``: its record (``Race.record``)."""

    def __init__(self, path, manifest, vm, executable, device, callables, load_seconds,
                 race=None):
        self.path = Path(path)
        self.race = race
        self.manifest = manifest
        self.vm = vm
        self.executable = executable  # the runtime module of kernels.so
        self.device = device
        self.load_seconds = load_seconds
        self._callables = callables   # the regions' callables (the VM holds them too)
        self._main = vm["main"]
        self.inputs = manifest["inputs"]
        self.outputs = manifest["outputs"]
        self._direct = _direct_call(manifest, callables)
        # a dynamic model's dispatch: a call's shapes are checked against its ranges
        self.dispatch = next((callables[e["symbol"]] for e in manifest.get("regions", [])
                              if e.get("format") == "dynamic"), None)
        # (dtype, shape) of each input where every dimension is a number: a call with
        # exactly these skips the full check
        self._direct_specs = [(np.dtype(i["dtype"]) if i.get("dtype") else None,
                               tuple(i["shape"]) if all(
            isinstance(d, int) for d in i.get("shape") or [None]) else None)
            for i in self.inputs]
        self._single = len(self.outputs) == 1 and not manifest.get("outputs_tuple")
        self._fast = _fast_direct(self._direct, self._direct_specs, self.dispatch is not None)

    @property
    def decided(self) -> dict | None:
        """The race between the shipped build and its alternates (``Race.record``: "chose"
        is None while the first calls still race), None where there is none."""
        return self.race.record if self.race is not None else None

    @property
    def races(self) -> list:
        """Every race of this build: the alternates' (``race``) and a dynamic model's, one
        per call shape seen where libraries ran close (``Dispatch.races``)."""
        out = [self.race] if self.race is not None else []
        if self.dispatch is not None:
            out += list(self.dispatch.races.values())
        return out

    def settle(self, *args, max_s: float = 120.0, **kwargs) -> list:
        """Calls the model on ``args`` until each race serving them is decided (at most
        ``max_s`` seconds, the libraries still loading included), as a server's first calls
        do: a benchmark's warm-up. Returns those races' records."""
        args = self._arguments(args, kwargs)
        races = [self.race] if self.race is not None else []
        deadline = time.perf_counter() + max_s
        if self.dispatch is not None:
            # (the file compiled for these exact shapes, where it serves them: made first)
            making = self.dispatch.making_at([tuple(a.shape) for a in args])
            if making is not None:
                making.wait(max_s)
            race = self.dispatch.race_at([tuple(a.shape) for a in args])
            races += [race] if race is not None else []
        while any(not r.settled for r in races) and time.perf_counter() < deadline:
            if any(r.making and not all(m.done() for m in r.making.values()) for r in races):
                time.sleep(0.01)  # (a library still loading: the first one serves alone)
            self(*args)
        return [r.record for r in races]

    @property
    def calls_library_directly(self) -> bool:
        """True where a call with numpy arrays goes to the one graph library's own call of
        the whole model (``_direct_call``), False where it goes through the Relax VM (each
        input copied into a TVM tensor and each output back)."""
        return self._direct is not None

    @property
    def input_names(self) -> list:
        return [i["name"] for i in self.inputs]

    @property
    def output_names(self) -> list:
        return [o["name"] for o in self.outputs]

    def __repr__(self) -> str:
        per = dict(self.manifest.get("placement", {}).get("ops_per_backend", {}))
        decided = self.decided
        if decided and decided["chose"] and decided["chose"] != decided["shipped"]:
            per[decided["chose"]] = per.pop(decided["shipped"], 0)
        ops = "ops: " + (", ".join(f"{b} {n}" for b, n in sorted(per.items())) or "tvm")
        if self.dispatch is not None:  # (the counts above are the optimum's build alone)
            ops = f"per shape: {', '.join(sorted(set(self.dispatch.table.values())))}"
        return (f"LoadedModule({str(self.path)!r}, inputs={self.input_names}, "
                f"outputs={self.output_names}, {ops})")

    def _arguments(self, args, kwargs) -> list:
        if kwargs:
            unknown = sorted(set(kwargs) - set(self.input_names))
            if unknown:
                raise TypeError(f"unknown input(s) {', '.join(unknown)}; the model's inputs "
                                f"are {', '.join(self.input_names)}")
            args = list(args) + [kwargs[n] for n in self.input_names[len(args):] if n in kwargs]
        if len(args) != len(self.inputs):
            raise TypeError(f"the model takes {len(self.inputs)} input(s) "
                            f"({', '.join(self.input_names)}), got {len(args)}")
        return list(args)

    def to_device(self, value, spec: dict):
        """``value`` (numpy, DLPack tensor or TVM tensor) as a TVM tensor on the device,
        checked against the input's shape and dtype."""
        import tvm

        if isinstance(value, tvm.runtime.Tensor):
            tensor = value
        elif isinstance(value, np.ndarray) or not hasattr(value, "__dlpack__"):
            tensor = tvm.runtime.tensor(np.ascontiguousarray(value), self.device)
        else:
            if hasattr(value, "detach"):  # torch
                value = value.detach().contiguous()
            try:
                tensor = tvm.runtime.from_dlpack(value)
            except Exception:  # noqa: BLE001 - e.g. not aligned as TVM needs: copy it
                tensor = tvm.runtime.tensor(np.from_dlpack(value).copy(), self.device)
        _check_input(spec, str(tensor.dtype), tuple(int(d) for d in tensor.shape))
        return tensor

    def run_tvm(self, tensors: list):
        """The VM's ``main`` on TVM tensors (no checks): TVM tensors out, as a list."""
        import tvm

        out = self._main(*tensors)
        return [out] if isinstance(out, tvm.runtime.Tensor) else list(out)

    def __call__(self, *args, **kwargs):
        fast = self._fast
        if fast is not None and not kwargs:
            outs = fast(args)
            if outs is not None:
                return outs[0] if self._single and len(outs) == 1 else tuple(outs)
        args = self._arguments(args, kwargs)
        if self._direct is not None and all(type(a) is np.ndarray for a in args):
            outs = self._call_direct(args)
        else:
            outs = self._call_vm(args)
        if len(outs) == 1 and not self.manifest.get("outputs_tuple"):
            return outs[0]
        return tuple(outs)

    def _call_vm(self, args: list) -> list:
        """The outputs of the VM's ``main`` on ``args``, each as the kind of the first."""
        tensors = [self.to_device(a, s) for a, s in zip(args, self.inputs)]
        if self.dispatch is not None:  # outside its ranges: the error names them
            self.dispatch.ranges.point_of([tuple(int(d) for d in t.shape) for t in tensors])
        return [_like(o, args[0] if args else None) for o in self.run_tvm(tensors)]

    def _call_direct(self, arrays: list) -> list:
        """numpy in, numpy out, where the build is one file run whole by one graph library
        and the VM's ``main`` only calls it (``_direct_call``): the arrays go to the
        library's call as they are (the Relax VM would first copy each into a TVM tensor)
        and the library's fresh numpy outputs come back as they are."""
        feed = []
        ranged = self.dispatch is not None  # (its dispatch checks the shapes: ``point_of``)
        for a, (dtype, shape), spec in zip(arrays, self._direct_specs, self.inputs):
            # (dtypes compared as objects: ``dtype.name`` takes microseconds a call)
            if a.dtype != dtype or (a.shape != shape and not (ranged and shape is None)):
                _check_input(spec, a.dtype.name, a.shape)  # raises, naming the input
            flags = a.flags
            feed.append(a if flags.c_contiguous and flags.writeable else np.array(a))
        return self._direct(*feed)


def _fast_direct(direct, specs: list, ranged: bool):
    """The direct call (``_direct_call``) with the least Python a call can take, or None
    where there is none: ``fast(args)`` calls the library where every argument is a
    C-contiguous, writeable numpy array of the input's dtype (the same dtype object) and
    static shape (a dynamic model's shapes its dispatch checks), and returns None, having
    called nothing, for anything else (``LoadedModule`` then checks the call in full and
    says what is wrong). Each Python step here runs while the library's threads still spin
    after its last run, when it takes many times its usual time (``_whole_call``), so a
    tiny call (bert at 1x8: 0.1 ms) pays for every one of them."""
    if direct is None:
        return None
    ndarray, n = np.ndarray, len(specs)
    if any(shape is None for _, shape in specs) and not ranged:
        return None

    def fast(args):
        if len(args) != n:
            return None
        for a, (dtype, shape) in zip(args, specs):
            if type(a) is not ndarray or a.dtype is not dtype or (
                    shape is not None and a.shape != shape):
                return None
            flags = a.flags
            if not (flags.c_contiguous and flags.writeable):
                return None
        return direct(*args)

    return fast


def _direct_call(manifest: dict, callables: dict):
    """Where the build is one file run whole by a graph library on the CPU, and the VM's
    ``main`` does nothing but call it with the model's inputs in order (the user's model
    file: ``byoc.whole``; TVM's import exported as one region: "passes_through", checked at
    save by ``_passes_through``; either one with the user's file put in its place by the
    alternates at load), the library's own call of it on numpy arrays, returning fresh
    numpy outputs (the region callable's ``numpy_call``), which ``LoadedModule`` calls
    itself. None otherwise (artifacts saved before "model_file" was written included)."""
    regions = manifest.get("regions") or []
    if manifest.get("device") == "cuda" or len(regions) != 1 or not (
            regions[0].get("model_file") or regions[0].get("passes_through")
            or regions[0].get("format") == "dynamic"):
        return None
    return getattr(callables.get(regions[0]["symbol"]), "numpy_call", None)


def _check_input(spec: dict, dtype: str, got: tuple) -> None:
    """``ValueError`` naming the input unless ``dtype`` and shape ``got`` are the ones
    ``spec`` (a manifest input) gives (a dimension that is not a number takes any size)."""
    shape, want = spec.get("shape"), spec.get("dtype")
    if (want and dtype != want) or (shape is not None and (
            len(got) != len(shape)
            or any(isinstance(d, int) and d != g for d, g in zip(shape, got)))):
        raise ValueError(f"input {spec['name']}: expected {want}{list(shape or [])}, got "
                         f"{dtype}{list(got)}")


def _like(tensor, example):
    """TVM tensor ``tensor`` as the kind of ``example``: numpy (a copy), a torch tensor or
    another DLPack framework's (zero-copy), or the TVM tensor itself."""
    import tvm

    if example is None or isinstance(example, np.ndarray) or not hasattr(example, "__dlpack__"):
        return tensor.numpy()
    if isinstance(example, tvm.runtime.Tensor):
        return tensor
    root = type(example).__module__.split(".", 1)[0]
    from_dlpack = getattr(sys.modules.get(root), "from_dlpack", None)
    if from_dlpack is None:
        return tensor.numpy()
    return from_dlpack(tensor)
