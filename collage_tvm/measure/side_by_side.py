"""Candidates re-timed side by side, so drift between two measurements no longer decides
(``placer.alternatives.refine``: the alternative covers of an op-level placement), and each
function's time fitted across the sets it was timed in (``fit_side_by_side``)."""
from __future__ import annotations

import hashlib
import logging
import math
import time

from .keys import SIDE_KEY
from .progress import progress_bar

logger = logging.getLogger("collage_tvm")


def retime(measurer, sets: list, backends: dict, budget_s: float | None = None) -> list:
    """Time each set of candidates (all measured by ``measurer.costs``) side by side in one
    process, in alternating rounds. Returns one ``{identity: ms}`` per set timed (see
    ``fit_side_by_side``).

    Each set's times are kept in the cost DB (key ``__side_by_side__:<hash of its
    members>``) and reused by the next build. Once ``budget_s`` seconds have gone on
    re-timing, only sets the DB already holds are used; a set whose re-timing fails is
    left out (its candidates keep their first times)."""
    func_of = measurer._func_of  # candidate -> (DB key, function timed)
    timed: list = []
    t_start, skipped = time.perf_counter(), 0
    bar = progress_bar(len(sets), measurer.progress,
                       "re-timing alternative covers side by side")
    for members in sets:
        bar.update(1)
        entries = sorted({(c.backend, *func_of[c][:1]): (c.backend, *func_of[c])
                          for c in members}.values(), key=lambda e: (e[0], e[1]))
        names = sorted({name for name, _, _ in entries})
        backend = "+".join(names)
        version = "+".join(backends[n].version() for n in names)
        key = f"{SIDE_KEY}:" + hashlib.sha1("|".join(
            f"{name}:{k}" for name, k, _ in entries).encode()).hexdigest()
        rec = measurer.db.get(backend, version, key, measurer.device)
        if rec is not None and len(rec.extra.get("times", [])) == len(entries):
            measurer.hits += 1
            times = rec.extra["times"]
        elif budget_s is not None and time.perf_counter() - t_start > budget_s:
            skipped += 1
            continue
        else:
            times, reason, _ = measurer._measure_side_by_side(
                [(backends[name], func, k) for name, k, func in entries])
            measurer.side_by_side += 1
            if not isinstance(times, list):
                logger.info("side-by-side re-timing of %s failed: %s",
                            ", ".join(c.label or c.backend for c in members), reason)
                continue
            times = [float(t) for t in times]
            if not all(math.isfinite(t) and t > 0 for t in times):
                continue
            measurer.db.put(backend, version, key, measurer.device, sum(times), None,
                            {"label": "side-by-side", "times": times,
                             "members": [[name, k] for name, k, _ in entries]})
        timed.append({(name, k): t for (name, k, _), t in zip(entries, times)})
    bar.close()
    measurer.seconds["re-time"] += time.perf_counter() - t_start
    if skipped:
        logger.info("side-by-side re-timing: %d of %d alternative covers left on their first "
                    "times (the %.0f s budget went on the larger ones)", skipped, len(sets),
                    budget_s)
    return timed


def fit_side_by_side(sets: list) -> dict:
    """Each function's time from several side-by-side sets: ``t[s][f] = x[f] * d[s]`` with
    ``d[s]`` the machine's drift while set ``s`` ran, solved by least squares on the logs.
    Sets linked through shared functions share one scale, fixed by their drifts averaging 1;
    within one set the fitted times keep the measured ratios unless another set contradicts
    them."""
    import numpy as np

    logs = [{f: math.log(t) for f, t in s.items()} for s in sets if s]
    funcs = sorted({f for s in logs for f in s})
    if not funcs:
        return {}
    col = {f: i for i, f in enumerate(funcs)}
    n_f, n_s = len(funcs), len(logs)
    parent = list(range(n_s))  # sets linked through shared functions

    def root(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    first: dict = {}
    for k, s in enumerate(logs):
        for f in s:
            if f in first:
                parent[root(k)] = root(first[f])
            else:
                first[f] = k
    comps = sorted({root(k) for k in range(n_s)})
    rows, rhs = [], []
    for k, s in enumerate(logs):
        for f, v in s.items():
            r = np.zeros(n_f + n_s)
            r[col[f]], r[n_f + k] = 1.0, 1.0
            rows.append(r)
            rhs.append(v)
    for c in comps:  # gauge: the drifts of one linked family average 1
        r = np.zeros(n_f + n_s)
        for k in range(n_s):
            if root(k) == c:
                r[n_f + k] = 1.0
        rows.append(r)
        rhs.append(0.0)
    sol = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)[0]
    return {f: math.exp(sol[col[f]]) for f in funcs}
