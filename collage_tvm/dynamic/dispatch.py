"""The build of a dynamic model: one call that sends each shape to what serves it best.

``Dispatch`` holds, per representative point of the ranges (``ShapeRanges.points``), the
label of the library chosen there (each library runs the user's file, which serves every
shape), and optionally a specialization: a static build of Collage's (searched at the
optimum) that serves that one point exactly. A call's shapes pick their point as
``ShapeRanges.bucket`` says (the least point at or above each size); nothing is padded, so
every shape computes what the model computes.

The executable's ``main`` takes symbolic shapes and makes one ``call_pure_packed`` into the
dispatch (``dynamic_module``), so it runs in a Relax VM as any other build.
"""
from __future__ import annotations

import numpy as np

from .shapes import STATIC, ShapeRanges, key_point, point_key


# Where another library ran a point within this share of the chosen one's time in the
# search, the serving process races them at the shapes it is called with (``check.race``):
# gpt2 at 1x8 on the AMX Xeon, OpenVINO 25% ahead of ONNX Runtime in the search's process,
# 15% behind it in the bench's (docs/BENCHMARKS.md, dynamic shapes).
RACE_SHARE = 0.35
# The most call shapes raced in one process; later new shapes go to the table's choice.
MAX_RACES = 256
# A point's "fixed" contender: the user's file on a library compiled for that point's exact
# shapes (``GraphLibraryLowering.fixes_shapes``), labelled as the library with this suffix.
FIXED = "@fixed"


def fixed_label(library: str) -> str:
    return library + FIXED


def fixed_library(label: str) -> str | None:
    """The library of a fixed contender's label, None for any other label."""
    return label[:-len(FIXED)] if label.endswith(FIXED) else None


def close_labels(points: list, share: float = RACE_SHARE) -> dict:
    """point key -> the labels timed at that point within ``share`` of the fastest there,
    fastest first (``choose``'s records: {"point", "chose", "ms"}); only points where more
    than one is close."""
    out = {}
    for record in points:  # (a fixed contender serves its point's exact shapes: no race)
        ms = {n: v for n, v in (record.get("ms") or {}).items()
              if v and v == v and fixed_library(n) is None}
        if len(ms) < 2:
            continue
        best = min(ms.values())
        close = sorted((n for n, v in ms.items() if v <= best * (1 + share)), key=ms.get)
        if len(close) > 1:
            out[point_key(record["point"])] = close
    return out


class Dispatch:
    """``Dispatch(ranges, table, fns, special=None, close=None, accuracy="f32",
    making=None, exact=None)``: a callable on TVM tensors (and ``numpy_call`` on numpy
    arrays) that runs ``fns[table[bucket]]`` for the call's shapes.

    ``table``: point key (``point_key``) -> label of ``fns``; ``fns``: label -> callable
    (TVM tensors in and out; with ``numpy_call``); ``special``: (point, callable) where a
    static build serves one point exactly (it also has ``numpy_call``). ``close``: point
    key -> labels that ran it within ``RACE_SHARE`` of each other (``close_labels``): at
    each call shape of such a point, the first calls race them (``check.race.Race``, the
    table's choice first; "collage", the static build, only at its exact point), within
    the ``accuracy`` budget; ``making``: label -> ``check.race.Making`` of libraries that
    only race (made in a thread). ``exact``: point key -> (library, its callable for the
    point's exact shapes, or the ``check.race.Making`` of it): a call of exactly those
    shapes goes to it (once made; the table's choice serves meanwhile), any other shape of
    its bucket to the table's choice."""

    def __init__(self, ranges: ShapeRanges, table: dict, fns: dict, special=None,
                 close: dict | None = None, accuracy="f32", making: dict | None = None,
                 exact: dict | None = None):
        self.ranges = ranges
        self.table = dict(table)
        self.fns = dict(fns)
        self.special = special
        self.close = dict(close or {})
        self.accuracy = accuracy
        self.making = dict(making or {})
        self.exact = dict(exact or {})
        points = [key_point(key) for key in self.table]
        self.values = {s: sorted({p[s] for p in points if s in p}) for s in ranges.axes}
        self._by_shapes: dict = {}  # input shapes -> callable (bounded: ``_pick``)
        self._numpy_by_shapes: dict = {}  # input shapes -> the numpy_call serving them
        self.races: dict = {}       # input shapes -> its ``Race``

    def _pick(self, shapes: tuple):
        """The callable for a call with input ``shapes`` (a tuple of tuples); raises
        ``ShapeError`` (naming the range and the flag) outside the ranges."""
        fn = self._by_shapes.get(shapes)
        if fn is not None:
            return fn
        point = self.ranges.point_of(shapes)
        key = point_key(self.ranges.bucket(point, self.values))
        fixed = self._fixed(point_key(point))
        if fixed is not None:
            if fixed is not _PENDING and len(self._by_shapes) < 4096:
                self._by_shapes[shapes] = fixed
            return self.fns[self.table[key]] if fixed is _PENDING else fixed
        exact = self.special is not None and point == self.special[0]
        fn = self.special[1] if exact else self.fns[self.table[key]]
        close = [n for n in self.close.get(key, ()) if exact or n != STATIC]
        if len(close) > 1 and len(self.races) < MAX_RACES:
            fn = self._race(shapes, "collage" if exact else self.table[key], fn, close)
        if len(self._by_shapes) < 4096:
            self._by_shapes[shapes] = fn
        return fn

    def _fixed(self, key: str):
        """The fixed contender serving point ``key`` exactly: its callable, ``_PENDING``
        while its library still compiles it, None where there is none (or it failed to be
        made: logged, and the table's choice serves)."""
        entry = self.exact.get(key)
        if entry is None:
            return None
        library, fn = entry
        if hasattr(fn, "done"):  # (a ``Making``)
            if not fn.done():
                return _PENDING
            try:
                fn = fn.result()
            except Exception as err:  # noqa: BLE001 - the table's choice serves instead
                import logging

                logging.getLogger("collage_tvm").warning(
                    "%s could not compile the model for %s (%s): the dynamic session serves "
                    "it", library, key, err)
                del self.exact[key]
                return None
            self.exact[key] = (library, fn)
        return fn

    def making_at(self, shapes):
        """The ``Making`` of the fixed contender for call ``shapes`` while it is made, else
        None."""
        point = self.ranges.point_of([tuple(int(d) for d in s) for s in shapes])
        entry = self.exact.get(point_key(point))
        fn = entry[1] if entry is not None else None
        return fn if hasattr(fn, "done") and not fn.done() else None

    def _race(self, shapes: tuple, chosen: str, fn, close: list):
        """A ``Race`` at call ``shapes`` between the choice ``chosen`` (``fn``) and the
        other ``close`` labels."""
        from ..check.race import Race

        fns, making = {chosen: fn}, {}
        for label in close:
            if label == chosen:
                continue
            if label == STATIC:
                fns[label] = self.special[1]
            elif label in self.fns:
                fns[label] = self.fns[label]
            elif label in self.making:
                making[label] = self.making[label]
        if len(fns) + len(making) < 2:
            return fn
        race = Race(fns, self.accuracy, making)
        self.races[shapes] = race
        return race

    def label_for(self, shapes) -> str:
        """Which build serves a call with input ``shapes``: a label of ``fns``, or
        "collage" for the specialization (where a race at these shapes is not decided
        yet: "racing: " and its contenders)."""
        from ..check.race import Race

        fn = self._pick(tuple(tuple(int(d) for d in s) for s in shapes))
        if isinstance(fn, Race):
            if not fn.settled:
                return "racing: " + ", ".join(list(fn.fns) + list(fn.making))
            return fn.chose
        if self.special is not None and fn is self.special[1]:
            return STATIC
        fixed = next((lib for lib, f in self.exact.values() if f is fn), None)
        if fixed is not None:
            return fixed_label(fixed)
        return next(label for label, f in self.fns.items() if f is fn)

    def race_at(self, shapes):
        """The ``Race`` serving calls of input ``shapes`` (None where nothing races)."""
        from ..check.race import Race

        fn = self._pick(tuple(tuple(int(d) for d in s) for s in shapes))
        return fn if isinstance(fn, Race) else None

    def __call__(self, *args):
        return self._pick(tuple(tuple(a.shape) for a in args))(*args)

    def numpy_call(self, *arrays):
        """numpy in, numpy out (a list), as the libraries' own ``numpy_call``."""
        shapes = tuple([a.shape for a in arrays])
        call = self._numpy_by_shapes.get(shapes)
        if call is None:
            call = self._numpy_call_for(shapes)
        return call(*arrays)

    def _numpy_call_for(self, shapes: tuple):
        """The ``numpy_call`` serving ``shapes``: the library's own once a race there is
        decided (kept, so that later calls skip the race's and this dispatch's steps; see
        ``artifact.loaded._fast_direct``), the race's while it is not."""
        from ..check.race import Race

        fn = self._pick(shapes)
        if isinstance(fn, Race):
            if not fn.settled:
                return fn.numpy_call
            fn = fn.fns[fn.chose]
        if shapes not in self._by_shapes:  # (a fixed contender still made: not yet)
            return fn.numpy_call
        if len(self._numpy_by_shapes) < 4096:
            self._numpy_by_shapes[shapes] = fn.numpy_call
        return fn.numpy_call


_PENDING = object()  # a fixed contender still being made (``Dispatch._fixed``)


class StaticBuild:
    """A static build (a Relax VM's ``main``) as a dispatch target: called on TVM tensors,
    and on numpy arrays through ``numpy_call``."""

    def __init__(self, main, device):
        self.main, self.device = main, device

    def __call__(self, *args):
        return self.main(*args)

    def numpy_call(self, *arrays):
        import tvm

        out = self.main(*(tvm.runtime.tensor(np.ascontiguousarray(a), self.device)
                          for a in arrays))
        outs = [out] if isinstance(out, tvm.runtime.Tensor) else list(out)
        return [o.numpy() for o in outs]


def dynamic_module(ranges: ShapeRanges, symbol: str, out_dtypes: list):
    """A Relax module whose ``main`` takes the model's inputs with symbolic dimensions
    (one ``tirx.Var`` per symbol, shared between inputs) and returns what the packed
    function ``symbol`` returns for them (outputs of known rank and dtype, shapes as
    the call gives them)."""
    import tvm
    from tvm import relax

    from ..byoc.whole import one_call_module

    variables = {s: tvm.tirx.Var(s, "int64") for s in ranges.axes}
    for text in ranges.derived:  # (its own variable, named as the export names it; the
        variables[text] = tvm.tirx.Var(text, "int64")  # dispatch checks it: ``point_of``)
    ins = [relax.TensorType([variables[d] if isinstance(d, str) else d for d in dims], dtype)
           for _, dtype, dims in ranges.inputs]
    return one_call_module(symbol, ins, [relax.TensorType(ndim=rank, dtype=dtype)
                                         for rank, dtype in out_dtypes])


def output_types(proto) -> list:
    """[(rank, dtype)] of ``proto``'s graph outputs."""
    import onnx

    out = []
    for vi in proto.graph.output:
        t = vi.type.tensor_type
        rank = len(t.shape.dim) if t.HasField("shape") else -1
        out.append((rank, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).name))
    return out


def library_call(backend, proto, path: str | None, names: list, out_types: list,
                 shapes: dict | None = None):
    """The user's dynamic file on graph library ``backend``: one session (compiled model)
    serving every shape; its callable on TVM tensors, with ``numpy_call``. ``shapes``
    (input name -> shape; a library that ``fixes_shapes``): compiled for those shapes
    only, a point's fixed contender."""
    from ..export.onnx import OnnxFile

    lowering = backend.get_lowering()
    source = (OnnxFile(path, tuple(names))
              if path is not None and getattr(lowering, "reads_files", False) else proto)
    specs = [(None, dtype) for _, dtype in out_types]
    if shapes:
        return lowering.compile(source, specs, True, shapes=shapes)
    return lowering.compile(source, specs, True)


__all__ = ["Dispatch", "FIXED", "RACE_SHARE", "StaticBuild", "close_labels", "dynamic_module",
           "fixed_label", "fixed_library", "library_call", "output_types", "point_key"]
