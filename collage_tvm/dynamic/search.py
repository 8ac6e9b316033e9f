"""A model with dynamic dimensions, built for a range of shapes (``collage_tvm.dynamic``).

1. The ranges: ``--shapes`` where given, defaults read from the model elsewhere
   (``shapes.shape_ranges``), printed in the report.
2. Collage's search at the optimum, as for any static model (its final check, floors
   included): a static build that serves the optimum's shapes exactly.
3. At each representative point of the ranges (``ShapeRanges.points``), the user's own
   file run whole by each graph library (one session each: it serves every shape), timed
   side by side on random inputs of the point's shapes, each library's outputs checked
   against ONNX Runtime's f32 ones within the accuracy budget (``check.fastest.decide``);
   at the optimum, Collage's static build is a contender too, and at each timed point the
   file compiled for the point's exact shapes by each library that ``fixes_shapes``
   (OpenVINO: a "fixed" contender, while it pays: ``FIXED_TRIES``).
4. The build: ``dispatch.Dispatch`` sends a call to the chosen library of its point (the
   least point at or above each size), or, at exactly a point's shapes, to the static
   build or the fixed contender that won there. Nothing is padded. A build that cannot
   serve the range is never shipped.

The choice per point is kept in the placement log (keyed by the file, the ranges, the
libraries' versions and the budget): a rebuild measures nothing.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import time

from .._errors import first_line
from .dispatch import (STATIC, Dispatch, StaticBuild, dynamic_module, fixed_label,
                       fixed_library, library_call, output_types, point_key)
from .shapes import ShapeRanges, grid_values, key_point
from .weights import expected_ms

logger = logging.getLogger("collage_tvm")

# Rounds and least batch of the side-by-side timing at each point (``check.fastest.decide``)
POINT_ROUNDS = 9
POINT_BATCH_MS = 40.0
# Where the two fastest at a point are within this share of each other, they are timed
# again, the two alone, for up to ``POINT_RUNOFF_ROUNDS`` rounds (a shared 2-core VM swings
# by more than that between batches: bert's 4x128, 3.9 against 4.0 ms at the point, then
# 15% apart the other way in the bench's 45 rounds)
POINT_CLOSE = 0.05
POINT_RUNOFF_ROUNDS = 25
# The runoff goes in chunks of ``RUNOFF_CHUNK`` rounds and ends, from ``RUNOFF_MIN`` rounds
# on, once it has settled (``runoff_settled``): one of the two faster in ``RUNOFF_SURE`` of
# the rounds (paired by round), or the two within ``RUNOFF_TIE`` of each other by the
# paired median, where either choice costs less than the noise of the bench that judges
# it. Each of resnet50's three batch points ran all 25 rounds of large batches before
# (100 s of its 142 s search; 3.46x the static search).
RUNOFF_CHUNK = 5
RUNOFF_MIN = 10
RUNOFF_SURE = 0.8
RUNOFF_TIE = 0.015
REFERENCE = "onnxruntime"  # whose f32 outputs the others' are checked against
# Where the ranges have more than ``CORNERS_FROM`` points, the optimum is timed first, then
# the grid's corners (each axis at its min or max); where one library won each of them by
# ``CORNER_LEAD`` or more over the next, the points between go to it untimed ("inferred"),
# else the grid is halved and each half judged the same way (``subdivide``). Observed
# shape weights (``--shape-weights``) time every point: the expected ms needs each one's
# figures.
CORNERS_FROM = 8
CORNER_LEAD = 0.10
# How long a point timed beside other work waits before it is timed again (``_choose_at``)
BUSY_WAIT_S = 10.0
# A point's fixed contender (the file compiled for its exact shapes by a library that
# ``fixes_shapes``) serves the point only where it beat every session of the file by this
# share; a library's fixed contenders are timed at the points after the first
# ``FIXED_TRIES`` only where one of those won so (each is one more compile at a point).
FIXED_GAIN = 0.03
FIXED_TRIES = 2
# Each point a fixed contender serves is one more compiled model in the serving process
# (its weights included): at most this many, and no more than ``FIXED_BYTES`` of model
# file in all; where more won, those saving the most time per call keep it.
MAX_FIXED = 8
FIXED_BYTES = 2 << 30


def graph_libraries(backends: dict, accuracy) -> dict:
    """name -> Backend of the graph libraries among ``backends`` that run a model file whole,
    the reference (ONNX Runtime, f32) first, then the other f32 ones, then the
    reduced-precision variants the budget allows."""
    libs = {n: b for n, b in backends.items()
            if b.kind == "graph" and hasattr(b.get_lowering(), "compile")
            and accuracy.allows(b.precision)}
    return dict(sorted(libs.items(), key=lambda kv: (kv[0] != REFERENCE,
                                                      kv[1].precision != "f32", kv[0])))


def table_key(proto, ranges: ShapeRanges, libs: dict, accuracy, static: str,
              fixed=()) -> str:
    """The placement-log key of the choice per point: the model, the ranges, each library's
    version, the budget, what the static build is (its shipped label and placement) and
    the libraries whose fixed contenders were timed."""
    digest = hashlib.sha256()
    digest.update(proto.SerializeToString(deterministic=True) if proto.ByteSize() < 2**31 - 1
                  else proto.graph.SerializeToString(deterministic=True)[:1 << 20])
    parts = ["dynamic-numpy-calls-runoff", digest.hexdigest(),
             json.dumps(ranges.to_json(), sort_keys=True),
             *sorted(f"{n}={b.version()}" for n, b in libs.items()), accuracy.key(), static,
             *(["fixed:" + ",".join(sorted(fixed))] if fixed else [])]
    return "dyn-" + hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def point_inputs(ranges: ShapeRanges, point: dict, seed: int = 0) -> list:
    """numpy arrays of the inputs at ``point``: floats standard normal, integers zero (a
    valid token id, index or mask for any model)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s).astype(t) if np.dtype(t).kind == "f" else np.zeros(s, t)
            for (_, t, _), s in zip(ranges.inputs, ranges.shapes(point).values())]


class Unservable(Exception):
    """The model does not run at a point of the ranges: every library failed there, or the
    reference did as the model itself does outside its limits (``MODEL_LIMIT``): ``point``,
    ``failed`` (label -> why)."""

    def __init__(self, point: dict, failed: dict, what: str = "every library failed"):
        super().__init__(f"at {point_key(point)} {what}: "
                         + "; ".join(f"{n}: {why}" for n, why in failed.items()))
        self.point, self.failed = point, failed


# ONNX Runtime's errors that say the inputs are outside what the model computes (an index
# past a position table, shapes that do not broadcast), not a limit of the library: where
# the reference fails so, another library's outputs have nothing to be checked against
# (OpenVINO's Gather returns zeros for an index past the table: GPT-2 at 512 tokens with
# 256 positions ran on OpenVINO and was served)
MODEL_LIMIT = re.compile(r"\[ONNXRuntimeError\] : [126] : (FAIL|INVALID_ARGUMENT|"
                         r"RUNTIME_EXCEPTION) ")


def choose(ranges: ShapeRanges, fns: dict, accuracy, static=None, progress=None,
           done: dict | None = None, infer: bool = True, fixed: dict | None = None,
           max_fixed: int = MAX_FIXED) -> dict:
    """The choice at each point of ``ranges``: {"points": [{"point", "chose", "ms",
    "left_out"}], "table": point key -> label, "special": the optimum's point when the
    static build won it, else None, "exact": point key -> the library whose fixed
    contender serves the point's exact shapes}. ``fns``: label -> callable, the reference
    first; ``static``: the static build's callable, a contender at the optimum only;
    ``fixed``: library -> ``make(point)``, its fixed contender at a point (timed as
    ``fixed_label(library)`` at each timed point while it pays: ``FIXED_TRIES``; at most
    ``max_fixed`` points keep one, those it saved most time at). Each is timed
    as a user calls the saved build: numpy arrays in and out (``numpy_call``); one that
    fails at a point is left out there, and a point where all fail raises ``Unservable``.
    ``done``: point key -> an earlier record of this point (kept, not timed again).
    ``infer``: where the ranges have more than ``CORNERS_FROM`` points, the points inside a
    box of the grid whose corners one library won clearly go to it untimed (``subdivide``);
    their records say "inferred"."""
    points: dict = {}
    opt = ranges.opt()
    todo = ranges.points()
    done = done if done is not None else {}
    index = {point_key(p): k for k, p in enumerate(todo)}

    tries = {lib: [] for lib in (fixed or {})}  # library -> whether its fixed won, per try

    def record_of(point: dict) -> dict:
        key = point_key(point)
        if key not in done:
            contenders = {n: f.numpy_call for n, f in fns.items()}
            if static is not None and point == opt:
                contenders[STATIC] = static.numpy_call
            made = _fixed_contenders(fixed or {}, tries, point, contenders)
            done[key] = _choose_at(point, contenders,
                                   point_inputs(ranges, point, seed=index[key]), accuracy)
            del made  # (its compiled models are not kept past the timing)
            for lib, won in tries.items():
                if fixed_label(lib) in done[key]["ms"]:
                    won.append(_fixed_wins(done[key]["ms"], fixed_label(lib)))
        if key not in points:
            record = done[key]
            points[key] = record
            if progress is not None:
                progress(len(points), len(todo), point, record["chose"], record["ms"])
        return done[key]

    record_of(opt)  # (first: the static build is a contender there)
    inferred = subdivide(ranges, record_of) if infer and len(todo) > CORNERS_FROM else {}
    for point in todo:
        key = point_key(point)
        if key not in points and key in inferred and key not in done:
            points[key] = {"point": point, "chose": inferred[key], "ms": {},
                           "left_out": {}, "inferred": True}
            if progress is not None:
                progress(len(points), len(todo), point, inferred[key], {})
        else:
            record_of(point)
    special, table, exact = None, {}, {}
    kept = _kept_fixed([points[point_key(p)] for p in todo], max_fixed)
    for point in todo:
        record = points[point_key(point)]
        chose, ms = record["chose"], record["ms"]
        if fixed_library(chose) is not None and point_key(point) not in kept:
            # (too close to a session that serves every shape, or past ``max_fixed``)
            chose = min((n for n in ms if fixed_library(n) is None), key=ms.get)
            record["chose"] = chose
        if chose == STATIC:
            special = point
        elif fixed_library(chose) is not None:
            exact[point_key(point)] = fixed_library(chose)
        if chose == STATIC or fixed_library(chose) is not None:
            chose = min((n for n in ms if n in fns), key=ms.get, default=next(iter(fns)))
        table[point_key(point)] = chose
    return {"points": [points[point_key(p)] for p in todo], "table": table,
            "special": special, "exact": exact, "ranges": ranges.to_json()}


def _fixed_contenders(fixed: dict, tries: dict, point: dict, contenders: dict) -> list:
    """Each library's fixed contender at ``point`` added to ``contenders`` (label ->
    numpy call), where it is still tried (``FIXED_TRIES``): the callables made (kept alive
    for the timing). One its library cannot compile is left out, with a log line."""
    made = []
    for lib, make in fixed.items():
        if len(tries[lib]) >= FIXED_TRIES and not any(tries[lib]):
            continue
        try:
            fn = make(point)
        except Exception as err:  # noqa: BLE001 - the sessions of the file still serve
            logger.info("%s could not compile the model for %s: %s", lib, point_key(point),
                        first_line(err, 200))
            continue
        made.append(fn)
        contenders[fixed_label(lib)] = fn.numpy_call
    return made


def _kept_fixed(records: list, max_fixed: int) -> set:
    """The keys of the points whose fixed contender won (``_fixed_wins``) and keeps its
    point: the ``max_fixed`` where it saved the most time per call over the best session
    (the points weigh alike, as in ``weights.expected_ms``: the time saved, not the share,
    is what a server's calls gain: roberta's fixed contender took 1.196 against 1.342 ms at
    1x512, 11% less, and 0.052 against 0.074 ms at 1x1, 30% less but 0.022 ms)."""
    gains = {}
    for r in records:
        chose, ms = r["chose"], r.get("ms") or {}
        if fixed_library(chose) is not None and _fixed_wins(ms, chose):
            best = min(v for n, v in ms.items() if fixed_library(n) is None and n != STATIC)
            gains[point_key(r["point"])] = best - ms[chose]
    return set(sorted(gains, key=gains.get, reverse=True)[:max(0, max_fixed)])


def _fixed_wins(ms: dict, label: str) -> bool:
    """Whether fixed contender ``label`` beat every session of the file (the labels that
    are neither fixed nor the static build) by ``FIXED_GAIN`` in figures ``ms``."""
    mine = ms.get(label)
    others = [v for n, v in ms.items() if fixed_library(n) is None and n != STATIC]
    return bool(mine and others) and mine <= min(others) * (1 - FIXED_GAIN)


def subdivide(ranges: ShapeRanges, record_of) -> dict:
    """The points of ``ranges`` that go untimed: point key -> the library. The grid of the
    points (each symbol's ``grid_values``) is a box; its corners are timed
    (``record_of(point)`` -> the point's record); where one library won every corner by
    ``CORNER_LEAD`` or more (``clear_winner``), the points inside go to it untimed, else the
    box is halved along its longest side and each half is judged the same way, down to boxes
    with nothing between their corners. A library that leads at every corner of a box does
    not fall behind inside it where the libraries' crossover moves one way along each axis
    (ONNX Runtime ahead at few tokens and small batches, OpenVINO at many): gpt2's 24 points,
    split at one crossover, were all timed when only the whole grid's corners could decide,
    47 s of its 61 s search. A point inside two boxes won by different libraries is timed."""
    per = grid_values(ranges.axes)
    symbols = list(per)
    inferred: dict = {}
    timed: set = set()

    def grid(box: dict, ends: bool) -> list:
        out = [{}]
        for s in symbols:
            lo, hi = box[s]
            picks = sorted({lo, hi}) if ends else range(lo, hi + 1)
            out = [{**p, s: per[s][i]} for p in out for i in picks]
        return out

    def measure(point: dict) -> dict:
        timed.add(point_key(point))
        inferred.pop(point_key(point), None)
        return record_of(point)

    def visit(box: dict) -> None:
        inside, ends = grid(box, False), grid(box, True)
        records = [measure(p) for p in ends]
        if len(inside) == len(ends):
            return
        winner = clear_winner(records)
        if winner is None:
            s = max(symbols, key=lambda s: box[s][1] - box[s][0])
            lo, hi = box[s]
            visit({**box, s: (lo, (lo + hi) // 2)})
            visit({**box, s: ((lo + hi) // 2, hi)})
            return
        for p in inside:
            key = point_key(p)
            if key in timed:
                continue
            if inferred.get(key, winner) != winner:
                measure(p)  # (two boxes disagree about it)
            else:
                inferred[key] = winner

    visit({s: (0, len(v) - 1) for s, v in per.items()})
    return inferred


def clear_winner(records: list) -> str | None:
    """The library that won each of ``records`` (a box's corners) by ``CORNER_LEAD``
    or more over the next one timed there (the static build aside: it serves the optimum
    alone), else None. A corner timed while other processes took more than ``BUSY_SHARE``
    of the CPU (after its second try, ``_choose_at``) vouches for nothing: gpt2's corners,
    timed beside another search (33-53% of the CPU), gave OpenVINO its whole grid by 19%+
    at batch 1, where ONNX Runtime was 0.83x its time at 1x8 on a quiet machine."""
    winner = None
    for record in records:
        ms = {n: v for n, v in (record.get("ms") or {}).items()
              if n != STATIC and fixed_library(n) is None and v == v}
        if not ms:
            return None
        ranked = sorted(ms, key=ms.get)
        best = ranked[0]
        if winner not in (None, best):
            return None
        if len(ranked) > 1 and ms[ranked[1]] < ms[best] * (1 + CORNER_LEAD):
            return None
        if record.get("left_out"):  # (one failed there: it cannot be judged in between)
            return None
        if _under_load(record):
            return None
        winner = best
    return winner


def _under_load(record: dict) -> bool:
    """Whether ``record`` was timed while other processes took more than ``BUSY_SHARE``
    of the CPU (its last try: ``_choose_at``)."""
    from ..measure.other_load import BUSY_SHARE

    share = record.get("other_load")
    return share is not None and share > BUSY_SHARE


def _choose_at(point: dict, contenders: dict, args: list, accuracy) -> dict:
    """The record of one point: the contenders that run there timed side by side
    (``_timed_at``); where other processes took over ``BUSY_SHARE`` of the CPU meanwhile,
    timed once more after ``BUSY_WAIT_S`` (the record keeps the share, "other_load", and
    whether it was timed again). timm's efficientnet_b0 at batch 1 on the Zen 4: ONNX
    Runtime timed 11.4 ms at the point beside another job, 6.8 ms in the bench after;
    the static build at 7.1 ms was chosen, 0.96x."""
    from ..measure.other_load import BUSY_SHARE, OtherLoad

    with OtherLoad() as load:
        record = _timed_at(point, dict(contenders), args, accuracy)
    if load.share > BUSY_SHARE:
        logger.warning("other processes took %.0f%% of the CPU while %s was timed: timing it "
                       "again in %.0f s", 100 * load.share, point_key(point), BUSY_WAIT_S)
        time.sleep(BUSY_WAIT_S)
        first = load.share
        with OtherLoad() as load:
            record = _timed_at(point, dict(contenders), args, accuracy)
        record["busy_before"] = round(first, 3)
    record["other_load"] = round(load.share, 3) if load.share == load.share else None
    return record


def _timed_at(point: dict, contenders: dict, args: list, accuracy) -> dict:
    """``_choose_at``'s timing: the contenders that run there timed side by side
    (``check.fastest.decide``; the two fastest again, alone, when within
    ``POINT_CLOSE``)."""
    from ..check.fastest import decide

    failed = {}
    reference = next(iter(contenders))
    for name, fn in list(contenders.items()):
        try:
            fn(*args)
        except Exception as err:  # noqa: BLE001 - left out at this point, with the reason
            failed[name] = first_line(err, 300)
            del contenders[name]
    if not contenders:
        raise Unservable(point, failed)
    if reference == REFERENCE and MODEL_LIMIT.search(failed.get(reference, "")):
        raise Unservable(point, {reference: failed[reference], **{
            n: "ran, with no reference to check its outputs" for n in contenders}},
            "the model fails on the reference (ONNX Runtime)")
    chose, record = decide(contenders, args, accuracy, rounds=POINT_ROUNDS,
                           batch_ms=POINT_BATCH_MS)
    ms = record.get("ms") or {}
    close = sorted(ms, key=ms.get)[:2]
    if len(close) == 2 and ms[close[1]] <= ms[close[0]] * (1 + POINT_CLOSE):
        pair = {n: f for n, f in contenders.items() if n in close}  # (reference first)
        chose, again = runoff(pair, args)
        ms = {**ms, **again["ms"]}
        record["runoff"] = again
    return {"point": point, "chose": chose, "ms": ms,
            "left_out": {**failed, **record.get("left_out", {})},
            **({"runoff": True, "runoff_rounds": record["runoff"]["rounds"]}
               if "runoff" in record else {})}


def runoff(pair: dict, args: list) -> tuple:
    """The faster of ``pair`` (name -> a callable on ``args``, whose outputs were checked
    already; the one the point keeps on a lead within ``check.fastest.MARGIN`` first), timed
    alone side by side in chunks of ``RUNOFF_CHUNK`` rounds until ``runoff_settled`` or
    ``POINT_RUNOFF_ROUNDS``: (its name, {"ms": name -> ms, round by round, "rounds"})."""
    from ..check.fastest import MARGIN
    from ..measure.timing import by_round, interleaved

    calls = {n: (lambda f=f: f(*args)) for n, f in pair.items()}
    samples: dict = {}
    rounds = 0
    while rounds < POINT_RUNOFF_ROUNDS:
        step = min(RUNOFF_CHUNK, POINT_RUNOFF_ROUNDS - rounds)
        interleaved(calls, rounds=step, min_ms=POINT_BATCH_MS, samples=samples)
        rounds += step
        if rounds >= RUNOFF_MIN and runoff_settled(*samples.values()):
            break
    ms = by_round(samples) or {n: sorted(s)[len(s) // 2] for n, s in samples.items()}
    first = next(iter(pair))
    chose = min(ms, key=ms.get)
    if ms[chose] > ms[first] * (1 - MARGIN):
        chose = first  # (a lead within the noise: the point keeps the first)
    return chose, {"ms": {n: round(v, 4) for n, v in ms.items()}, "rounds": rounds}


def runoff_settled(a: list, b: list) -> bool:
    """Whether two functions' batches (one a round, ``interleaved``) say which is faster:
    one of them faster in ``RUNOFF_SURE`` of the rounds, or the paired median ratio within
    ``RUNOFF_TIE`` of 1."""
    from ..measure.timing import round_log_ratios

    logs = round_log_ratios(a, b)
    if not logs:
        return False
    ahead = sum(x > 0 for x in logs) / len(logs)
    middle = sorted(logs)[len(logs) // 2]
    return (ahead >= RUNOFF_SURE or ahead <= 1 - RUNOFF_SURE
            or abs(middle) <= math.log1p(RUNOFF_TIE))


def narrowed(ranges: ShapeRanges, err: Unservable) -> ShapeRanges:
    """``ranges`` without the point where every library failed (``err``): each default axis
    (not given by the user) at its max there ends at its next point below (a cache of
    ``past`` 1..513 read from a 513-row position table: the position 513 is out of it), and
    one at 0 there (an empty cache) starts at 1. A ``ShapeError`` naming the shape and the
    libraries' reasons where no default axis can give way."""
    from .shapes import Axis, ShapeError

    axes = dict(ranges.axes)
    grid = grid_values(ranges.axes)
    moved = []
    for symbol, value in err.point.items():
        a = axes[symbol]
        if symbol in ranges.given:
            continue
        if value == a.min == 0 and a.opt >= 1:
            axes[symbol] = Axis(symbol, 1, a.opt, a.max)
            moved.append(f"{symbol} {a.min}..{a.max} -> 1..")
            continue
        if value != a.max or a.max <= a.opt:
            continue
        below = [v for v in grid[symbol] if a.opt <= v < a.max]
        if below:
            axes[symbol] = Axis(symbol, a.min, a.opt, max(below))
            moved.append(f"{symbol} {a.min}..{a.max} -> ..{max(below)}")
    if not moved:
        raise ShapeError(f"{err}: the model does not run at that shape; give "
                         f"the range it runs in with --shapes ({ranges.flags()} now)")
    logger.warning("the default range narrowed (%s): %s", "; ".join(moved), err)
    return ShapeRanges(ranges.inputs, axes, ranges.given)


def optimize_dynamic(proto, path, ranges: ShapeRanges, target, options, static_build, log,
                     new_report) -> tuple | None:
    """``collage_tvm.optimize`` for an ONNX model with dynamic dimensions (``proto``, read
    from ``path`` or given): the fields of a ``CollageResult`` whose executable serves every
    shape of ``ranges``, or None where no graph library among the backends can run the file
    (the caller keeps TVM's build over symbolic shapes then). ``static_build(shapes)``:
    Collage's build at static ``shapes`` (``optimize``); ``log``: the placement log the
    choice per point is kept in; ``new_report(backends)``: a report where the static build
    failed."""
    import tvm

    from ..byoc.external import register
    from ..registry import resolve_backends
    from ..target import make_target

    t0 = time.perf_counter()
    target = make_target(target)
    backends, _ = resolve_backends(options.backends, target, options.accuracy)
    libs = graph_libraries(backends, options.accuracy)
    if not libs:
        return None
    logger.warning("the model has dynamic dimensions: built for %s (%s)", ranges.describe(),
                   ranges.flags())
    static = _static_build(static_build, ranges)
    static_s = time.perf_counter() - t0
    names = [n for n, _, _ in ranges.inputs]
    outs = output_types(proto)
    fns, skipped = {}, {}
    for name, backend in libs.items():
        try:
            fns[name] = library_call(backend, proto, path, names, outs)
        except Exception as err:  # noqa: BLE001 - a library that cannot is left out
            skipped[name] = first_line(err, 300)
            logger.warning("%s cannot run the dynamic model file: %s", name, skipped[name])
    if not fns:
        return None
    special_fn, static_label = None, ""
    if static is not None and _specializes(static):
        special_fn = StaticBuild(tvm.relax.VirtualMachine(static.executable, tvm.cpu(0))["main"],
                                 tvm.cpu(0))
        static_label = f"{static.report.shipped}|{static.placement.cost}"
    def fixed_at(lib):
        return lambda point: library_call(libs[lib], proto, path, names, outs,
                                          shapes=ranges.shapes(point))

    fixed = {lib: fixed_at(lib) for lib in fns
             if getattr(libs[lib].get_lowering(), "fixes_shapes", False)}
    key = table_key(proto, ranges, {n: libs[n] for n in fns}, options.accuracy, static_label,
                    fixed)
    logged = log.get(key)
    t_points = time.perf_counter()
    if logged and set(logged.get("table", {}).values()) <= set(fns) and set(
            (logged.get("exact") or {}).values()) <= set(fixed):
        # (the ranges too: a default one narrowed where the model did not run to its end)
        chosen = {k: logged.get(k) for k in ("points", "table", "special", "exact")}
        if "ranges" in logged:
            chosen["ranges"] = logged["ranges"]
        from_log = True
    else:
        done: dict = {}
        while True:
            try:
                chosen = choose(ranges, fns, options.accuracy, special_fn,
                                _progress if options.progress else None, done,
                                infer=options.shape_weights is None, fixed=fixed,
                                max_fixed=_max_fixed(proto, path))
                break
            except Unservable as err:
                ranges = narrowed(ranges, err)
        log.put(key, chosen)
        from_log = False
    if "ranges" in chosen:  # (narrowed where the model does not run at a default's end)
        ranges = ShapeRanges.from_json(chosen["ranges"])
    special = (chosen["special"], special_fn) if chosen["special"] and special_fn else None
    exact = _exact_calls(chosen, ranges, fixed)
    chosen["exact"] = {k: lib for k, (lib, _) in exact.items()}
    dispatch = Dispatch(ranges, chosen["table"], fns, special, exact=exact)
    symbol = register("collage.dynamic", dispatch,
                      ("dynamic", ranges, proto, chosen, static if special else None))
    mod = dynamic_module(ranges, symbol, outs)
    executable = tvm.compile(mod, target)
    report = static.report if static is not None else new_report(list(backends))
    report.dynamic = {"ranges": ranges.to_json(), "described": ranges.describe(),
                      "flags": ranges.flags(), "points": chosen["points"],
                      "special": chosen["special"] if special else None,
                      "exact": chosen["exact"],
                      "fixed_timed": sum(fixed_library(n) is not None for r in chosen["points"]
                                         for n in r.get("ms") or {}),
                      "libraries": list(fns), "skipped": skipped, "from_log": from_log,
                      "static_shipped": static.report.shipped if static is not None else "",
                      "static_s": round(static_s, 1),
                      "expected": expected_ms(ranges, chosen, options.shape_weights),
                      "points_s": round(time.perf_counter() - t_points, 1),
                      "seconds": round(time.perf_counter() - t0, 1)}
    report.shipped = _shipped(chosen, special is not None)
    report.times["dynamic"] = time.perf_counter() - t0
    return (executable, mod, static.placement if static is not None else _no_placement(),
            static.graph if static is not None else None, report, target, None,
            static if special else None)


def _max_fixed(proto, path: str | None) -> int:
    """How many points may keep a fixed contender: ``MAX_FIXED``, fewer where that many
    copies of the model file would pass ``FIXED_BYTES``."""
    import os

    size = proto.ByteSize() if proto.ByteSize() < 2**31 - 1 else 2**31
    if path is not None and os.path.isfile(path):
        folder = os.path.dirname(os.path.abspath(path))
        files = {os.path.join(folder, e.value) for t in proto.graph.initializer
                 for e in t.external_data if e.key == "location"}
        size = max(size, sum(os.path.getsize(f) for f in files if os.path.isfile(f)))
    return max(0, min(MAX_FIXED, FIXED_BYTES // max(size, 1)))


def _exact_calls(chosen: dict, ranges: ShapeRanges, fixed: dict) -> dict:
    """point key -> (library, its fixed contender) for the points ``chosen["exact"]``
    gives them (compiled again: the search's were dropped after the timing); one that
    fails now is logged and left to the table's choice."""
    out = {}
    for key, lib in (chosen.get("exact") or {}).items():
        if lib not in fixed:
            continue
        try:
            out[key] = (lib, fixed[lib](key_point(key)))
        except Exception as err:  # noqa: BLE001 - the table's choice serves the point
            logger.warning("%s could not compile the model for %s (%s): the session of the "
                           "file serves it", lib, key, first_line(err, 200))
    return out


def _static_build(static_build, ranges):
    """Collage's build at the optimum's shapes (None, with a warning, when it fails: the
    libraries still serve every shape)."""
    try:
        return static_build(ranges.opt_shapes())
    except Exception as err:  # noqa: BLE001 - the model file on a library still serves
        logger.warning("Collage's search at the optimum (%s) failed: %s; the model file on "
                       "the graph libraries serves every shape", ranges.opt_shapes(),
                       first_line(err, 300))
        return None


def _specializes(static) -> bool:
    """Whether the static build is something other than the user's file run whole (which
    the libraries run at every point anyway)."""
    return static.executable is not None and not static.report.shipped_floor


def _shipped(chosen: dict, special: bool) -> str:
    """The report's "shipped": which library serves how many points."""
    count: dict = {}
    for p in chosen["points"]:
        chose = p["chose"]
        if fixed_library(chose) is not None:  # (the file too, compiled for the point)
            chose = f"{fixed_library(chose)} (fixed shapes)"
        count[chose] = count.get(chose, 0) + 1
    per = ", ".join(f"{n} at {c} point{'s' if c > 1 else ''}" for n, c in sorted(
        count.items(), key=lambda kv: -kv[1]))
    return f"dynamic: the model file per shape ({per})" + (
        "; Collage's placement at the optimum" if special else "")


def _no_placement():
    from ..placement import Placement

    return Placement([], math.nan)


def _progress(done: int, total: int, point: dict, chose: str, ms: dict) -> None:
    figures = ", ".join(f"{n} {v:.3f}" for n, v in sorted(ms.items(), key=lambda kv: kv[1]))
    print(f"  shape {done}/{total} {point_key(point)}: {chose}"
          + (f" ({figures} ms)" if figures else
             f" (untimed: it led by {CORNER_LEAD:.0%} or more at every corner)"), flush=True)


__all__ = ["choose", "graph_libraries", "optimize_dynamic"]
