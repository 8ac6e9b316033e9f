"""Timing loops: one function until stable, two runtimes alternating, several side by side.

Every stage that times something uses these (the measurer, in-context calibration, the
final check, the bench), so the machine's drift and the runtimes' thread pools are
handled one way everywhere.

``sync``: on a GPU a call returns when its kernels are queued, not done; the loops call
``sync()`` (the device's synchronize, ``target.device_sync``) before reading the clock.
None on the CPU.
"""
from __future__ import annotations

import math
import random
import re
import statistics
import time

# Where the stages that time builds against each other import them from.
from .other_load import BUSY_SHARE, OtherLoad  # noqa: F401


def _done(sync) -> float:
    if sync is not None:
        sync()
    return time.perf_counter()


class _Flush:
    """Evicts the CPU's caches: writes a buffer of ``nbytes`` (twice the last-level cache),
    its parts side by side on ``threads`` threads (numpy lets go of the GIL on a large
    array), one a core by default. A cold sample (``time_main``) is one call after a
    flush, and the flush is most of its cost: TVM's own (``time_evaluator``'s
    ``cache_flush_bytes``) allocates its buffer for each batch and writes it with one
    thread (``docs/BENCHMARKS.md``, "Search time", has the search it slowed)."""

    def __init__(self, nbytes: int, threads: int | None = None):
        import numpy as np

        from ..target import host_cores

        self.buf = np.zeros(max(1, nbytes // 8), dtype=np.int64)
        threads = max(1, min(threads or host_cores(), len(self.buf)))
        self.parts = np.array_split(self.buf, threads)
        self._pool = None
        if threads > 1:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="collage-flush")

    def __call__(self) -> None:
        if self._pool is None:
            self.buf += 1
            return
        for done in [self._pool.submit(_add_one, part) for part in self.parts]:
            done.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None
        self.buf = self.parts = None


def _add_one(part) -> None:
    part += 1


#: A first run past ``time_main``'s cutoff by less than this (ms) is given a second, warm
#: run before it is cut short: a first call's lazy start (the VM's kernel lookup, a thread
#: pool waking) is a fixed cost that a kernel of microseconds can take a hundred times over.
#: Cut on its first run, a 3 us TVM convolution of a test model was recorded at 0.29-0.40 ms
#: in 2 searches of 6 (past 4x ONNX Runtime's 0.06 ms), and the search placed the whole model
#: on ONNX Runtime. A hopeless candidate of a large model (an untuned kernel of seconds) is
#: still cut after one run.
SECOND_LOOK_MS = 50.0
_FIRST_RUN_CUT = re.compile(r"cut short: first run ([0-9.]+) ms > cutoff ([0-9.]+) ms")


def past_second_look(first_ms: float, cutoff_ms: float | None) -> bool:
    """Whether a first run of ``first_ms`` is hopeless on its own: past ``cutoff_ms`` by over
    ``SECOND_LOOK_MS`` (False where there is no cutoff)."""
    return cutoff_ms is not None and first_ms > cutoff_ms + SECOND_LOOK_MS


def cut_before_second_look(reason: str | None) -> bool:
    """Whether ``reason`` (a cost's, in the DB) is ``time_main``'s cut on a first run that
    was not past the cutoff by over ``SECOND_LOOK_MS``: written before the second look
    (2026-11-28), which now times such a candidate warm. A cut after two runs, or after one
    far past the cutoff, is a true one."""
    found = _FIRST_RUN_CUT.match(reason or "")
    return found is not None and not past_second_look(float(found[1]), float(found[2]))


#: A call at least this long (ms, warm) is timed in batches of ``LONG_REPEAT`` samples: each
#: sample is then one call that already spans many of the machine's scheduling ticks, and a
#: library region of a large model (tens of ms, weights flushed before each call) cost
#: most of its measuring time in samples beyond what settled its median.
LONG_MS = 5.0
LONG_REPEAT = 3


def time_main(vm, args, dev, cutoff_ms: float | None = None, target_ms: float = 1.0,
              repeat: int = 5, max_batches: int = 4, sync=None,
              flush_bytes: int = 0, run=None) -> tuple[float, str | None, dict]:
    """Median ms of ``vm["main"](*args)``: warm-up, then batches of ``repeat`` samples of
    about ``target_ms`` each until two medians agree (3%); a call of ``LONG_MS`` or more:
    batches of ``LONG_REPEAT``.

    A first run slower than ``cutoff_ms`` (by over ``SECOND_LOOK_MS``, else the second run
    too) is hopeless: its time is returned at once. The
    samples are sized on a warm call: the first call of a fresh build (a session's lazy
    initialisation, a JIT) can be a hundred times slower and would leave a fast kernel
    timed one call per sample.

    ``flush_bytes``: each sample is one call after ``flush_bytes`` were written through the
    caches (``_Flush``, on every core), ``LONG_REPEAT`` samples a batch: the kernel's
    weights come from memory, as they do in a whole run of a model whose weights the
    last-level cache cannot hold (``Measurer.costs``). 0: calls back to back, weights in
    cache.

    ``run``: the VM's main captured as a CUDA graph (``cuda_graph.capture``); when it was
    captured, its replays are what is timed (``extra["cuda_graph"]``), in a loop here
    (the VM's ``time_evaluator`` would call the VM).
    """
    replay = run.replay if run is not None and run.captured else None
    fn = vm["main"]
    call = replay if replay is not None else (lambda: fn(*args))
    t0 = time.perf_counter()
    call()
    first_ms = (_done(sync) - t0) * 1e3
    if past_second_look(first_ms, cutoff_ms):
        return first_ms, f"cut short: first run {first_ms:.3f} ms > cutoff {cutoff_ms:.3f} ms", {
            "repeats": 1}
    t0 = _done(sync)
    call()  # second warm-up: caches, lazy init in libraries
    warm_ms = (_done(sync) - t0) * 1e3
    if cutoff_ms is not None and min(first_ms, warm_ms) > cutoff_ms:
        return warm_ms, (f"cut short: first runs {first_ms:.3f} and {warm_ms:.3f} ms > cutoff "
                         f"{cutoff_ms:.3f} ms"), {"repeats": 2}
    number = 1
    if replay is not None or not flush_bytes:  # samples of many calls, sized on a warm one
        t0 = _done(sync)
        call()
        warm_ms = (_done(sync) - t0) * 1e3
        number = max(1, int(target_ms / max(warm_ms, 1e-3)))
    if warm_ms >= LONG_MS:
        repeat = min(repeat, LONG_REPEAT)
    flush = None
    if replay is not None:
        def evaluator():
            out = []
            for _ in range(repeat):
                t0 = _done(sync)
                for _ in range(number):
                    replay()
                out.append((_done(sync) - t0) / number)
            return out
    elif flush_bytes:
        flush = _Flush(int(flush_bytes))
        repeat = min(repeat, LONG_REPEAT)  # a cold sample's cost is its flush's

        def evaluator():
            out = []
            for _ in range(repeat):
                flush()
                t0 = _done(sync)
                fn(*args)
                out.append(_done(sync) - t0)
            return out
    else:
        timer = vm.time_evaluator("main", dev, number=number, repeat=repeat)
        evaluator = lambda: timer(*args).results  # noqa: E731
    samples: list = []
    medians: list = []
    try:
        for _ in range(max_batches):
            samples += [r * 1e3 for r in evaluator()]
            medians.append(statistics.median(samples))
            if len(medians) >= 2 and abs(medians[-1] - medians[-2]) <= 0.03 * medians[-2]:
                break
    finally:
        if flush is not None:
            flush.close()
    extra = {"repeats": len(samples) * number}
    if replay is not None:
        extra["cuda_graph"] = True
    return statistics.median(samples), None, extra


def time_switch(fn_a, args_a, fn_b, args_b, rounds: int = 9, target_ms: float = 8.0,
                sync=None) -> tuple:
    """(switch_ms, extra): what one change of runtime costs between two kernels.

    Each round times ``a`` alone, ``b`` alone and ``a, b`` alternating (the same number of
    calls each, interleaved so drift hits all three); the switch cost is half the median
    excess of an alternating pair over one ``a`` plus one ``b`` (a pair holds two switches).
    """
    def loop(seq, n):
        t0 = _done(sync)
        for _ in range(n):
            for fn, args in seq:
                fn(*args)
        return (_done(sync) - t0) * 1e3 / n

    a, b = (fn_a, args_a), (fn_b, args_b)
    for _ in range(3):  # warm-up: lazy init, caches, thread pools
        loop([a, b], 5)
    pair_ms = loop([a, b], 10)
    n = max(5, int(target_ms / max(pair_ms, 1e-3)))
    excess, ta, tb, tab = [], [], [], []
    for _ in range(rounds):
        ta.append(loop([a], n))
        tb.append(loop([b], n))
        tab.append(loop([a, b], n))
        excess.append(tab[-1] - ta[-1] - tb[-1])
    med = statistics.median
    return max(0.0, med(excess) / 2), {"a_ms": med(ta), "b_ms": med(tb), "pair_ms": med(tab),
                                       "repeats": rounds * n}


def time_side_by_side(runs: list, rounds: int = 9, target_ms: float = 2.0, sync=None,
                      flush_bytes: int = 0) -> list:
    """Median ms per call of each ``(fn, args)``, timed in alternating rounds (the same
    drift hits each), after two warm-up calls each. ``flush_bytes``: as in ``time_main``,
    every timed call after the caches were flushed (three such calls a sample)."""
    flush = _Flush(flush_bytes) if flush_bytes else None

    def loop(fn, args, n):
        if flush is not None:
            total = 0.0
            for _ in range(n):
                flush()
                t0 = _done(sync)
                fn(*args)
                total += _done(sync) - t0
            return total * 1e3 / n
        t0 = _done(sync)
        for _ in range(n):
            fn(*args)
        return (_done(sync) - t0) * 1e3 / n

    for fn, args in runs:
        fn(*args)
        fn(*args)
    number = [3 if flush is not None else max(1, int(target_ms / max(loop(fn, args, 1), 1e-3)))
              for fn, args in runs]
    samples: list = [[] for _ in runs]
    try:
        for _ in range(rounds):
            for k, (fn, args) in enumerate(runs):
                samples[k].append(loop(fn, args, number[k]))
    finally:
        if flush is not None:
            flush.close()
    return [statistics.median(s) for s in samples]


#: Seconds ``interleaved`` waits at most before each batch: long enough for the thread pools
#: of the function before it to stop spinning (without it, a model file on ONNX Runtime timed
#: right after another ONNX Runtime build of the same model was charged for that build's
#: spinning threads beyond what one untimed call absorbs; ``tests/test_baselines.py`` shows
#: the case). An ONNX Runtime session's pool spins for ~40 ms after a batch of a small
#: convolution on a 2-vCPU AMD EPYC Zen 4; OpenVINO's for ~1 ms; nothing spins after a call
#: too small to wake a pool. The pause ends sooner once the process is quiet (``settle``).
SETTLE_S = 0.05
#: ``settle`` looks at the process's CPU time in steps of this many seconds, and takes a step
#: in which the process's threads other than the caller's used under ``QUIET_SHARE`` of it
#: as quiet: a spinning thread uses all of it.
SETTLE_STEP_S = 0.01
QUIET_SHARE = 0.2


def settle(max_s: float) -> float:
    """Sleep until the threads this process left running (a library's pool still spinning
    after its last call) have gone idle: steps of ``SETTLE_STEP_S`` until one in which the
    other threads used under ``QUIET_SHARE`` of its time in CPU, at most ``max_s`` in all
    (a process that stays busy, a build compiling beside it, waits ``max_s`` as before).
    Returns the seconds waited. A tiny model's batches, whose calls wake no pool, no longer
    wait 50 ms each: an onnx node test's final check spent half its time in these pauses."""
    waited = 0.0
    while waited < max_s:
        step = min(SETTLE_STEP_S, max_s - waited)
        c0, t0, w0 = time.process_time(), time.thread_time(), time.perf_counter()
        time.sleep(step)
        dt = time.perf_counter() - w0
        others = (time.process_time() - c0) - (time.thread_time() - t0)
        waited += dt
        if others < QUIET_SHARE * max(dt, step):
            break
    return waited


ORDER_SEED = 0  # ``interleaved``'s order of the functions in each round


#: ``interleaved(..., drop=...)``: a function whose fastest batch, once it has this many,
#: is slower than the leader's median by more than the margin given, and that was slower
#: than the leader in every round, is timed no further (``_lost``).
DROP_AFTER = 4


def interleaved(fns: dict, rounds: int = 7, min_ms: float = 200.0, sync=None,
                settle_s: float | None = None, samples: dict | None = None,
                drop: float | None = None, dropped: set | None = None,
                lead=None) -> dict:
    """Median ms per call of each function, timed in alternating rounds (noise hits all alike).

    Each batch starts after a pause of up to ``settle_s`` (``settle``) and with one untimed
    call: whatever the function before it left behind (a library's thread pool still
    spinning on every core, the cache full of other weights) would otherwise slow down the
    function that comes next. Each round runs the functions in a fresh order (shuffled,
    seeded: the same calls time alike), so that what one function leaves behind beyond the
    pause does not fall on the same other function every round (rounds that only started
    one function further along kept each function's predecessor fixed), and slow drift of
    the machine favours none. ``settle_s``: ``SETTLE_S`` unless given.
    ``samples``: name -> the ms per call of each batch, kept from an earlier call (extended
    in place with this call's; the median is over them all).
    ``drop``: after each round, a function with ``DROP_AFTER`` batches or more whose fastest
    batch is over ``1 + drop`` times the median of the leader (the lowest median), and that
    was slower than the leader in each of those rounds, is timed no further, and the
    rounds end when one function is left: a comparison needs no more rounds for a function
    that even at its best lost (two functions that take the same time each have a batch
    below the other's median, and each wins a round, in all but a few of 2**DROP_AFTER
    orderings). Its median is over the batches it had; its name goes into ``dropped``.
    ``lead``: the names that can be the leader (default: all; a build timed only to say how
    it compares, outside an accuracy budget, must not set the bar the others are held to)."""
    settle_s = SETTLE_S if settle_s is None else settle_s
    for fn in fns.values():  # warm-up
        fn()
        fn()
    number = {}
    for name, fn in fns.items():
        t0 = _done(sync)
        fn()
        number[name] = max(1, int(min_ms / max((_done(sync) - t0) * 1e3, 1e-3)))
    samples = {} if samples is None else samples
    for n in fns:
        samples.setdefault(n, [])
    names = list(fns)
    order = random.Random(ORDER_SEED)
    for _ in range(rounds):
        if drop is not None and len(names) < 2 <= len(fns):
            break
        order.shuffle(names)
        for name in names:
            fn = fns[name]
            settle(settle_s)  # the last batch's spinning threads go idle
            fn()  # lead-in, untimed
            t0 = _done(sync)
            for _ in range(number[name]):
                fn()
            samples[name].append((_done(sync) - t0) * 1e3 / number[name])
        if drop is not None:
            lost = _lost(names, samples, drop, fns if lead is None else lead)
            names = [n for n in names if n not in lost]
            if dropped is not None:
                dropped.update(lost)
    return {n: statistics.median(samples[n]) for n in fns}


def _lost(names, samples: dict, drop: float, lead) -> set:
    """The functions among ``names`` whose fastest of ``DROP_AFTER`` or more batches is over
    ``1 + drop`` times the leader's median, the leader among ``names`` in ``lead``
    (``interleaved``), and that were slower than the leader in every round both were timed
    in (paired by round: the machine's drift over a few seconds hits both alike). A large
    model's single-call batches swing by ~10% a round on a shared VM: four of them from a
    slow stretch of the host could drop the faster build, leaving the verdict to the
    others' four batches each (docs/BENCHMARKS.md, "Search time": convnext_base)."""
    leaders = {n: statistics.median(samples[n]) for n in names if n in lead}
    if not leaders:
        return set()
    best = min(leaders, key=leaders.get)
    bar = (1 + drop) * leaders[best]
    return {n for n in names if n != best and len(samples[n]) >= DROP_AFTER
            and min(samples[n]) > bar and _slower_every_round(samples[n], samples[best])}


def _slower_every_round(mine: list, leader: list) -> bool:
    """Whether each of ``mine``'s batches is slower than ``leader``'s of the same round (the
    two lists' tails: ``interleaved`` appends one batch a round to each function it times)."""
    k = min(len(mine), len(leader))
    return k > 0 and all(m > l for m, l in zip(mine[-k:], leader[-k:]))


#: Rounds two functions must share before their figures are compared round by round
#: (``round_log_ratios``): the final check's ``_by_round`` and ``_open_calls``, the suites'
#: ``paired_ratio``.
PAIRED_MIN_ROUNDS = 5


def round_log_ratios(mine: list, other: list, tails: bool = False) -> list | None:
    """log(other's batch / mine) of each round both were timed in, or None with fewer than
    ``PAIRED_MIN_ROUNDS`` of them (a non-positive batch counts as not timed). The rounds are
    the lists' heads (two functions timed together from the first round, one of them timed
    on alone after: a suite row's run-off), or with ``tails`` their tails (functions timed
    on together after others stopped: ``interleaved`` appends one batch a round to each).
    The median of the logs is the paired ratio: a slow stretch of the machine falls on both
    batches of a round, and cancels (docs/BENCHMARKS.md, "Paired ratios")."""
    mine, other = list(mine or ()), list(other or ())
    k = min(len(mine), len(other))
    pairs = zip(mine[len(mine) - k:], other[len(other) - k:]) if tails else zip(mine, other)
    logs = [math.log(b / a) for a, b in pairs if a > 0 and b > 0]
    return logs if len(logs) >= PAIRED_MIN_ROUNDS else None


def by_round(samples: dict) -> dict:
    """name -> ms of the functions of ``samples`` (name -> their batches, one a round, as
    ``interleaved`` appends them), taken round by round over the rounds all of them were
    timed in (the tails): each batch over the geometric mean of its round's batches (timed
    within a few seconds of each other), the median of those ratios times the median round.
    A shared machine's load drifts over seconds: one function's median can land on slower
    rounds than another's while the rounds themselves say which is ahead (docs/BENCHMARKS.md,
    "Search time": convnext_base). Empty with fewer than two functions or
    ``PAIRED_MIN_ROUNDS`` common rounds."""
    k = min((len(s) for s in samples.values()), default=0)
    if len(samples) < 2 or k < PAIRED_MIN_ROUNDS:
        return {}
    tails = {n: s[-k:] for n, s in samples.items()}
    rounds = [statistics.geometric_mean([t[i] for t in tails.values()]) for i in range(k)]
    typical = statistics.median(rounds)
    return {name: typical * statistics.median(b / r for b, r in zip(batches, rounds))
            for name, batches in tails.items()}
