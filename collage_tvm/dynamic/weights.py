"""Observed shapes: how often a served model is called at each shape (issue #77, part 2).

``--shape-weights FILE`` (``SearchOptions.shape_weights``) gives the shapes a server saw,
each with a count. A text file has one observation a line, ``NAME=D1xD2[,NAME=D1xD2...]
[COUNT]`` (``input_ids=4x37 120``; no count: 1; ``#`` starts a comment); a JSON file is
``{"input_ids=4x37": 120, ...}`` or a list of such strings, one call each. An observation
names one input or several; the dynamic axes it fixes are read from the inputs it names
(inputs that share an axis share its size), any other axis stays at its optimum.

What they change:

- **The ranges.** An axis whose range is a default (not given with ``--shapes``) is
  widened to take every observed size, and its optimum is the heaviest observed point's
  size (the search runs there, and Collage's static build serves that exact point). An
  observed size outside a range the user gave is a ``ShapeError`` naming it.
- **The expected cost.** Each observation is served by the library its bucket point chose
  (``Dispatch``); the report gives the mean per call over the observations, weighted, of
  the build and of each library alone, from the figures timed at the bucket points
  (``expected_ms``). With no file, the points weigh the same.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from .shapes import STATIC, Axis, ShapeError, ShapeRanges, parse_shapes, point_key


@dataclass(frozen=True)
class ShapeWeights:
    """Observed calls: ``observed`` ((((input name, shape), ...), count), ...) and
    ``source`` (where they were read)."""

    observed: tuple
    source: str = ""

    @property
    def calls(self) -> float:
        return sum(w for _, w in self.observed)

    def describe(self) -> str:
        return (f"{len(self.observed)} observed shape{'s' if len(self.observed) != 1 else ''}"
                f" ({self.calls:g} calls{', ' + self.source if self.source else ''})")


def _observation(text: str, where: str) -> tuple:
    """"input_ids=4x37,attention_mask=4x37" -> (("attention_mask", (4, 37)), ("input_ids",
    (4, 37)))."""
    out = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            name, three = next(iter(parse_shapes([part]).items()))
        except ShapeError:
            raise ShapeError(f"{where}: {part!r} is not an observed shape: expected "
                             "NAME=D1xD2x... (e.g. input_ids=4x37)") from None
        if three[0] != three[2]:
            raise ShapeError(f"{where}: {part!r}: an observed shape is one shape, not a range")
        out[name] = three[0]
    if not out:
        raise ShapeError(f"{where}: an empty observation")
    return tuple(sorted(out.items()))


def _count(value, where: str) -> float:
    try:
        count = float(value)
    except (TypeError, ValueError):
        count = math.nan
    if not count >= 0 or math.isinf(count):
        raise ShapeError(f"{where}: the count {value!r} is not a number >= 0")
    return count


def read_shape_weights(spec) -> ShapeWeights | None:
    """``spec`` as ``ShapeWeights``: a path (text or JSON, module docstring), a dict
    {observation: count}, a list of observations, or ``ShapeWeights`` itself; None for
    nothing. A ``ShapeError`` names the file and line of what is wrong."""
    if spec is None or spec == "" or spec == ():
        return None
    if isinstance(spec, ShapeWeights):
        return spec
    source = ""
    if isinstance(spec, (str, os.PathLike)):
        path = os.fspath(spec)
        source = path
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as err:
            raise ShapeError(f"--shape-weights {path}: cannot read it ({err.strerror or err})"
                             ) from None
        if text.lstrip().startswith(("{", "[")):
            try:
                spec = json.loads(text)
            except ValueError as err:
                raise ShapeError(f"--shape-weights {path}: not valid JSON ({err})") from None
        else:
            spec = []
            for k, line in enumerate(text.splitlines(), 1):
                line = line.split("#", 1)[0].strip()
                if line:
                    fields = line.split()
                    where = f"--shape-weights {path}, line {k}"
                    if len(fields) > 2:
                        raise ShapeError(f"{where}: expected NAME=SHAPE[,NAME=SHAPE...] "
                                         f"[COUNT], got {line!r}")
                    spec.append((_observation(fields[0], where),
                                 _count(fields[1], where) if len(fields) == 2 else 1.0))
            return _merged(spec, source)
    where = f"--shape-weights {source}" if source else "shape_weights"
    if isinstance(spec, dict):
        items = [(_observation(str(k), where), _count(v, f"{where}[{k!r}]"))
                 for k, v in spec.items()]
    elif isinstance(spec, (list, tuple)):
        items = [(_observation(str(k), where), 1.0) for k in spec]
    else:
        raise ShapeError(f"{where}: expected a file, a dict of observed shapes to counts or a "
                         f"list of observed shapes, got {type(spec).__name__}")
    return _merged(items, source)


def _merged(items: list, source: str) -> ShapeWeights:
    counts: dict = {}
    for obs, w in items:
        counts[obs] = counts.get(obs, 0.0) + w
    if not counts or sum(counts.values()) <= 0:
        raise ShapeError(f"--shape-weights {source or ''}: no observed shape with a count "
                         "above 0".replace("  ", " "))
    return ShapeWeights(tuple(counts.items()), source)


def observed_points(ranges: ShapeRanges, weights: ShapeWeights,
                    check: bool = True) -> list:
    """[(point, count)]: each observation as symbol -> size (the axes it does not fix at
    their optimum). A ``ShapeError`` names an unknown input, a fixed dimension observed at
    another size, two inputs disagreeing on an axis, and (``check``) a size outside a
    range."""
    dims = {name: d for name, _, d in ranges.inputs}
    out = []
    for obs, count in weights.observed:
        point = {}
        text = ",".join(f"{n}={'x'.join(map(str, s))}" for n, s in obs)
        for name, shape in obs:
            if name not in dims:
                raise ShapeError(f"observed shape {text}: the model has no input {name!r} "
                                 f"(its inputs: {', '.join(dims)})")
            if len(shape) != len(dims[name]):
                raise ShapeError(f"observed shape {text}: input {name} has {len(dims[name])} "
                                 f"dimensions, got {len(shape)}")
            for k, (d, size) in enumerate(zip(dims[name], shape)):
                if isinstance(d, int):
                    if d != size:
                        raise ShapeError(f"observed shape {text}: dimension {k} of {name} is "
                                         f"fixed at {d}")
                elif d in ranges.derived:
                    continue  # (its size follows from the axes')
                elif point.setdefault(d, size) != size:
                    raise ShapeError(f"observed shape {text}: {d} is {point[d]} and {size}")
        full = {s: point.get(s, a.opt) for s, a in ranges.axes.items()}
        if check:
            for s, size in full.items():
                a = ranges.axes[s]
                if not a.serves(size):
                    raise ShapeError(f"observed shape {text}: {s} = {size} is outside the "
                                     f"range given ({a.min}..{a.max}); widen --shapes or "
                                     "leave that axis to its default")
        out.append((full, count))
    return out


def weighted_ranges(ranges: ShapeRanges, weights: ShapeWeights | None) -> ShapeRanges:
    """``ranges`` with each default axis widened to the observed sizes and its optimum at
    the heaviest observed point (module docstring); the given axes as they are."""
    if weights is None:
        return ranges
    points = observed_points(ranges, weights, check=False)
    heaviest = max(points, key=lambda pw: pw[1])[0]
    axes = {}
    for s, a in ranges.axes.items():
        if s in ranges.given:
            axes[s] = a
            continue
        sizes = [p[s] for p, _ in points]
        axes[s] = Axis(s, min(a.min, *sizes), heaviest[s], max(a.max, *sizes), a.open)
    out = ShapeRanges(ranges.inputs, axes, ranges.given)
    observed_points(out, weights)  # (an observed size outside a given range: named)
    return out


def expected_ms(ranges: ShapeRanges, chosen: dict, weights: ShapeWeights | None) -> dict:
    """The mean ms per call over the observed shapes (``weights``; None: each point of
    ``chosen`` once), each served at its bucket point: {"over": what was weighed, "ms":
    label -> mean ms}, "collage" for the build (the label its point chose; the static
    build only at its exact point) and each library alone (where it was timed at every
    bucket the weights reach). ``chosen``: ``search.choose``'s record."""
    records = {point_key(r["point"]): r for r in chosen["points"]}
    values = {s: sorted({int(r["point"][s]) for r in chosen["points"]}) for s in ranges.axes}
    if weights is None:  # (a point served untimed, ``search.clear_winner``, has no figures)
        pairs = [(r["point"], 1.0) for r in chosen["points"] if not r.get("inferred")]
        over = (f"the {len(pairs)} points" + (" timed" if len(pairs) < len(chosen["points"])
                                               else "") + ", equally weighted")
    else:
        pairs = observed_points(ranges, weights, check=False)
        inside = [(p, w) for p, w in pairs if all(
            ranges.axes[s].serves(v) for s, v in p.items())]
        over = weights.describe()
        if len(inside) < len(pairs):  # (a default range narrowed where the model fails)
            over += (f"; {sum(w for _, w in pairs) - sum(w for _, w in inside):g} calls "
                     "outside the range served, left out")
        pairs = inside
    special = chosen.get("special")
    totals: dict = {}
    for point, w in pairs:
        key = point_key(ranges.bucket(point, values))
        record = records.get(key)
        if record is None:
            continue
        ms = record.get("ms") or {}
        served = (STATIC if special and point == special and STATIC in ms
                  else chosen["table"].get(key))
        for label, value in [("collage", ms.get(served, math.nan))] + [
                (n, v) for n, v in ms.items() if n != STATIC]:
            t = totals.setdefault(label, [0.0, 0.0])
            if value == value:
                t[0] += w * value
                t[1] += w
    weight = sum(w for _, w in pairs)
    return {"over": over,
            "ms": {n: round(s / c, 4) for n, (s, c) in totals.items()
                   if c > 0 and abs(c - weight) <= 1e-9 * max(1.0, weight)}}


__all__ = ["ShapeWeights", "expected_ms", "observed_points", "read_shape_weights",
           "weighted_ranges"]
