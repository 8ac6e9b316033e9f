"""Measure only what can win (issue #35): the op-level DP on lower bounds, measuring as it goes.

The paper measures every candidate, then runs the DP. Most of them cannot win: a TVM kernel
where a library runs the same operators several times faster, a small library region inside
a larger one that runs whole. Here each candidate not yet known (from the cost DB) gets a
*lower bound*, the least it could cost on its backend, and the DP runs on the known costs
and the lower bounds; the candidates of its answer that are not measured yet are measured;
then again. Two lower bounds, the higher one counts:

- the *roofline* (``measure.estimate.Roofline``): the backend's best observed rates on this
  machine, halved;
- the *parts bound*: a share (``PARTS_SLACK``) of what the group's heavy operators
  (convolutions, matrix products, pools, reductions: ``estimate.HEAVY``) take alone on the
  same backend. A library fuses the elementwise operators around a convolution away, not
  the convolution. Those single-operator candidates of the external backends are measured
  first (few: a model repeats its shapes, and each distinct function is timed once), then
  each graph library's largest candidates (the whole model). The share is not a law: a
  region of depthwise convolutions can run far below their times alone (alone, each pays
  a layout change that a region pays once; docs/GUIDE.md, "Search time", has the figures).
  So each backend's share follows its measured groups: ``RATIO_MARGIN`` of the least share
  one of them took (``LowerBounds.share``).

The loop stops when the DP's answer is made of measured candidates only (the full-measure
answer, wherever every lower bound held) or when the best cover of measured candidates is
within ``GAP`` of the DP's answer on lower bounds: no cover of candidates not yet measured
can then be more than ``GAP`` faster, as far as the lower bounds hold. ``LeanReport`` says
which, and how many candidates were never measured.

The verdict (which candidates were left unmeasured) is kept in the cost DB
(``Measurer.keep_skipped``). A later search over the same candidates whose DB answers every
other one takes it and measures nothing: asked again, the DP would see lower bounds lowered
by what was measured since (carved regions; the shares and rates all the costs give at once
rather than round by round), and on a noisy machine that has sent it back to measuring.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

from ..measure.estimate import HEAVY, SLACK, Roofline, work
from .op_level import ensure_cover, place

logger = logging.getLogger("collage_tvm")

# The share of its heavy operators' single-operator times a group takes at least, until a
# measured group of the backend took less (``LowerBounds.share``).
PARTS_SLACK = 0.7
# A backend's share: this much of the least share a measured group of it took.
RATIO_MARGIN = 0.8
# Stop measuring once the measured candidates' best cover is within this share of the
# DP's answer on the lower bounds (docs/GUIDE.md, "Search time": what it saves, and what it
# costs the DP's answer, replayed on full-measure cost tables).
GAP = 0.3


@dataclass
class LeanReport:
    candidates: int = 0     # every candidate of the graph
    known: int = 0          # answered by the cost DB (or free: no kernel) before any measuring
    seeded: int = 0         # single heavy operators on the libraries, measured first
    measured: int = 0       # measured by this search (the seeded ones included)
    skipped: int = 0        # never measured: their lower bounds could not win
    rounds: int = 0         # DP runs on lower bounds
    dp_s: float = 0.0       # seconds in those DP runs
    bounds_broken: int = 0  # measured below their lower bound (it was no bound there)
    lower_ms: float = 0.0   # the DP's answer on lower bounds when the loop stopped
    upper_ms: float = math.inf  # the best cover of measured candidates then
    # "measured": the DP chose measured candidates only; "gap"; "db": an earlier search's
    # verdict, kept in the cost DB, stands (every candidate it measured is known)
    stopped: str = ""
    # The DP's answer over TVM's candidates alone, on measured costs and lower bounds: the
    # least TVM alone can take, as far as the lower bounds hold; ``alone_ms``: the same for each
    # single-backend build of TVM or an op library the final check makes (build name -> ms:
    # "tvm-only", "<lib>+tvm"), which need not be built where they cannot come near the
    # others (``never_slower``'s ``alone_ms``)
    tvm_alone_ms: float = math.inf
    alone_ms: dict = field(default_factory=dict)
    per_backend: dict = field(default_factory=dict)  # backend -> [measured or known, skipped]

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class LowerBounds:
    """The lower bound of each candidate not yet measured (module docstring). ``overhead``:
    backend -> its call overhead (the paper's epsilon), left out of the bounds."""

    def __init__(self, graph, candidates: list, overhead: dict, slack: float = SLACK,
                 parts_slack: float = PARTS_SLACK, relative: tuple = ()):
        self.overhead, self.parts_slack = overhead, parts_slack
        self.features = {c: work(graph, c.nodes) for c in candidates}
        self.roof = Roofline(slack)
        self.heavy = {c: [i for i in c.nodes if graph.nodes[i].op_name in HEAVY]
                      for c in candidates}
        self.single: dict = {}   # (backend, node) -> least measured single-node time
        self.anywhere: dict = {}  # node -> least measured single-node time on any backend
        # backend -> the least share of its heavy parts' times a measured group of it took
        self.least: dict = {}
        # (backend, node) -> measured groups waiting for that single-node time: [(c, time)]
        self.waiting: dict = {}
        # The backends whose single operators are not measured first (TVM), and for each of
        # them and each kind of heavy operators (their op names), the least ratio of a measured
        # group's time to what its heavy operators take alone on the fastest backend
        # (``relative_bound``): (backend, kinds) -> ratio
        self.relative_to, self.relative = set(relative), {}
        self.kinds = {c: tuple(sorted({graph.nodes[i].op_name for i in self.heavy[c]}))
                      for c in candidates}

    @property
    def share(self) -> dict:
        """backend -> ``share_of(backend)``, for the backends a measured group lowered."""
        return {b: self.share_of(b) for b in self.least}

    def share_of(self, backend: str) -> float:
        """The share of its heavy parts' times a group of ``backend`` takes at least:
        ``PARTS_SLACK``, lowered to ``RATIO_MARGIN`` of the least share a measured group of
        it took."""
        return min(self.parts_slack, RATIO_MARGIN * self.least.get(backend, math.inf))

    def singles_of_heavy(self, candidates: list) -> list:
        return [c for c in candidates if len(c.nodes) == 1 and self.heavy[c]]

    def observe(self, c, cost: float) -> None:
        own = cost - self.overhead.get(c.backend, 0.0)
        self.roof.observe(c.backend, *self.features[c], own)
        if not math.isfinite(own):
            return
        if len(c.nodes) == 1:
            key = (c.backend, next(iter(c.nodes)))
            self.single[key] = min(self.single.get(key, math.inf), max(0.0, own))
            self.anywhere[key[1]] = min(self.anywhere.get(key[1], math.inf), self.single[key])
            for group, t in self.waiting.pop(key, []):  # their parts may be complete now
                self._share_of(group, t)
        elif self.heavy[c]:
            self._share_of(c, max(0.0, own))
        if c.backend in self.relative_to and self.heavy[c]:
            best = self.fastest_parts(c)
            if 0 < best < math.inf:
                key = (c.backend, self.kinds[c])
                self.relative[key] = min(self.relative.get(key, math.inf), max(0.0, own) / best)

    def _share_of(self, c, t: float) -> None:
        """The share of its parts the group ``c`` took (``t`` ms) lowers its backend's;
        while a part is not measured, the group waits for it (``waiting``)."""
        missing = [i for i in self.heavy[c] if (c.backend, i) not in self.single]
        if missing:
            self.waiting.setdefault((c.backend, missing[0]), []).append((c, t))
            return
        parts = sum(self.single[(c.backend, i)] for i in self.heavy[c])
        if parts > 0:
            self.least[c.backend] = min(self.least.get(c.backend, math.inf), t / parts)

    def largest(self, candidates: list, backends: dict) -> list:
        """Each graph library's largest candidates (the whole model, where it runs it):
        measured early, they give the share of their parts a region takes."""
        out = []
        for name, b in backends.items():
            mine = [c for c in candidates if c.backend == name and self.heavy[c]]
            if b.kind == "graph" and mine:
                most = max(len(c.nodes) for c in mine)
                out += [c for c in mine if len(c.nodes) == most]
        return out

    def cutoff(self, c, factor: float) -> float | None:
        """``factor`` times the least its heavy operators take alone on any backend: past
        that a first run cannot win (None: no heavy operator, or one not yet measured)."""
        best = self.fastest_parts(c)
        if not self.heavy[c] or not math.isfinite(best):
            return None
        return factor * (best + self.overhead.get(c.backend, 0.0))

    def fastest_parts(self, c) -> float:
        """What ``c``'s heavy operators take alone on the fastest backend, together (``inf``
        while one is not measured anywhere)."""
        return sum(self.anywhere.get(i, math.inf) for i in self.heavy[c])

    def relative_bound(self, c) -> float:
        """For a backend whose single operators are not measured first (TVM): ``RATIO_MARGIN``
        of the least ratio a measured group of it with the same kinds of heavy operators took
        to the fastest single-operator times of those, times those of ``c`` (0 until one was
        measured). An untuned TVM convolution measured 20-100x a library's: its other
        convolutions are not worth building one by one to learn that again; its matrix
        product may be close to the library's, and says nothing of them."""
        ratio = self.relative.get((c.backend, self.kinds[c]), math.inf)
        best = self.fastest_parts(c)
        if not (math.isfinite(ratio) and self.heavy[c] and math.isfinite(best)):
            return 0.0
        return RATIO_MARGIN * ratio * best

    def probe_first(self, todo: list, probes: int = 2) -> list:
        """``todo`` less the groups of a backend ``relative_bound`` serves whose kind of
        heavy operators has no measured ratio yet beyond the first ``probes`` of each: those
        are measured first, and the DP asked again with the ratio they give (the rest come
        back in a later round if they can still win)."""
        seen: dict = {}
        out = []
        for c in todo:
            key = (c.backend, self.kinds[c])
            if c.backend in self.relative_to and self.heavy[c] and key not in self.relative:
                seen[key] = seen.get(key, 0) + 1
                if seen[key] > probes:
                    continue
            out.append(c)
        return out

    def bound(self, c) -> float:
        """The least ``c`` could cost, its call overhead left out: the higher of its roofline
        and its parts bound (module docstring)."""
        low = max(self.roof.bound(c.backend, *self.features[c]), self.relative_bound(c))
        parts = [self.single.get((c.backend, i), math.inf) for i in self.heavy[c]]
        parts = [p for p in parts if math.isfinite(p)]
        return max(low, self.share_of(c.backend) * sum(parts)) if parts else low


def lean_costs(measurer, graph, candidates: list, backends: dict, overhead: dict, switch: dict,
               slack: float = SLACK, parts_slack: float = PARTS_SLACK, gap: float = GAP,
               max_rounds: int = 200) -> tuple:
    """(raw cost of every candidate: measured, from the DB, or ``inf`` where skipped,
    ``LeanReport``). ``measurer``: the search's ``Measurer``; ``overhead``/``switch``: as
    the DP takes them (the measured call overheads and switch costs). ``gap``: stop once
    the measured candidates' best cover is within it of the DP's answer on lower bounds
    (``None``: only when the DP chooses measured candidates)."""
    rep = LeanReport(candidates=len(candidates))
    bounds = LowerBounds(graph, candidates, overhead, slack, parts_slack,
                         relative=tuple(n for n, b in backends.items() if not b.is_external))
    same = _same_function(measurer, graph, candidates, backends)
    raw = measurer.known(graph, candidates, backends)
    rep.known = len(raw)
    for c, cost in raw.items():
        bounds.observe(c, cost)
    tag = f"gap={gap}|slack={slack}|parts={parts_slack}"
    settled = _settled(measurer, graph, candidates, backends, raw, tag)
    singles = [c for c in bounds.singles_of_heavy(candidates) if backends[c.backend].is_external]
    for first in (singles, bounds.largest(candidates, backends)):  # the largest after: shares
        todo = [c for c in first if c not in raw]
        if todo and not settled:
            rep.seeded += _measure(measurer, graph, todo, backends, raw, bounds, same)
    rep.measured = rep.seeded
    bounds_at_measure: dict = {}
    while True:
        est = {c: (max(0.0, raw[c] - overhead.get(c.backend, 0.0)) if c in raw
                   else bounds.bound(c)) for c in candidates}
        est, _ = ensure_cover(len(graph), candidates, est)
        t0 = time.perf_counter()
        placement = place(graph.producers, candidates, est, overhead, switch=switch)
        rep.dp_s += time.perf_counter() - t0
        rep.rounds += 1
        rep.lower_ms = placement.cost
        todo = [g for g in placement.groups if g not in raw]
        if not todo:
            rep.stopped, rep.upper_ms = "measured", placement.cost
            break
        if settled:
            rep.stopped = "db"
            rep.upper_ms = _measured_cover(graph, candidates, raw, overhead, switch)
            break
        if gap is not None:
            t0 = time.perf_counter()
            rep.upper_ms = _measured_cover(graph, candidates, raw, overhead, switch)
            rep.dp_s += time.perf_counter() - t0
            if rep.upper_ms <= (1.0 + gap) * placement.cost:
                rep.stopped = "gap"
                break
        if rep.rounds > max_rounds:  # never seen; bounded all the same: measure the rest
            logger.warning("lean measuring: %d DP rounds; measuring every candidate left",
                           max_rounds)
            todo = [c for c in candidates if c not in raw]
        else:
            todo = bounds.probe_first(todo)
        bounds_at_measure.update({c: est[c] for c in todo})
        rep.measured += _measure(measurer, graph, todo, backends, raw, bounds, same)
    _finish(rep, candidates, raw, overhead, bounds_at_measure)
    if not settled and hasattr(measurer, "keep_skipped"):
        ident = measurer.identities(graph, candidates, backends)
        measurer.keep_skipped(graph, candidates, backends,
                              {ident[c] for c in candidates if c not in raw}, rep.lower_ms, tag)
    builds = {"tvm-only": ("tvm",), **{f"{n}+tvm": (n, "tvm") for n, b in backends.items()
                                       if b.is_external and b.kind == "op"}}
    rep.alone_ms = {build: _alone(graph, [c for c in candidates if c.backend in names], raw,
                                  bounds, overhead) for build, names in builds.items()}
    rep.tvm_alone_ms = rep.alone_ms["tvm-only"]
    return {c: raw.get(c, math.inf) for c in candidates}, rep


def _settled(measurer, graph, candidates: list, backends: dict, raw: dict, tag: str) -> bool:
    """Whether an earlier search's verdict over these candidates, kept in the cost DB,
    stands: every candidate it did not leave unmeasured is known (a failure of the moment
    it met is not: that one is measured again, and the search runs as new)."""
    before = getattr(measurer, "skipped_before", None)
    skipped = before(graph, candidates, backends, tag) if before is not None else None
    if skipped is None:
        return False
    ident = measurer.identities(graph, candidates, backends)
    return all(c in raw for c in candidates if ident[c] not in skipped)


def _alone(graph, mine: list, raw: dict, bounds: LowerBounds, overhead: dict) -> float:
    """The DP's cost over the candidates ``mine`` alone (TVM's, or one library's and TVM's),
    each at its measured time or else its lower bound (nodes none covers at 0, as the search keeps
    them on TVM; ``inf``: no cover)."""
    est = {c: (max(0.0, raw[c] - overhead.get(c.backend, 0.0)) if c in raw
               else bounds.bound(c)) for c in mine}
    try:
        est, _ = ensure_cover(len(graph), mine, est)
        return place(graph.producers, mine, est, overhead).cost
    except ValueError:  # no executable cover
        return math.inf


def _same_function(measurer, graph, candidates: list, backends: dict) -> dict:
    """candidate -> the candidates timed by the same function (itself alone when the
    measurer cannot tell)."""
    identities = getattr(measurer, "identities", None)
    if identities is None:
        return {c: [c] for c in candidates}
    groups: dict = {}
    for c, ident in identities(graph, candidates, backends).items():
        groups.setdefault(ident, []).append(c)
    return {c: groups[ident] for ident in groups for c in groups[ident]}


def _measure(measurer, graph, todo: list, backends: dict, raw: dict, bounds: LowerBounds,
             same: dict) -> int:
    """Measure ``todo`` into ``raw`` (with every candidate timed by the same function);
    returns how many of ``todo`` were measured."""
    factor = getattr(measurer, "cutoff_factor", None)
    cutoffs = {c: cut for c in todo
               if factor and (cut := bounds.cutoff(c, factor)) is not None}
    new = measurer.costs(graph, todo, backends, cutoffs=cutoffs)
    for c in todo:
        cost = new.get(c, math.inf)
        for other in same.get(c, [c]):
            if other not in raw:
                raw[other] = cost
                bounds.observe(other, cost)
    return len(todo)


def _measured_cover(graph, candidates: list, raw: dict, overhead: dict, switch: dict) -> float:
    """The DP's cost over the measured candidates alone; ``inf`` while they cover not
    every node."""
    measured = {c: max(0.0, raw[c] - overhead.get(c.backend, 0.0)) if c in raw else math.inf
                for c in candidates}
    covered = set().union(*(c.nodes for c, v in measured.items() if math.isfinite(v)))
    if len(covered) < len(graph):
        return math.inf
    try:
        return place(graph.producers, candidates, measured, overhead, switch=switch).cost
    except ValueError:  # no executable cover of measured candidates yet
        return math.inf


def _finish(rep: LeanReport, candidates: list, raw: dict, overhead: dict,
            bounds_at_measure: dict) -> None:
    rep.bounds_broken = sum(1 for c, b in bounds_at_measure.items()
                            if math.isfinite(raw[c]) and raw[c] - overhead.get(c.backend, 0.0) < b)
    for c in candidates:
        seen = rep.per_backend.setdefault(c.backend, [0, 0])
        seen[0 if c in raw else 1] += 1
    rep.skipped = sum(1 for c in candidates if c not in raw)
    logger.info("lean measuring: %d of %d candidates measured (%d single heavy operators "
                "first), %d known, %d skipped (their lower bounds could not win), %d DP rounds in "
                "%.1f s; stopped: %s (measured cover %.3f ms, DP on lower bounds %.3f ms)",
                rep.measured, len(candidates), rep.seeded, rep.known, rep.skipped,
                rep.rounds, rep.dp_s, rep.stopped, rep.upper_ms, rep.lower_ms)
