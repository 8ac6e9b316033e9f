"""Which of a few builds serves a call, decided by the calls themselves, in the process that
serves them (issue #77): a ``Race``.

The final check and the dynamic search time their contenders in the process that searched:
hundreds of builds made and dropped, the libraries' pools and caches in the state the search
left them, perhaps on another machine. Between two libraries a few percent apart that is
enough to rank them the other way round where the build is served (gpt2 with dynamic axes at
1x8 on the AMX Xeon: OpenVINO 25% ahead of ONNX Runtime in the search, 15% behind it in the
bench's process; vit in the transformers suite). Timing them again at load costs the load
seconds (torchvision's r3d_18: 25 s, against 0.6 s without), so the calls decide instead.

A race holds the contenders' callables (TVM tensors in and out, each with ``numpy_call``),
the one the search chose first. Each contender's first call runs the first one too on the
same inputs and must give its outputs within the accuracy budget, or it is left out (that
call returns the first one's outputs). Then the calls go to the contenders in turns: a turn
is consecutive calls of one contender until it has run ``TURN_MS``, and its figure is the
median call of the turn. A turn starts as the final check's batches do: a pause until the
last library's pool stops spinning (``timing.settle``, at most ``SETTLE_S``: an ONNX Runtime
pool spins ~40 ms after its calls), then one call not timed: a server runs one library, not
a switch a call. (Without the pause, bert's dynamic-axes file on the Zen 4 raced OpenVINO
at 3.37 ms a call at 1x512, 1.8 ms alone, and five shapes went to the slower library.) After ``RACE_ROUNDS`` rounds
(a turn each), the figures taken round by round (``timing.by_round``), the fastest serves
every later call; another replaces the first only when it leads it by more than
``RACE_MARGIN`` and the rounds say so clearly (else the race goes on, up to
``MAX_RACE_ROUNDS``, and the first stays). One that is slower in every round than the
leader, its best over the leader's median by ``RACE_DROP``, after ``DROP_AFTER`` rounds, is
raced no further (the first one is raced to the end). Every call returns correct
outputs; the cost is the calls served by the slower contenders while the race runs, and the
pauses (a 1 ms model: about 2 x 7 x 50 ms of calls and up to 2 x 7 x 50 ms of pauses; a
100 ms one: about 2 x 7 x 2 calls).

A contender may still be in the making (its library compiling the model in a thread started
at load, ``Making``): until every one is made, the first serves alone, untimed.
"""
from __future__ import annotations

import logging
import math
import statistics
import threading
import time

from ..measure.other_load import OtherLoad
from ..measure.timing import (DROP_AFTER, PAIRED_MIN_ROUNDS, SETTLE_S, by_round,
                              round_log_ratios, settle)
from ..precision import parse_accuracy
from .fastest import MARGIN, numpy_outputs

logger = logging.getLogger("collage_tvm")

# Rounds (a turn of each contender) before the race is decided, and the least time of one
# turn's timed calls.
RACE_ROUNDS = max(7, PAIRED_MIN_ROUNDS)
TURN_MS = 50.0
# Where the rounds leave another's lead over the first one unclear (``Race._clear``), the
# race goes on, to this many rounds at most; then the first one stays.
MAX_RACE_ROUNDS = 21
# A contender whose best turn is this share slower than the leader's median turn, after
# ``DROP_AFTER`` rounds, and slower than the leader's in each of its last ``DROP_AFTER``
# rounds, is raced no further.
RACE_DROP = 0.05
# Another contender replaces the first only when it leads it by more than this share, and
# round by round clearly (``Race._clear``): the first is the search's choice, timed with
# more care (bert with dynamic axes in the bench's process on the Zen 4: the races' first
# rounds, right after the frameworks' sessions were made, put ONNX Runtime 1.5-1.9x over
# its own later figures, and three shapes went to OpenVINO, up to 7% slower there).
RACE_MARGIN = 3 * MARGIN


class Making:
    """A contender's callable made in a thread (``make()``: its library loading the model),
    so that ``load`` returns without waiting for it: ``done()``, then ``result()`` (the
    callable, or the exception ``make`` raised). The thread is not a daemon: a program
    that loads a build and ends at once waits for it to finish, as a daemon thread still
    inside OpenVINO's compile when the process exits aborts it ("terminate called without
    an active exception")."""

    def __init__(self, make):
        self._value, self._error = None, None
        self._done = threading.Event()

        def run():
            try:
                self._value = make()
            except BaseException as err:  # noqa: BLE001 - reported by ``result``
                self._error = err
            finally:
                self._done.set()

        threading.Thread(target=run, name="collage-race-make", daemon=False).start()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def result(self):
        if self._error is not None:
            raise self._error
        return self._value


class Race:
    """``Race(fns, accuracy, making=None)``: a callable on TVM tensors (and ``numpy_call`` on
    numpy arrays) that serves each call by one of ``fns`` (label -> callable, the search's
    choice first) and, over its first calls, finds the fastest here (module docstring).
    ``making``: label -> ``Making`` of contenders still being made. ``settled``: decided;
    ``chose``: the label serving every call since (None while racing); ``record``: what
    was timed."""

    def __init__(self, fns: dict, accuracy="f32", making: dict | None = None,
                 rounds: int = RACE_ROUNDS, turn_ms: float = TURN_MS):
        names = list(fns)
        if not names:
            raise ValueError("a race needs at least one contender")
        self.fns = dict(fns)
        self.first = names[0]
        self.budget = parse_accuracy(accuracy)
        self.making = dict(making or {})
        self.rounds, self.turn_ms = rounds, turn_ms
        self.alive = names
        self.samples: dict = {n: [] for n in names}
        self.left_out: dict = {}
        self.outrun: set = set()
        self._checked = {self.first}
        self._index, self._turn, self._round = 0, [], 0
        self.calls, self._t0, self.seconds = 0, None, 0.0
        self.chose = None
        self._winner = None
        self._load = None  # the other processes' share of the CPU over the race
        self.busy_share = math.nan
        self._lock = threading.Lock()
        if len(names) == 1 and not self.making:
            self._settle(self.first)

    @property
    def settled(self) -> bool:
        return self._winner is not None

    @property
    def record(self) -> dict:
        """{"shipped": the search's choice, "chose": the one serving (None while racing),
        "ms": label -> its figure, "rounds", "calls" (raced), "seconds" (from the first
        raced call to the decision), "left_out": label -> why, "turns": label -> the figure
        of each of its turns, in order (whether a lead held from the first round on)}."""
        return {"shipped": self.first, "chose": self.chose, "ms": dict(self._figures()),
                **({"other_load": round(self.busy_share, 3)}
                   if self.busy_share == self.busy_share else {}),
                "rounds": self._round, "calls": self.calls, "seconds": round(self.seconds, 3),
                "left_out": dict(self.left_out),
                "turns": {n: [round(v, 4) for v in s] for n, s in self.samples.items() if s}}

    def __call__(self, *args):
        winner = self._winner
        if winner is not None:
            return winner(*args)
        return self._race(args, False)

    def numpy_call(self, *arrays):
        winner = self._winner
        if winner is not None:
            return winner.numpy_call(*arrays)
        return self._race(arrays, True)

    # ------------------------------------------------------------------ the race

    def _call(self, name: str, args, numpy: bool):
        fn = self.fns[name]
        return fn.numpy_call(*args) if numpy else fn(*args)

    def _timed(self, name: str, args, numpy: bool) -> tuple:
        """(outputs, ms) of one call of ``name``."""
        t = time.perf_counter()
        out = self._call(name, args, numpy)
        return out, (time.perf_counter() - t) * 1e3

    def _race(self, args, numpy: bool):
        with self._lock:
            if self._winner is not None:
                return self._call(self.chose, args, numpy)
            if self.making and not self._made():
                return self._call(self.first, args, numpy)  # (not timed: not all are here)
            if self._winner is not None:  # (no other was made: nothing to race)
                return self._call(self.chose, args, numpy)
            if self._t0 is None:
                self._t0 = time.perf_counter()
                self._load = OtherLoad().__enter__()
            self.calls += 1
            name = self.alive[self._index]
            if name not in self._checked:
                return self._check(name, args, numpy)
            if not self._turn:  # a turn starts: the other library's pool goes idle first
                settle(SETTLE_S)
            try:
                out, ms = self._timed(name, args, numpy)
            except Exception as err:  # noqa: BLE001 - the first one serves this call
                if name == self.first:
                    raise
                self._leave(name, f"it failed to run: {type(err).__name__}: {err}")
                return self._call(self.first, args, numpy)
            self._turn.append(ms)
            if len(self._turn) >= 2 and sum(self._turn[1:]) >= self.turn_ms:
                self.samples[name].append(statistics.median(self._turn[1:]))
                self._next_turn()
            return out

    def _made(self) -> bool:
        """Whether every contender in the making is made (each one that failed left out)."""
        for name, making in list(self.making.items()):
            if not making.done():
                return False
            del self.making[name]
            try:
                self.fns[name] = making.result()
            except Exception as err:  # noqa: BLE001 - the others still race
                self.left_out[name] = f"it could not be made here: {type(err).__name__}: {err}"
                continue
            self.alive.append(name)
            self.samples[name] = []
        if len(self.alive) == 1:
            self._settle(self.first)
        return True

    def _check(self, name: str, args, numpy: bool):
        """``name``'s first call, beside the first one's on the same inputs: it races only
        where its outputs are within the budget of the first one's. Returns the first one's
        outputs (no part of a turn: ``name``'s first turn starts with the next call)."""
        reference = self._call(self.first, args, numpy)
        try:
            judged = self.budget.check(numpy_outputs(self._call(name, args, numpy)),
                                       numpy_outputs(reference))
        except Exception as err:  # noqa: BLE001 - it cannot run here
            self._leave(name, f"it failed to run: {type(err).__name__}: {err}")
            return reference
        if not judged["match"]:
            self._leave(name, f"its outputs differ from {self.first}'s (max error "
                        f"{judged['max_err']:.2e})")
        else:
            self._checked.add(name)  # (its turn starts with the next call)
        return reference

    def _leave(self, name: str, why: str) -> None:
        self.left_out[name] = why
        if name in self.alive:
            k = self.alive.index(name)
            self.alive.remove(name)
            if k < self._index:
                self._index -= 1
            self._index %= max(1, len(self.alive))
            self._turn = []
        if len(self.alive) == 1:
            self._settle(self.first if self.first in self.alive else self.alive[0])

    def _next_turn(self) -> None:
        self._turn = []
        self._index += 1
        if self._index < len(self.alive):
            return
        self._index = 0
        self._round += 1
        if self._round >= DROP_AFTER:
            self._drop_outrun()
        if self._round >= self.rounds or len(self.alive) == 1:
            figures = self._figures()
            chose = min(figures, key=figures.get)
            if self.first in figures and figures[chose] > figures[self.first] * (1 - RACE_MARGIN):
                chose = self.first  # a lead within the noise: the search's choice stands
            elif chose != self.first and self.first in self.alive and not self._clear(chose):
                if self._round < MAX_RACE_ROUNDS:
                    return  # the rounds disagree: race on
                chose = self.first  # never clear: the search's choice stands
            if chose != self.first and self._busy():
                chose = self.first  # timed while other work shared the cores: unsure
            self._settle(chose)

    def _busy(self) -> bool:
        """Whether other processes took over ``BUSY_SHARE`` of the CPU during the race: a
        lead measured then is not one to overturn the search's choice on (a third slower
        figures than the same libraries' on a quiet machine were seen to flip a choice)."""
        if self._load is None:
            return False
        self._load.__exit__(None, None, None)
        self.busy_share = self._load.share
        return self._load.busy

    def _clear(self, name: str) -> bool:
        """Whether ``name``'s lead over the first one holds round by round: the median of
        the rounds' log ratios at least two standard errors above 0."""
        logs = round_log_ratios(self.samples[name], self.samples[self.first], tails=True)
        if not logs or len(logs) < 2:
            return False
        lead = statistics.median(logs)
        return lead > 2 * statistics.stdev(logs) / math.sqrt(len(logs))

    def _drop_outrun(self) -> None:
        medians = {n: statistics.median(self.samples[n]) for n in self.alive}
        lead = min(medians, key=medians.get)
        for name in list(self.alive):
            mine, best = self.samples[name][-DROP_AFTER:], self.samples[lead][-DROP_AFTER:]
            if (name not in (lead, self.first)  # (the first is raced to the end)
                    and min(self.samples[name]) > medians[lead] * (1 + RACE_DROP)
                    and all(m > b for m, b in zip(mine, best))):  # (slower in every round)
                self.outrun.add(name)
                self.alive.remove(name)
        self._index = 0

    def _figures(self) -> dict:
        """label -> ms: the contenders raced in every round, round by round; the rest (one
        outrun) by their median turn."""
        timed = {n: s for n, s in self.samples.items() if s}
        figures = {n: statistics.median(s) for n, s in timed.items()}
        figures.update(by_round({n: s for n, s in timed.items() if n in self.alive}))
        return {n: round(v, 4) for n, v in figures.items()}

    def _settle(self, name: str) -> None:
        self.chose = name
        self._winner = self.fns[name]
        if self._t0 is not None:
            self.seconds = time.perf_counter() - self._t0
        if name != self.first:
            logger.info("served by %s, not %s as the search had it (%s; decided over %d "
                        "calls)", name, self.first, ", ".join(
                            f"{n} {ms:.3f} ms" for n, ms in self._figures().items()),
                        self.calls)


__all__ = ["Making", "RACE_MARGIN", "RACE_ROUNDS", "Race", "TURN_MS"]
