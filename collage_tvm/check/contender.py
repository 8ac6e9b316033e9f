"""One contender of the final check: what was built, how long it took, whether its outputs
match, and why it cannot ship (``Fate``) where it cannot.

The final check (``check.never_slower``) writes one ``Contender`` per build; the CLI's
table, the placement log, the saved build's manifest, the remote judge and the tools read
them. On disk and over RPC a contender is its ``record()``: a dict with the keys the
placement logs and results files have always had, so logs and results written before
this type existed read back (``Contender.from_record``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from enum import Enum


class Fate(Enum):
    """Where a contender stands once the check is done; ``detail`` says with whom or why."""

    RUNNING = "running"      # built, checked and timed: ships when correct and fastest
    NOT_BUILT = "not built"  # could not win by the search's estimate (detail: why)
    FAILED = "failed"        # failed to build or run (``error`` has the reason)
    # lost even at its best while timed again (``interleaved``'s drop): timed no further,
    # still counted at its figure
    DROPPED = "dropped"
    OUTRUN = "outrun"        # left out of the runoff, behind its leader (detail) by the margin
    LOST = "lost"            # memory short: freed after losing side by side to detail
    # memory short even for one build beside the next: its figures, taken before the next
    # builds rather than beside them, stand; it can still ship
    SET_ASIDE = "set aside"

    @property
    def can_ship(self) -> bool:
        return self in (Fate.RUNNING, Fate.DROPPED, Fate.SET_ASIDE)


# The record key that marks each fate (a flag, or the name in ``detail``), as the placement
# logs and results files have them.
_FLAG = {Fate.NOT_BUILT: "skipped", Fate.DROPPED: "dropped", Fate.SET_ASIDE: "set_aside"}
_NAMED = {Fate.OUTRUN: "outrun_by", Fate.LOST: "lost_to"}


@dataclass
class Contender:
    """One build of the final check (the module docstring)."""

    ms: float = math.inf      # its figure: the median of its rounds, taken round by round
    match: bool = False       # its outputs within the budget of the reference's
    max_err: float = math.nan
    rel_err: float | None = None  # of the output scale, under a budget other than strict
    error: str | None = None  # why it was not built, or failed to build or run
    fate: Fate = Fate.RUNNING
    detail: str = ""          # the build it lost to / was outrun by, or why it was not built
    same_as: str | None = None  # the same placement as that build: its figures are that one's
    reference: bool = False   # the build the others' outputs were checked against
    settled_against: str | None = None  # its figure tied to that runoff leader's (``_settle``)
    runoff: bool = False      # timed in the runoff's extra rounds
    timed_once: bool = False  # its first run was past the cutoff: that run is its figure
    outside_budget: str | None = None  # judged by this looser budget: timed for advice only
    advice: str | None = None  # how much faster it is than the shipped build, and the flag
    estimate_ms: float | None = None  # the least the search's measurements said it takes
    ops: dict | None = None   # backend -> operators placed on it
    cuda_graph: object = None  # on a GPU: True, or why it runs launch by launch
    first_ms: float | None = None   # its figure before the re-timing
    median_ms: float | None = None  # the plain median of its batches
    busy_ms: float | None = None    # its figure while other processes took the CPU
    rounds: int | None = None       # the batches its figure is the median of
    batches: list | None = None     # each batch's ms per call, in order
    server: str | None = None       # the RPC server that judged it
    extra: dict = field(default_factory=dict)  # record keys this version does not know

    @property
    def can_ship(self) -> bool:
        """Correct, and no fate keeps it from shipping (a budget of its own aside)."""
        return self.match and self.fate.can_ship and self.outside_budget is None

    def judged(self, checked: dict) -> None:
        """``Accuracy.check_seeds``'s verdict ("match", "max_err", "rel_err") written in."""
        self.match, self.max_err = checked["match"], checked["max_err"]
        self.rel_err = checked.get("rel_err")

    def drop(self, fate: Fate, detail: str = "") -> None:
        self.fate, self.detail = fate, detail

    def record(self) -> dict:
        """The dict written to logs, manifests, results files and RPC replies."""
        out: dict = {"ms": self.ms, "match": self.match}
        if not math.isnan(self.max_err) or self.fate in (Fate.FAILED, Fate.NOT_BUILT):
            out["max_err"] = self.max_err  # (nan: failed; a contender not checked has none)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("ms", "match", "max_err", "fate", "detail", "extra") \
                    or value is None or value is False:
                continue
            out[{"estimate_ms": "floor_ms"}.get(f.name, f.name)] = value
        if self.fate in _FLAG:
            out[_FLAG[self.fate]] = True
        elif self.fate in _NAMED:
            out[_NAMED[self.fate]] = self.detail
        return {**self.extra, **out}

    @classmethod
    def from_record(cls, record: dict) -> "Contender":
        """A record (``record()``; also one written before this type existed) read back."""
        r = dict(record)
        fate, detail = Fate.RUNNING, ""
        for f, key in _NAMED.items():
            if r.get(key):
                fate, detail = f, r.pop(key)
        for f, key in _FLAG.items():
            if r.pop(key, False) and fate is Fate.RUNNING:
                fate = f
        if fate is Fate.RUNNING and r.get("error"):
            fate = Fate.FAILED
        if fate is Fate.NOT_BUILT and str(r.get("error", "")).startswith("not built: "):
            detail = r["error"][len("not built: "):]
        if "floor_ms" in r:
            r["estimate_ms"] = r.pop("floor_ms")
        names = {f.name for f in dataclasses.fields(cls)} - {"fate", "detail", "extra"}
        known = {k: r.pop(k) for k in list(r) if k in names}
        return cls(**known, fate=fate, detail=detail, extra=r)

    def copy(self, **changes) -> "Contender":
        return dataclasses.replace(self, **changes)


def records(comparison: dict) -> dict:
    """name -> record of a final check's contenders (``Contender.record``)."""
    return {n: c.record() for n, c in comparison.items()}


def from_records(records_: dict | None) -> dict:
    """name -> ``Contender`` of records read back (a placement log's, a server's reply)."""
    return {n: Contender.from_record(r) for n, r in (records_ or {}).items()}
