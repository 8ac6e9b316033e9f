"""The final check's timing of close calls: the contenders timed once are timed again side
by side, the close ones in a runoff, and the calls it leaves open timed on until settled
(``check.never_slower`` calls ``retime`` and, on a busy machine, ``retime_when_busy``).

Every function takes the check's contenders (name -> ``Contender``) and the thresholds
(``options.FinalCheck``); the figures they write replace the contenders' ``ms``.
"""
from __future__ import annotations

import logging
import math
import statistics
import time

from ..measure.other_load import OtherLoad
from ..measure.timing import by_round, interleaved, round_log_ratios
from ..target import device_sync
from .contender import Fate

logger = logging.getLogger("collage_tvm")


def correct_ms(results: dict, runs: dict, outside) -> dict:
    """name -> ms of the builds with a run whose outputs match, those outside the accuracy
    budget left out: the ones that can be shipped."""
    return {n: results[n].ms for n in runs if results[n].match and n not in outside}


def retime(results, runs, outside, target, s, factor: float = 2.0) -> None:
    """The contenders (correct, within ``factor`` of the fastest; outside the accuracy budget,
    within ``s.runoff_margin``) are timed again in alternating rounds, so the machine's
    drifting load hits them alike: one build timed after another can land far from the same
    build re-timed beside it on a shared machine. (Builds that are the same placement as
    another have no run of their own.) Then the runoff, which the builds enter by their
    figures taken round by round (``_by_round``): on a noisy machine the plain medians of
    these few rounds can put a build more than the margin behind one it matched round for
    round (docs/BENCHMARKS.md, "Search time": t5_encoder)."""
    fastest = min(correct_ms(results, runs, outside).values(), default=math.inf)
    # A build outside the budget is timed for its advice alone (``never_slower._advise``):
    # when it is not even close to faster, timing it again tells nothing.
    contenders = {n: runs[n] for n in runs
                  if results[n].match and results[n].ms <= (
                      (1 + s.runoff_margin) if n in outside else factor) * fastest}
    samples: dict = {}  # name -> ms of each batch
    if len(contenders) > 1:
        time_again(results, contenders, target, s, samples=samples, outside=outside)
        # every build not dropped was timed in each of these rounds
        _by_round(results, {n: samples[n] for n in contenders
                            if results[n].fate is not Fate.DROPPED and samples.get(n)})
    runoff(results, runs, outside, target, s, samples)


def retime_when_busy(results, runs, outside, target, s, share: float) -> float:
    """The close contenders timed again after ``s.busy_retry_s`` (``retime``, within
    ``s.busy_factor`` of the fastest, their earlier drops forgotten); their figures replace
    the busy ones ("busy_ms" keeps those). Returns the share of the CPU others took then."""
    logger.warning("end to end: other processes took %.0f%% of this machine's CPU while the "
                   "builds were timed: timing them again in %.0f s", 100 * share,
                   s.busy_retry_s)
    time.sleep(s.busy_retry_s)
    for name in runs:  # (an earlier runoff's outrun ones were dropped before, or are again)
        results[name].busy_ms = results[name].ms
        if results[name].fate in (Fate.DROPPED, Fate.OUTRUN):
            results[name].drop(Fate.RUNNING)
    with OtherLoad() as load:
        retime(results, runs, outside, target, s, factor=s.busy_factor)
    return load.share


def runoff(results, runs, outside, target, s, samples: dict | None = None) -> None:
    """The contenders within ``s.runoff_margin`` of the fastest are timed once more, side by
    side, until each has ``s.runoff_rounds`` batches (``samples``: name -> the batches the
    re-timing took, counted in): the verdict between close builds rests on the median of
    more rounds than one noisy stretch of a shared machine can swing. Their figures become
    the median of all their batches, taken round by round (``_by_round``); ``runoff`` marks
    those timed here."""
    for r in results.values():  # an earlier runoff's (``retime_when_busy`` times again)
        if r.fate is Fate.OUTRUN:
            r.drop(Fate.RUNNING)
        r.settled_against = None
    dropped = dict(samples or {})  # (the re-timing's batches, the dropped builds' among them)
    _tie_dropped(results, runs, outside, dropped)
    try:
        _runoff(results, runs, outside, target, s, samples)
    finally:
        _tie_dropped(results, runs, outside, dropped)


def _tie_dropped(results, runs, outside, samples: dict) -> None:
    """A build dropped while timed again (slower than the leader at its best, in every round
    both were timed: ``interleaved``'s drop) keeps its figure tied to the leader's, the
    fastest correct build timed on: its median ratio to it over the rounds both were
    timed in, times the leader's figure now (``settled_against``). Left at the median of
    its own few rounds, it can undercut a leader timed on into a slow stretch of the host:
    timm's repvgg_a0 int8 file on the Zen 4, where OpenVINO ran 4.3-4.5 ms in the rounds it
    shared with ONNX Runtime (5.4-5.8), then 9.5-11.9 timed on alone; ONNX Runtime, dropped
    at 5.76 ms, shipped against OpenVINO's 6.40 and ran 0.81x OpenVINO in the suite."""
    ok = correct_ms(results, runs, outside)
    live = {n: samples[n] for n in ok if samples.get(n) and results[n].fate is not Fate.DROPPED}
    if not live:
        return
    leader = min(live, key=lambda n: results[n].ms)
    for name, batches in samples.items():
        r = results.get(name)
        if r is None or r.fate is not Fate.DROPPED or name == leader or not batches:
            continue
        logs = [math.log(b / a) for a, b in zip(live[leader], batches) if a > 0 and b > 0]
        if not logs:
            continue
        tied = results[leader].ms * math.exp(statistics.median(logs))
        if tied > r.ms:
            r.ms = tied
            r.settled_against = leader


def _runoff(results, runs, outside, target, s, samples: dict | None = None) -> None:
    """``runoff`` past its ties (``_tie_dropped``)."""
    ok = correct_ms(results, runs, outside)
    fastest = min(ok.values(), default=math.inf)
    close = {n: runs[n] for n, ms in ok.items()
             if ms <= (1 + s.runoff_margin) * fastest and results[n].fate is not Fate.DROPPED}
    if len(close) < 2:
        return
    # The builds left out lost to the fastest by over the margin in the rounds they shared;
    # the runoff's rounds then move only its own builds' figures. On a host that ran at two
    # speeds, the runoff's 38 rounds fell mostly in the slow one: two model files rose from
    # ~3.7 to 6.0 ms, and the build left out at 4.2 ms (7 rounds, mostly fast) shipped, 0.967x
    # in the row (timm's hardcorenas_a on the Zen 4; docs/COVERAGE.md). They cannot ship.
    leader = min(ok, key=ok.get)
    for name in ok:
        if name not in close:
            results[name].drop(Fate.OUTRUN, leader)
    samples = {n: (samples or {}).get(n, []) for n in close}
    rounds = s.runoff_rounds - min(len(x) for x in samples.values())
    if rounds > 0:
        time_again(results, close, target, s, rounds=rounds, samples=samples)
        for name in close:
            results[name].runoff = True
    _by_round(results, samples)
    _settle(results, close, target, s, samples)


def _settle(results, close: dict, target, s, samples: dict) -> None:
    """The builds whose ranking against the leader the rounds so far leave open
    (``_open_calls``) timed on with it, ``s.runoff_step`` rounds at a time, until none is
    open or each has ``s.runoff_max_rounds`` batches; their figures taken round by round
    again among themselves.

    A build settled on the way is timed no more, and its figure stays tied to the leader it
    was settled against (``settled_against``): its ratio to it, times the leader's figure at
    the end. Left as it was, its figure would keep the rounds before while the leader's
    moved with the host: on a host at two speeds, rounds timed on in the slow one lift the
    leader past a build settled as slower, and that build would ship (the runoff's builds
    against the ones it left out; ``runoff``)."""
    tied: list = []  # (name, leader, ratio), in the order settled
    while True:
        todo = _open_calls(results, {n: samples[n] for n in close}, s)
        k = min((len(samples[n]) for n in todo), default=s.runoff_max_rounds)
        if len(todo) < 2 or k >= s.runoff_max_rounds:
            break
        leader = min(todo, key=lambda n: results[n].ms)
        tied += [(n, leader, results[n].ms / results[leader].ms)
                 for n in close if n not in todo]
        close = {n: close[n] for n in todo}
        time_again(results, close, target, s,
                   rounds=min(s.runoff_step, s.runoff_max_rounds - k), samples=samples)
        _by_round(results, {n: samples[n] for n in close})
        for name in close:
            results[name].runoff = True
    # a leader settled later is tied first: the builds tied to it follow its new figure
    for name, leader, ratio in reversed(tied):
        results[name].ms = ratio * results[leader].ms
        results[name].settled_against = leader


def _open_calls(results, samples: dict, s) -> set:
    """The builds of ``samples`` (name -> batches, one a round) whose place against the
    leader (the lowest ``ms``) is still open, with the leader; empty when none is. Open: the
    median of the round-by-round log ratio to the leader is under two standard errors
    (1.25 x 1.4826 x its median absolute deviation over the root of the rounds), and the
    two may still be ``s.same_share`` or more apart. Needs ``PAIRED_MIN_ROUNDS`` rounds."""
    if len(samples) < 2:
        return set()
    leader = min(samples, key=lambda n: results[n].ms)
    still = set()
    for name, batches in samples.items():
        logs = None if name == leader else round_log_ratios(samples[leader], batches,
                                                            tails=True)
        if logs is None:
            continue
        lead = statistics.median(logs)
        se = (1.25 * 1.4826 * statistics.median(abs(x - lead) for x in logs)
              / math.sqrt(len(logs)))
        if lead < 2 * se and abs(lead) + 2 * se >= s.same_share:
            still.add(name)
    return still | {leader} if still else set()


def _by_round(results, samples: dict) -> None:
    """The close builds' figures taken round by round (``timing.by_round``): a shared
    machine's load drifts over seconds, and the plain medians of two builds can land on
    different stretches of it (docs/BENCHMARKS.md, "Search time": convnext_base, where the
    plain medians shipped the slower library). ``median_ms`` keeps the plain median."""
    for name, ms in by_round(samples).items():
        results[name].median_ms = statistics.median(samples[name])
        results[name].ms = ms


def batch_ms(results, fns, s) -> float:
    """How long each build's batch of a round lasts (ms): ``s.batch_calls`` calls of the
    fastest of ``fns`` by its figure so far, within ``s.short_batch_ms``..``s.batch_ms``."""
    fastest = min((results[n].ms for n in fns), default=math.inf)
    return min(s.batch_ms, max(s.short_batch_ms, s.batch_calls * fastest))


def time_again(results, fns: dict, target, s, samples: dict | None = None, outside=(),
               **kw) -> None:
    """``fns`` (name -> run) timed side by side (``interleaved``, ``kw`` passed on), a build
    that lost even at its best timed no further (``s.drop_margin``; ``Fate.DROPPED``): their
    ``ms`` become these figures, the first kept as ``first_ms``; ``rounds``: the batches each
    figure is the median of, ``batches`` their figures in order. ``outside``: builds outside
    the accuracy budget (timed for the advice; they do not set the bar the others are
    dropped by)."""
    samples = {} if samples is None else samples
    dropped: set = set()
    kw.setdefault("min_ms", batch_ms(results, fns, s))
    for name, ms in interleaved(fns, sync=device_sync(target), samples=samples,
                                drop=s.drop_margin, dropped=dropped,
                                lead={n for n in fns if n not in outside}, **kw).items():
        r = results[name]
        if r.first_ms is None:
            r.first_ms = r.ms
        r.ms = ms
        if samples.get(name):
            r.rounds = len(samples[name])
            # each batch's ms per call, in order: how a verdict came about can be read back
            r.batches = [float(f"{v:.4g}") for v in samples[name]]
        if name in dropped and r.fate is Fate.RUNNING:
            r.drop(Fate.DROPPED)
