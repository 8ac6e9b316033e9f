"""The shapes a model with dynamic dimensions is built for: one range per dynamic axis.

An ONNX export names its dynamic axes (``dim_param``: "batch", "sequence"); the inputs that
share a name share the size. As TensorRT's optimization profiles, each named axis gets a
range and an optimum (``min:opt:max``): the build serves every size in the range, is
searched at the optimum, and its choice per shape is made at representative points of the
range (``ShapeRanges.points``, powers of two).

``--shapes input_ids=1x1:1x128:8x512`` sets the axes of one input from three shapes (min,
opt, max; one shape: that size alone). With no flag, ``default_ranges`` reads the model:
a batch axis (the first) 1 to 8 around 1; another axis 1 up to the model's positions (a
position embedding's rows) or 512, around 128; an image's spatial axis (a detector or
segmentation export with dynamic height and width) timed at 224 and open: it serves any
size, as the file does, each on the choice made at 224 (``Axis.open``).

A dimension named by an expression over the other axes' names (Hugging Face optimum's
decoder export: an ``attention_mask`` of ``batch_size x past_sequence_length + 1``; the
dynamo exporter's ``s0 + s1``) is not an axis of its own: its size follows from theirs
(``derived_dims``), at every point timed and in every call served.
"""
from __future__ import annotations

import ast
import math
import operator
import os
import re
from dataclasses import dataclass, field

# Defaults for an axis the user did not give (``default_ranges``)
BATCH_RANGE = (1, 1, 8)
SEQUENCE_OPT = 128
SEQUENCE_MAX = 512
# Most points a symbol gets in ``ShapeRanges.points`` before they thin out to every other
# power of two (two symbols of 1..512 would otherwise make 100 points to time)
MAX_POINTS_PER_SYMBOL = 6
# Most points of the whole grid (``grid_values``): past it the symbol with the most points
# thins again (every other point between its min, opt and max) until the grid fits. Two
# symbols (batch x sequence: 4 x 6) fit; three (an optimum-style decoder with a cache:
# batch x past x sequence) made 120 points, 87 of them timed in a 14-minute search.
MAX_GRID_POINTS = 48


STATIC = "collage"  # the label of Collage's static build at the optimum (``dispatch``)


def point_key(point: dict) -> str:
    """A point as text: "batch=1,sequence=128" (symbols sorted): the dispatch table's key."""
    return ",".join(f"{s}={point[s]}" for s in sorted(point))


def key_point(key: str) -> dict:
    """The point of a ``point_key`` text: "batch=1,sequence=128" -> {"batch": 1, ...}."""
    return {s: int(v) for s, v in (kv.split("=") for kv in key.split(","))} if key else {}


class ShapeError(ValueError):
    """A shape range that does not fit the model, or a call's shapes outside the range; the
    message names the input and the fix."""


@dataclass(frozen=True)
class Axis:
    """A dynamic axis: its ``symbol`` (the export's name) and the range it is built for."""

    symbol: str
    min: int
    opt: int
    max: int
    # Served at any size, not only min..max (which are the sizes timed): a default the
    # model gives no range for (an image's height and width), where refusing a size the
    # user's file runs would make the build serve less than the file
    open: bool = False

    def __str__(self) -> str:
        if self.open:
            timed = (f"{self.opt}" if self.min == self.max else
                     f"{self.min}..{self.max}, opt {self.opt}")
            return f"{self.symbol} any size (timed at {timed})"
        return f"{self.symbol} {self.min}..{self.max} (opt {self.opt})"

    def serves(self, size: int) -> bool:
        return size >= 1 if self.open else self.min <= size <= self.max


# ---------------------------------------------------------------- derived dimensions

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Div: operator.truediv}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
# (sympy's names, as the dynamo exporter writes them, and Python's)
_CALLS = {"floor": math.floor, "ceiling": math.ceil, "ceil": math.ceil, "Max": max,
          "Min": min, "max": max, "min": min, "Mod": operator.mod,
          "FloorDiv": operator.floordiv}


class Derived:
    """A dimension whose size is an expression over axes (``past_sequence_length + 1``):
    ``names`` the axes it reads; called with a point (symbol -> size), its size."""

    def __init__(self, text: str, tree, names: set):
        self.text, self._tree, self.names = text, tree, frozenset(names)

    def __call__(self, point: dict) -> int:
        value = _evaluate(self._tree, point)
        if value != int(value):
            raise ShapeError(f"{self.text} is not a whole number at "
                             f"{point_key({n: point[n] for n in self.names})}")
        return int(value)


def _evaluate(node, point: dict):
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, point)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return point[node.id]
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_evaluate(node.left, point), _evaluate(node.right, point))
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_evaluate(node.operand, point))
    return _CALLS[node.func.id](*(_evaluate(a, point) for a in node.args))


def _expression(text: str):
    """(tree, names) where ``text`` is an arithmetic expression (integers, names, + - * //
    % /, sympy's floor/ceiling/Max/Min/Mod) that is not one name alone; else None."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return None
    if isinstance(tree.body, ast.Name):
        return None
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Call):
            if not (isinstance(node.func, ast.Name) and node.func.id in _CALLS
                    and not node.keywords):
                return None
        elif isinstance(node, ast.Constant):
            if type(node.value) is not int:
                return None
        elif not isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Load,
                                   *_BINARY, *_UNARY)):
            return None
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call)}
    return tree, names - calls


def derived_dims(inputs: list) -> dict:
    """dim text -> ``Derived`` for each dimension of ``inputs`` ([(name, dtype, dims)]) named
    by an expression over the names of other dimensions (each of those a plain symbol of
    some input); any other named dimension is an axis of its own."""
    texts = {d for _, _, dims in inputs for d in dims if isinstance(d, str)}
    parsed = {t: _expression(t) for t in texts}
    symbols = {t for t, p in parsed.items() if p is None}
    return {t: Derived(t, *p) for t, p in parsed.items()
            if p is not None and p[1] and p[1] <= symbols}


@dataclass
class ShapeRanges:
    """The inputs of a dynamic model and the range of each of their dynamic axes.

    ``inputs``: [(name, dtype, dims)], a dim an int, a symbol or an expression over symbols
    (``derived``: its size follows from theirs); ``axes``: symbol -> Axis; ``given``: the
    symbols whose range the user gave (the others are defaults)."""

    inputs: list
    axes: dict
    given: set = field(default_factory=set)
    derived: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        self.derived = {t: e for t, e in derived_dims(self.inputs).items()
                        if t not in self.axes}

    # ------------------------------------------------------------------ shapes
    def size(self, dim, point: dict) -> int:
        """The size of ``dim`` (an int, a symbol or a derived expression) at ``point``."""
        if not isinstance(dim, str):
            return dim
        return point[dim] if dim in point else self.derived[dim](point)

    def shapes(self, point: dict) -> dict:
        """input name -> static shape at ``point`` (symbol -> size)."""
        return {name: tuple(self.size(d, point) for d in dims)
                for name, _, dims in self.inputs}

    def opt(self) -> dict:
        return {s: a.opt for s, a in self.axes.items()}

    def opt_shapes(self) -> dict:
        return self.shapes(self.opt())

    def points(self) -> list:
        """The representative points the choice per shape is made at: each symbol's min,
        opt, max and the powers of two between (every other one past
        ``MAX_POINTS_PER_SYMBOL``, fewer where the grid would pass ``MAX_GRID_POINTS``:
        ``grid_values``), all combinations, the optimum first."""
        per = grid_values(self.axes)
        out = [{}]
        for s, values in per.items():
            out = [{**p, s: v} for p in out for v in values]
        opt = self.opt()
        return [opt] + [p for p in out if p != opt]

    def point_of(self, shapes: list) -> dict:
        """symbol -> size of a call with input ``shapes`` (in input order); a ``ShapeError``
        naming the input, the axis and the range when a size is outside it or two inputs
        disagree on one symbol."""
        point: dict = {}
        later = []
        for (name, _, dims), got in zip(self.inputs, shapes):
            if len(got) != len(dims):
                raise ShapeError(f"input {name}: expected {len(dims)} dimensions "
                                 f"({self.describe_input(name)}), got {list(got)}")
            for axis, (d, g) in enumerate(zip(dims, got)):
                if isinstance(d, int):
                    if d != g:
                        raise ShapeError(f"input {name}: dimension {axis} is {d}, got "
                                         f"{list(got)}")
                    continue
                if d in self.derived:
                    later.append((name, axis, d, g))
                    continue
                a = self.axes[d]
                if not a.serves(g):
                    raise ShapeError(
                        f"input {name}: {d} = {g} is outside the range this build serves "
                        f"({a.min}..{a.max}); build it again with a wider range: "
                        f"--shapes {name}={self.spec_for(name, {d: (min(a.min, g), a.opt, max(a.max, g))})}"
                        f" (shapes= in Python)")
                if point.setdefault(d, g) != g:
                    raise ShapeError(f"input {name}: {d} = {g}, but another input has {d} = "
                                     f"{point[d]}")
        for name, axis, d, g in later:
            want = self.derived[d](point)
            if want != g:
                raise ShapeError(f"input {name}: dimension {axis} is {d}, {want} with the "
                                 f"other inputs' sizes ({point_key(point)}), got {g}")
        return point

    def bucket(self, point: dict, values: dict) -> dict:
        """The representative point that serves ``point``: per symbol, the least of its
        ``values`` (sorted) that is >= the size (the max is always one)."""
        return {s: next((v for v in values[s] if v >= size), values[s][-1])
                for s, size in point.items()}

    # ------------------------------------------------------------------ text
    def spec_for(self, name: str, override: dict | None = None) -> str:
        """``min:opt:max`` shapes of input ``name`` as ``--shapes`` takes them."""
        axes = {s: (a.min, a.opt, a.max) for s, a in self.axes.items()}
        axes.update(override or {})
        dims = next(d for n, _, d in self.inputs if n == name)
        return ":".join("x".join(str(self.size(d, {s: v[k] for s, v in axes.items()}))
                                 for d in dims) for k in range(3))

    def describe_input(self, name: str) -> str:
        dims = next(d for n, _, d in self.inputs if n == name)
        return "x".join(str(d) for d in dims)

    def describe(self) -> str:
        """One line: each axis's range, and which were defaults."""
        parts = []
        for s, a in self.axes.items():
            parts.append(f"{a}" + ("" if s in self.given else " [default]"))
        return "; ".join(parts)

    def flags(self) -> str:
        """The ``--shapes`` flags that give these ranges."""
        return " ".join(f"--shapes {n}={self.spec_for(n)}" for n, _, d in self.inputs
                        if any(isinstance(x, str) for x in d))

    # ------------------------------------------------------------------ json
    def to_json(self) -> dict:
        return {"inputs": [{"name": n, "dtype": t, "dims": list(d)} for n, t, d in self.inputs],
                "axes": {s: [a.min, a.opt, a.max] + ([1] if a.open else [])
                         for s, a in self.axes.items()},
                "given": sorted(self.given)}

    @classmethod
    def from_json(cls, doc: dict) -> "ShapeRanges":
        return cls([(i["name"], i["dtype"], list(i["dims"])) for i in doc["inputs"]],
                   {s: Axis(s, *map(int, v[:3]), open=bool(v[3:4] and v[3]))
                    for s, v in doc["axes"].items()},
                   set(doc.get("given", ())))


def symbol_points(axis: Axis) -> list:
    """The sizes of ``axis`` a choice is made at: min, opt, max and powers of two between
    (every other one, counted from the optimum, where there are too many)."""
    powers = [1 << k for k in range(0, 31) if axis.min < (1 << k) < axis.max]
    if len(powers) + 3 > MAX_POINTS_PER_SYMBOL:
        anchor = math.log2(axis.opt) if axis.opt > 0 else 0
        powers = [p for p in powers if round(math.log2(p) - anchor) % 2 == 0]
    return sorted({axis.min, axis.opt, axis.max, *powers})


def _thinned(values: list, axis: Axis) -> list:
    """``values`` (sorted) with every other point dropped between ``axis``' min, opt and
    max (those stay): of each run of points between two of them, the first, third, ...
    stay (a run of one stays whole); the same list where there is nothing to drop."""
    anchors = {axis.min, axis.opt, axis.max}
    out, run = [], 0
    for v in values:
        if v in anchors:
            out.append(v)
            run = 0
            continue
        run += 1
        if run % 2 == 1:
            out.append(v)
    return out


def grid_values(axes: dict) -> dict:
    """symbol -> the sizes the choice is made at (``symbol_points``), thinned where the
    grid of all their combinations would pass ``MAX_GRID_POINTS``: the symbol with the most
    points first (``_thinned``), until it fits or none can thin."""
    per = {s: symbol_points(a) for s, a in axes.items()}
    while math.prod(len(v) for v in per.values()) > MAX_GRID_POINTS:
        for s in sorted(per, key=lambda s: -len(per[s])):
            fewer = _thinned(per[s], axes[s])
            if len(fewer) < len(per[s]):
                per[s] = fewer
                break
        else:
            break
    return per


# ---------------------------------------------------------------------------- reading

def _dims(value_info) -> list:
    """A graph input's dims: an int, a symbol (its ``dim_param``), or None (unnamed)."""
    t = value_info.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [int(d.dim_value) if d.HasField("dim_value") else (d.dim_param or None)
            for d in t.shape.dim]


def model_inputs(proto) -> list:
    """[(name, dtype, dims)] of ``proto``'s graph inputs that are not weights; an unnamed
    dynamic axis gets the symbol ``<input>_<axis>``; an input of unknown rank is a
    ``ShapeError``."""
    import numpy as np
    import onnx

    weights = {t.name for t in proto.graph.initializer}
    out = []
    for vi in proto.graph.input:
        if vi.name in weights:
            continue
        dims = _dims(vi)
        if dims is None:
            raise ShapeError(f"input {vi.name!r} has an unknown rank: Collage cannot tell "
                             "its shapes; export it with a known rank")
        dims = [d if d is not None else f"{vi.name}_{k}" for k, d in enumerate(dims)]
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(
            vi.type.tensor_type.elem_type)).name
        out.append((vi.name, dtype, dims))
    return out


def is_dynamic(proto) -> bool:
    """Whether an input of ``proto`` has a dimension that is not a number."""
    try:
        return any(isinstance(d, str) for _, _, dims in model_inputs(proto) for d in dims)
    except ShapeError:
        return True


def positions(proto) -> int | None:
    """The model's positions: the rows of a 2-D float weight whose name says "position"
    (a position embedding; GPT-2's "wpe"), else None."""
    best = None
    for t in proto.graph.initializer:
        if len(t.dims) == 2 and re.search(r"position|(^|[._])wpe([._]|$)", t.name, re.I) \
                and t.data_type in (1, 10, 16):
            best = max(best or 0, int(t.dims[0]))
    return best


def default_axis(symbol: str, axis: int, rank: int, proto) -> Axis:
    """The range of an axis the user did not give: the batch (a symbol naming a batch, or
    axis 0 unless its name says a length: "seq", "len", "token", "past", "time", "frame")
    1..8 around 1; an image's spatial axis (2 or 3 of a 4-D input) timed at 224 and
    open (any size served); any other (a sequence) 1..the model's positions (or 512) around
    128, a cache's length ("past", "cache") from 0: a decoder's first step has an empty
    cache (``search.narrowed`` moves it to 1 where no library runs an empty one)."""
    name = symbol.lower()
    lengthy = re.search(r"seq|len|token|past|time|frame", name) is not None
    if "batch" in name or (axis == 0 and not lengthy):  # (a sequence-first export: its length)
        return Axis(symbol, *BATCH_RANGE)
    if rank == 4 and axis in (2, 3) and not lengthy:
        return Axis(symbol, 224, 224, 224, open=True)
    top = positions(proto) or SEQUENCE_MAX
    least = 0 if re.search(r"past|cache", name) else 1
    return Axis(symbol, least, min(SEQUENCE_OPT, top), top)


def parse_shapes(specs) -> dict:
    """``["x=1x3x224x224:4x3x224x224:8x3x224x224", "y=1x8"]`` (the CLI's ``--shapes``) ->
    {name: (min shape, opt shape, max shape)}; one shape stands for all three."""
    out = {}
    for spec in specs or []:
        name, _, text = str(spec).rpartition("=")
        shapes = []
        for part in text.split(":"):
            try:
                shapes.append(tuple(int(d) for d in part.lower().split("x")))
            except ValueError:
                shapes = []
                break
        if len(shapes) == 1:
            shapes *= 3
        if (not name or len(shapes) != 3 or not shapes[0]
                or len({len(s) for s in shapes}) != 1 or min(min(s) for s in shapes) < 0):
            raise ShapeError(f"--shapes {spec!r}: expected NAME=MIN:OPT:MAX, each D1xD2x... "
                             "(e.g. input_ids=1x1:1x128:8x512), or NAME=D1xD2x... for one "
                             "shape")
        out[name] = tuple(shapes)
    return out


def shape_ranges(proto, given: dict | None = None) -> ShapeRanges:
    """The ranges ``proto`` is built for: ``given`` (``parse_shapes``'s form, or name ->
    one static shape as ``input_shapes`` takes it) where the user gave them, defaults
    (``default_axis``) elsewhere. A ``ShapeError`` names an unknown input, a fixed
    dimension given another size, a range out of order, or two inputs that give one
    symbol two ranges."""
    inputs = model_inputs(proto)
    names = [n for n, _, _ in inputs]
    given = dict(given or {})
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ShapeError(f"--shapes names no input of the model: {', '.join(unknown)}; its "
                         f"inputs: {', '.join(names)}")
    axes: dict = {}
    chosen: set = set()
    derived = derived_dims(inputs)
    follow = []  # (input, dimension, its derived text, the (min, opt, max) given)
    for name, _, dims in inputs:
        if name not in given:
            continue
        three = given[name]
        if three and isinstance(three[0], int):  # one static shape
            three = (tuple(three),) * 3
        if any(len(s) != len(dims) for s in three):
            raise ShapeError(f"--shapes {name}: the input has {len(dims)} dimensions "
                             f"({'x'.join(map(str, dims))}), got {len(three[0])}")
        for k, d in enumerate(dims):
            lo, opt, hi = (int(s[k]) for s in three)
            if isinstance(d, int):
                if not lo == opt == hi == d:
                    raise ShapeError(f"--shapes {name}: dimension {k} is fixed at {d} in the "
                                     f"model, got {lo}:{opt}:{hi}")
                continue
            if d in derived:
                follow.append((name, k, d, (lo, opt, hi)))
                continue
            if not 0 <= lo <= opt <= hi or hi < 1:
                raise ShapeError(f"--shapes {name}: dimension {k} ({d}) needs min <= opt <= "
                                 f"max, got {lo}:{opt}:{hi}")
            axis = Axis(d, lo, opt, hi)
            if lo == opt == hi:  # (the flags a refusal names keep an open axis open)
                default = default_axis(d, k, len(dims), proto)
                if default.open and (lo, opt, hi) == (default.min, default.opt, default.max):
                    axis = default
            if d in axes and axes[d] != axis:
                raise ShapeError(f"--shapes {name}: {d} is {lo}:{opt}:{hi} here but "
                                 f"{axes[d].min}:{axes[d].opt}:{axes[d].max} for another input")
            axes[d] = axis
            chosen.add(d)
    for name, _, dims in inputs:
        for k, d in enumerate(dims):
            if isinstance(d, str) and d not in axes and d not in derived:
                axes[d] = default_axis(d, k, len(dims), proto)
    for name, k, d, three in follow:  # (a derived size given must be what it follows as)
        want = tuple(derived[d]({s: (a.min, a.opt, a.max)[j] for s, a in axes.items()})
                     for j in range(3))
        if three != want:
            raise ShapeError(f"--shapes {name}: dimension {k} is {d} in the model, "
                             f"{':'.join(map(str, want))} with the other axes' ranges, got "
                             f"{':'.join(map(str, three))}; give the range of "
                             f"{', '.join(sorted(derived[d].names))} at an input that has it")
    return ShapeRanges(inputs, axes, chosen)


def dynamic_model(model, shapes=(), input_shapes: dict | None = None):
    """(proto, path or None, ``ShapeRanges``) of an ONNX ``model`` (a path or a
    ``ModelProto``) with a dimension that neither ``input_shapes`` (static shapes, as
    ``--input-shape`` gives) fixes; None for any other model. ``shapes``:
    ``SearchOptions.shapes`` ((name, (min, opt, max)), ...). (The observed shapes a user
    gives move the ranges after: ``weights.weighted_ranges``.)"""
    path = None
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not (path.endswith(".onnx") and os.path.isfile(path)):
            return None  # load_model names what is wrong
        import onnx

        try:
            header = onnx.load(path, load_external_data=False)
        except Exception:  # noqa: BLE001 - load_model names what is wrong
            return None
    elif type(model).__name__ == "ModelProto":
        header = model
    else:
        return None
    if not is_dynamic(header):
        return None
    inputs = _inputs(header)
    if not inputs or set(input_shapes or {}) - {n for n, _, _ in inputs}:
        return None  # an input of unknown rank, or a name that is not an input: load_model says
    given = dict(shapes or ())
    for name, shape in (input_shapes or {}).items():
        given[name] = (tuple(shape),) * 3  # a static shape given wins
    ranges = shape_ranges(header, given)
    if all(a.min == a.opt == a.max for a in ranges.axes.values()) and input_shapes:
        return None  # the static shapes the user gave: the static build, as before
    proto = header if path is None else _full(path, header)
    return proto, path, ranges


def _inputs(proto) -> list:
    from .shapes import model_inputs

    try:
        return model_inputs(proto)
    except ShapeError:
        return []


def _full(path: str, header):
    """The model at ``path`` with its weights (read once more only where they are outside
    the file)."""
    import onnx

    if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in header.graph.initializer):
        return header
    return onnx.load(path)



__all__ = ["Axis", "Derived", "dynamic_model", "ShapeError", "ShapeRanges", "default_axis",
           "derived_dims", "is_dynamic", "model_inputs", "parse_shapes", "shape_ranges",
           "grid_values", "symbol_points"]
