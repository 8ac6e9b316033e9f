"""The final check on a machine short of memory: a model of gigabytes of weights cannot
hold every contender's build at once (``check.never_slower`` asks ``short`` before each
build, and ``make_room`` when it is)."""
from __future__ import annotations

import logging

from .._memory import release_memory
from ..byoc import forget_lowered
from ..graph.subgraph import constant_bytes
from .contender import Fate
from .reference import reference
from ..precision import INT8_MODEL
from .runoff import time_again

logger = logging.getLogger("collage_tvm")


def weight_bytes(graph) -> int:
    """Bytes of the weights of ``graph``'s model: what each build holds a copy of."""
    return sum(constant_bytes(n.value) for n in graph.nodes)


def memory_short(weights: int, s) -> bool:
    """Whether one more build of a model with ``weights`` bytes of weights may not fit in
    the memory left (``s.build_holds`` times the weights, and a gigabyte to spare)."""
    return _available() < s.build_holds * weights + (1 << 30)


def room_beside_one(weights: int, s) -> bool:
    """Whether the next build fits beside the one build kept (``make_room``, after
    narrowing): the memory free now is what is left with it held."""
    return not memory_short(weights, s)


def make_room(runs: dict, results: dict, outputs: dict, builds: dict, accuracy, target,
              floors: dict, weights: int, s) -> None:
    """Memory is short for the next build (``memory_short``). First the lowering cache goes
    (``byoc.forget_lowered``: the libraries' callables of builds no longer held, the search's
    graph-level placements among them; a held build keeps its own); then the builds held are
    narrowed to the fastest correct one (``narrow``); and where even that one leaves too
    little beside the next build (regnet_y_128gf, 2.6 GB of weights: 6.3 GB free with one
    build kept, and the next build's compile killed the process), it is set aside too: its
    figures stand, taken before the next builds rather than beside them
    (``Fate.SET_ASIDE``), and it can still ship (the shipped build is compiled again after
    the check)."""
    forget_lowered()
    release_memory()
    if not memory_short(weights, s):
        logger.info("end to end: memory was short: the lowering cache freed (%.1f GB free "
                    "now)", _available() / 1e9)
        return
    if len(runs) > 1:
        narrow(runs, results, outputs, builds, accuracy, target, floors, s)
    if runs and not room_beside_one(weights, s):
        (kept,) = runs
        del runs[kept]
        results[kept].drop(Fate.SET_ASIDE)
        release_memory()
        logger.warning("end to end: memory is short even for one build beside the next: %s "
                       "set aside, its figures taken before the next builds stand (%.1f GB "
                       "free now)", kept, _available() / 1e9)


def narrow(runs: dict, results: dict, outputs: dict, builds: dict, accuracy, target,
           floors: dict, s) -> None:
    """Memory is short (a model of gigabytes of weights, ViT-H/14): the builds held so far
    are timed side by side now, and all but the fastest correct one are freed. A freed
    build keeps its times and has lost (``Fate.LOST``) to the one kept (it cannot be
    shipped); the one kept meets the next builds side by side as usual."""
    ref = reference(results, builds, floors, quantized=accuracy.name == INT8_MODEL)
    for name in runs:
        results[name].judged(accuracy.check_seeds(outputs[name], outputs[ref]))
    correct = {n: runs[n] for n in runs if results[n].match}
    if len(correct) > 1:
        time_again(results, correct, target, s)
    keep = min(correct, key=lambda n: results[n].ms, default=None)
    freed = [n for n in runs if n != keep]
    for name in freed:
        del runs[name]
        if keep is not None:
            results[name].drop(Fate.LOST, keep)
    release_memory()
    logger.warning("end to end: memory is short: %s timed side by side, %s kept, %s freed "
                   "(%.1f GB free now)", ", ".join(correct) or "nothing", keep,
                   ", ".join(freed), _available() / 1e9)


def _available() -> int:
    import psutil

    return psutil.virtual_memory().available
