"""The fastest of a few callables on the same inputs, timed side by side here: ``decide``.
The floors' pick of the library that runs a model TVM cannot import
(``floors.whole_on_a_library``) and the dynamic search's choice at each point of its ranges
(``dynamic.search``) use it. Where a saved build is served, the first calls decide between
what the search left close instead (``check.race``): no timing at load."""
from __future__ import annotations

import logging
import time

import numpy as np

from ..measure.timing import by_round, interleaved
from ..precision import parse_accuracy

logger = logging.getLogger("collage_tvm")

# Rounds of the side-by-side timing, and the least time of one batch: a 1 ms model is
# decided in about 2 s, a 100 ms one in about 4 s (a call a batch).
ROUNDS = 15
BATCH_MS = 50.0
# A contender whose fastest batch is this share slower than the leader's median (after
# ``timing.DROP_AFTER`` rounds, slower in each) is timed no further.
DROP = 0.05
# Another contender replaces the shipped one only when it leads it by more than this share:
# a smaller lead is within the timing's noise (efficientnet_v2_l at 480x480 on the Zen 4,
# 2026-11-30: the file on ONNX Runtime chosen over OpenVINO on a 0.2% lead, then 3.4%
# behind it in the row's 45 rounds; docs/COVERAGE.md).
MARGIN = 0.01


def numpy_outputs(out) -> list:
    """A callable's result (a TVM tensor or numpy array, or a tuple or list of them) as numpy
    arrays."""
    outs = out if isinstance(out, (tuple, list)) else [out]
    return [o if isinstance(o, np.ndarray) else o.numpy() for o in outs]


def decide(fns: dict, args: list, accuracy="f32", rounds: int = ROUNDS,
           batch_ms: float = BATCH_MS) -> tuple[str, dict]:
    """The fastest of ``fns`` (name -> a callable on ``args``, TVM tensors; the first is the
    one the final check shipped, the reference) timed side by side here: (its name, a
    record). Each other one must give the reference's outputs within ``accuracy`` (the
    build's budget) or it is left out ("left_out": name -> why). Timed in ``rounds``
    alternating rounds (``timing.interleaved``; one that lost even at its best is timed no
    further), the figures taken round by round (``timing.by_round``); another replaces the
    first only when it leads it by more than ``MARGIN``. Record: {"chose",
    "ms": name -> ms, "rounds", "seconds", "left_out"}."""
    t0 = time.perf_counter()
    budget = parse_accuracy(accuracy)
    names = list(fns)
    reference = numpy_outputs(fns[names[0]](*args))
    runs, left_out = {names[0]: fns[names[0]]}, {}
    for name in names[1:]:
        try:
            judged = budget.check(numpy_outputs(fns[name](*args)), reference)
        except Exception as err:  # noqa: BLE001 - it cannot run here: the reference stays
            left_out[name] = f"it failed to run: {type(err).__name__}: {err}"
            continue
        if not judged["match"]:
            left_out[name] = (f"its outputs differ from {names[0]}'s (max error "
                              f"{judged['max_err']:.2e})")
            continue
        runs[name] = fns[name]
    record = {"chose": names[0], "ms": {}, "rounds": 0, "left_out": left_out}
    if len(runs) > 1:
        samples: dict = {}
        dropped: set = set()
        medians = interleaved({n: (lambda f=f: f(*args)) for n, f in runs.items()},
                              rounds=rounds, min_ms=batch_ms, samples=samples,
                              drop=DROP, dropped=dropped)
        # (the ones timed in every round, round by round; one dropped lost by its median)
        ms = {**medians, **by_round({n: s for n, s in samples.items() if n not in dropped})}
        # (one dropped lost to the leader in every round both were timed in: it cannot
        # win on the median of its few rounds against a leader timed on into a slow
        # stretch, ``runoff._tie_dropped``)
        chose = min((n for n in ms if n not in dropped), key=ms.get)
        if names[0] in ms and names[0] not in dropped and ms[chose] > ms[names[0]] * (1 - MARGIN):
            chose = names[0]  # a lead within the noise: the final check's verdict stands
        record.update(chose=chose, ms={n: round(v, 4) for n, v in ms.items()},
                      rounds=max((len(s) for s in samples.values()), default=0))
    record["seconds"] = round(time.perf_counter() - t0, 3)
    return record["chose"], record


__all__ = ["MARGIN", "ROUNDS", "decide", "numpy_outputs"]
