"""The cost of every distinct candidate: the cost DB first, then measurement (paper §4.1).

``Measurer`` is the cost cache: it keys each candidate (``keys``), answers from the DB, and
has the misses timed by the one ``timers.Timer`` chosen when it is made (in this process,
in the measuring child, on RPC servers). What it measures besides candidates lives apart:
the switch costs between backends (``switch``), candidates re-timed side by side
(``side_by_side``), builds ahead in build processes (``builds``), a lean search's verdict
(``verdicts``).
"""
from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

from tvm import relax

from ..graph.subgraph import (PART_ATTR, constant_bytes, extract_function, function_key,
                              one_op_function)
from ..target import cache_bytes
from . import builds, side_by_side, switch, verdicts
from .db import CostDB
from .keys import CALL_OVERHEAD_KEY, COLD_KEY, WHOLE_KEY
from .progress import progress_bar
from .records import crash_signal
from .timers import choose, has_call

logger = logging.getLogger("collage_tvm")


def probe_function(backend) -> relax.Function:
    """A tiny kernel whose time is the backend's call overhead (the paper's epsilon): the
    lowering's own ``probe()`` when it has one, else a 1-element ``add``."""
    low = backend.get_lowering()
    func = low.probe() if low is not None and hasattr(low, "probe") else None
    return func if func is not None else add_probe()


def add_probe() -> relax.Function:
    """The default probe: a 1-element ``add``."""
    return one_op_function((1,), lambda x: relax.op.add(x, x))


class DeadlinePassed(Exception):
    """A cost was not in the DB and ``Measurer.deadline`` had passed: nothing was measured."""


@dataclass
class _GraphCache:
    """What a measurer keeps about the graph it measures, across calls on it."""

    graph: object
    weights: list                 # each node's weight bytes
    cold: bool                    # its weights pass half the last-level cache (``costs``)
    keyed: dict = field(default_factory=dict)  # candidate -> (DB key, function timed)
    # node set -> the least cost measured for it on any backend: a slow candidate measured in
    # a later call (a lean search's round) is cut short by a library's time for the same
    # nodes measured in an earlier one
    best: dict = field(default_factory=dict)


class Measurer:
    """Looks costs up in ``db`` and measures the misses (in a child process when ``isolate``).
    ``deadline`` (a ``time.perf_counter()`` value, None: none): past it, a miss raises
    ``DeadlinePassed`` instead of being measured (a budgeted search stops on time)."""

    def __init__(self, target, db: CostDB, build_vm, isolate: bool = True,
                 progress: bool = True, cutoff_factor: float = 4.0, second_pass: bool = True,
                 tuning=None, build_jobs: int = 0, remote=None):
        """``build_vm(func, backend, target) -> VirtualMachine`` builds a candidate exactly
        as the final build runs it (``collage_tvm.byoc.candidate_vm``); a top-level
        function (or a partial of one), so the measurement worker receives it by pickle.
        ``tuning``: the ``TuningDB`` the builds apply; a TVM candidate's DB key then names
        the tuning records its kernels use (``TuningDB.signature``), so a kernel tuned
        since is measured again and an untouched one is not.
        ``build_jobs``: processes that build the candidates ``costs`` will time before it
        times them (``prebuild``); 0: each is built where it is timed.
        ``remote``: a ``remote.RemoteDevices``: everything is measured on its RPC servers
        (``costs`` spreads the candidates over them) and keyed by their device; its owner
        closes it. ``isolate`` and ``remote`` choose the measurer's ``timer`` once
        (``timers.choose``)."""
        self.target = target
        self.build_vm = build_vm
        self.db = db
        self.isolate = isolate
        self.progress = progress
        self.cutoff_factor = cutoff_factor
        self.remote = remote
        self._prebuilt = os.path.join(tempfile.gettempdir(),
                                      f"collage-builds-{os.getpid()}-{id(self):x}")
        self.timer = choose(target, build_vm, self._prebuilt, isolate, remote)
        self.device = self.timer.device
        self.target_json = self.timer.target_json
        self.build_jobs = max(0, int(build_jobs)) if self.timer.prebuilds else 0
        # Written through the caches before a cold timing (``costs``): twice the last level.
        self.flush_bytes = 2 * cache_bytes(3) if target.kind.name != "cuda" else 0
        self.measured = 0
        self.hits = 0
        self.failures: list = []  # (backend, label, reason)
        # backend -> why: a library that crashed its measuring process on a candidate of this
        # model (``records.crash_signal``), now or in the cost DB's records
        self.crashed: dict = {}
        self.retried = 0  # earlier failures of the moment measured again (``CostRecord.retry``)
        self._func_of: dict = {}  # candidate -> (DB key, standalone function), from costs()
        self.side_by_side = 0  # sets of candidates re-timed side by side (retime)
        self._graph: _GraphCache | None = None  # what is kept about the graph measured last
        self.second_pass = second_pass
        self.tuning = tuning
        self.deadline: float | None = None
        self.seconds = {"parallel builds": 0.0, "second pass": 0.0,
                        "re-time": 0.0}  # where measuring time went
        self.prebuilt = 0  # candidates built by build processes (``prebuild``)

    @classmethod
    def from_options(cls, target, db: CostDB, build_vm, options, tuning=None,
                     progress: bool | None = None, remote=None) -> "Measurer":
        """A measurer as ``options`` (``SearchOptions``) asks: in a child process or not,
        with a progress bar or not (``progress`` overrides), its build processes, and on
        the RPC servers of ``options.rpc_tracker`` / ``rpc_key`` when given: ``remote``,
        the search's ``remote.RemoteDevices`` (``build.SearchState.remote``; the search
        closes it, not the measurer)."""
        if options.rpc_tracker and remote is None:
            raise ValueError("options.rpc_tracker is set: pass the search's RemoteDevices "
                             "(remote=)")
        jobs = (builds.default_build_jobs(target) if options.build_jobs is None
                else options.build_jobs)
        return cls(target, db, build_vm, isolate=options.isolate,
                   progress=options.progress if progress is None else progress,
                   tuning=tuning, build_jobs=jobs, remote=remote)

    @property
    def _worker(self):
        """The measuring child the timer sends to (``timers.InChild``), else None."""
        return getattr(self.timer, "worker", None)

    def _context(self) -> dict:
        """Who asks, for the measuring child (``timers.Timer.context``)."""
        return self.timer.context()

    def close(self) -> None:
        self.timer.close()
        shutil.rmtree(self._prebuilt, ignore_errors=True)

    def _flush_for(self, keys) -> int:
        """Bytes to flush before each timed call of candidates under ``keys``: the
        measurer's flush size when any was costed cold (``COLD_KEY``), else 0."""
        return self.flush_bytes if any(k and k.endswith(COLD_KEY) for k in keys) else 0

    def _measure(self, backend, func, cutoff_ms, key=None) -> tuple:
        return self.timer.run("measure_function", [(backend, func, key)], cutoff_ms,
                              self._flush_for([key]))

    def _measure_side_by_side(self, items: list) -> tuple:
        return self.timer.run("measure_side_by_side", items,
                              self._flush_for([k for _, _, k in items]))

    def _lookup_or_measure(self, backend, key, func, label, cutoff_ms=None) -> float:
        done = self.timer.measured_ahead(backend.name, key)
        return self._cached(backend.name, backend.version(), key, label,
                            (lambda: done) if done is not None else
                            (lambda: self._measure(backend, func, cutoff_ms, key)))

    def _cached(self, name: str, version: str, key: str, label: str, measure) -> float:
        """The DB's cost for (name, version, key, device), else ``measure()`` -> (cost,
        reason, extra), stored; a failure (inf) is recorded with its reason."""
        rec = self.db.get(name, version, key, self.device)
        if rec is not None and not rec.retry:
            self.hits += 1
            self._note_crash(name, label, rec.reason if math.isinf(rec.cost_ms) else None)
            return rec.cost_ms
        if self.deadline is not None and time.perf_counter() > self.deadline:
            if rec is not None:  # a failure of the moment, not retried this run
                return rec.cost_ms
            raise DeadlinePassed(f"{name} {label}: not measured, the deadline has passed")
        if rec is not None:
            self.retried += 1
            logger.info("%s %s: measuring again once (earlier: %s)", name, label, rec.reason)
        cost, reason, extra = measure()
        self.measured += 1
        if math.isinf(cost):
            self.failures.append((name, label, reason))
            logger.info("%s %s failed: %s", name, label, reason)
            self._note_crash(name, label, reason)
        kept = {"label": label, **{k: v for k, v in extra.items() if k != "traceback"}}
        if rec is not None and math.isinf(cost):
            kept["retried"] = True  # failed twice: it stays a failure
        self.db.put(name, version, key, self.device, cost, reason, kept)
        return cost

    def _note_crash(self, name: str, label: str, reason) -> None:
        sig = crash_signal(reason)
        if sig is not None and name not in self.crashed:
            self.crashed[name] = f"{name} crashed ({sig}) measuring {label} of this model"
            logger.warning("%s: it runs no whole build, graph-level region or model file in "
                           "this process", self.crashed[name])

    def epsilon(self, backends) -> dict:
        """Measured call overhead of each backend (ms): the paper's epsilon, which the DP
        adds once per chosen candidate."""
        return {b.name: max(0.0, self._lookup_or_measure(
            b, CALL_OVERHEAD_KEY, probe_function(b), "epsilon-probe")) for b in backends}

    def switch_costs(self, backends) -> dict:
        """``(a, b) -> ms``: the switch cost of a kernel of ``b`` right after one of ``a``,
        for every pair (``switch.switch_costs``)."""
        return switch.switch_costs(self, backends)

    def costs(self, graph, candidates, backends: dict, cutoffs: dict | None = None) -> dict:
        """Measured cost (ms, inf when failed) of every candidate.

        Library candidates are measured first (fast; their times give the cutoff for slow
        TVM candidates), in graph order, so the alternatives for the same operators (conv,
        conv+bias, conv+bias+relu) are timed seconds apart: a burst of machine noise (a
        2-vCPU VM loses whole seconds to its neighbours) then shifts them together instead
        of one kind of fusion everywhere. Those measured here get a second pass in reverse
        order and keep the lower time (``second_pass``). ``cutoffs``: candidate -> ms past
        which its first run cuts its timing short (it cannot win; ``placer.lean`` gives
        them), beside the cutoff from the best time measured for the same nodes.

        Cold caches: timed back to back, a kernel keeps its weights in the CPU's caches,
        which in a whole run of a model whose weights the last-level cache cannot hold it
        does not: there every group's weights come from memory again on each inference.
        ResNet-18's last convolutions (10 MB of weights each, on onnxruntime): 0.21 ms back
        to back, 0.65 ms in the whole run, 0.83 ms after a flush. So where the model's
        weights pass half the last-level cache, a candidate holding more weights than the
        per-core cache is timed one call after each flush (``time_main``'s
        ``flush_bytes``), under a DB key of its own (``COLD_KEY``).
        """
        by_key = self._by_key(graph, candidates, backends)
        order = sorted(by_key, key=lambda bk: (
            (0, min(min(c.nodes) for c in by_key[bk][1]), min(len(c.nodes) for c in by_key[bk][1]))
            if backends[bk[0]].is_external else (1, min(len(c.nodes) for c in by_key[bk][1]), 0)))
        if self.build_jobs:
            self.prebuild([bk for bk in order if has_call(by_key[bk][0])
                           and builds.prebuilds(backends[bk[0]])], by_key, backends)
        self.timer.ahead(self, order, by_key, backends)  # on RPC servers: every miss at once
        best_for_nodes = self._on(graph).best
        costs: dict = {}
        fresh: list = []  # (bk, cutoff) of library candidates measured (not from the DB) now
        bar = progress_bar(len(order), self.progress)
        for bk in order:
            backend = backends[bk[0]]
            func, cands = by_key[bk]
            known = [best_for_nodes[c.nodes] for c in cands if c.nodes in best_for_nodes]
            known += [cutoffs[c] / self.cutoff_factor for c in cands if c in (cutoffs or {})]
            cutoff = self.cutoff_factor * min(known) if known else None
            before = self.measured
            if not backend.is_external and not has_call(func):
                cost = 0.0  # tuples, getters, match_cast: TVM compiles them to no kernel
            else:
                cost = self._lookup_or_measure(backend, bk[1], func, cands[0].label, cutoff)
            if self.second_pass and backend.is_external and self.measured > before \
                    and math.isfinite(cost):
                fresh.append(bk)
            for c in cands:
                costs[c] = cost
                self._func_of[c] = (bk[1], func)
                best_for_nodes[c.nodes] = min(cost, best_for_nodes.get(c.nodes, math.inf))
            # No redraw of its own (the update below redraws when due): off a terminal a
            # redraw is a line, one per candidate.
            bar.set_postfix_str(f"measured {self.measured}, cached {self.hits}", refresh=False)
            bar.update(1)
        bar.close()
        if len(fresh) > 1:
            lower = self._second_pass(fresh[::-1], by_key, backends)
            for bk, cost in lower.items():
                for c in by_key[bk][1]:
                    costs[c] = min(costs[c], cost)
        return costs

    def identities(self, graph, candidates, backends: dict) -> dict:
        """candidate -> (backend, DB key): candidates with one identity are one function,
        measured once (``placer.lean`` hands one's cost to the others)."""
        return {c: bk for bk, (_, cands) in self._by_key(graph, candidates, backends).items()
                for c in cands}

    def skipped_before(self, graph, candidates, backends: dict, tag: str = "") -> set | None:
        """A lean search's verdict over these candidates, as the cost DB keeps it
        (``verdicts.skipped_before``)."""
        return verdicts.skipped_before(self, graph, candidates, backends, tag)

    def keep_skipped(self, graph, candidates, backends: dict, skipped: set, lower_ms: float,
                     tag: str = "") -> None:
        """Keep a lean search's verdict in the cost DB (``verdicts.keep_skipped``)."""
        verdicts.keep_skipped(self, graph, candidates, backends, skipped, lower_ms, tag)

    def _on(self, graph) -> "_GraphCache":
        """What is kept about ``graph`` across calls (renewed when another graph comes)."""
        if self._graph is None or self._graph.graph is not graph:
            weights = [constant_bytes(n.value) for n in graph.nodes]
            self._graph = _GraphCache(graph, weights, self.flush_bytes > 0
                                      and sum(weights) > cache_bytes(3) // 2)
        return self._graph

    def _by_key(self, graph, candidates, backends: dict) -> dict:
        """(backend, DB key) -> (the function timed, [candidates timed by it]). Each
        candidate's function is extracted once per graph (a lean search asks again each
        round)."""
        keyed = self._on(graph).keyed
        by_key: dict = {}
        for cand in candidates:
            if cand not in keyed:
                keyed[cand] = self._key_of(graph, cand, backends)
            key, func = keyed[cand]
            by_key.setdefault((cand.backend, key), (func, []))[1].append(cand)
        return by_key

    def _key_of(self, graph, cand, backends: dict) -> tuple:
        """(DB key, function timed) of one candidate."""
        kept = self._on(graph)
        func = extract_function(graph, cand.nodes)[0]
        key = function_key(func)
        if len(cand.nodes) < len(graph):  # timed as it runs among the other groups
            func = func.with_attr(PART_ATTR, True)
        else:  # the whole model: timed alone, a DB entry apart from the same piece's
            key += WHOLE_KEY
        if self.tuning is not None and not backends[cand.backend].is_external:
            sig = self.tuning.signature(func, key)
            key = f"{key}|tuned:{sig}" if sig else key
        if kept.cold and sum(kept.weights[i] for i in cand.nodes) > cache_bytes(2):
            key += COLD_KEY
        return key, func

    def known(self, graph, candidates, backends: dict) -> dict:
        """The cost of each of ``candidates`` the cost DB already holds (a failure of the
        moment left out: it is measured again), or that runs no kernel (0): nothing is
        measured. ``placer.lean`` measures the rest only as the DP asks for them."""
        out = {}
        best = self._on(graph).best
        for (name, key), (func, cands) in self._by_key(graph, candidates, backends).items():
            backend = backends[name]
            if not backend.is_external and not has_call(func):
                cost = 0.0
            else:
                rec = self.db.get(name, backend.version(), key, self.device)
                if rec is None or rec.retry:
                    continue
                cost = rec.cost_ms
                self.hits += 1
            for c in cands:
                out[c] = cost
                self._func_of[c] = (key, func)
                best[c.nodes] = min(cost, best.get(c.nodes, math.inf))
        return out

    def prebuild(self, keys: list, by_key: dict, backends: dict) -> None:
        """Build the candidates of ``keys`` ahead in ``build_jobs`` processes
        (``builds.prebuild``)."""
        builds.prebuild(self, keys, by_key, backends)

    def _second_pass(self, keys: list, by_key: dict, backends: dict) -> dict:
        """Re-time ``keys`` (in the order given) and keep each one's lower time in the DB;
        returns {key: lower ms}."""
        out: dict = {}
        t0 = time.perf_counter()
        bar = progress_bar(len(keys), self.progress, "library candidates, second pass")
        for bk in keys:
            backend = backends[bk[0]]
            func, cands = by_key[bk]
            rec = self.db.get(backend.name, backend.version(), bk[1], self.device)
            cost, reason, extra = self._measure(backend, func, None, bk[1])
            bar.update(1)
            if rec is None or not math.isfinite(cost) or cost >= rec.cost_ms:
                continue
            self.db.put(backend.name, backend.version(), bk[1], self.device, cost, None,
                        {**rec.extra, "passes": [rec.cost_ms, cost],
                         **{k: v for k, v in extra.items() if k != "traceback"}})
            out[bk] = cost
        bar.close()
        self.seconds["second pass"] += time.perf_counter() - t0
        return out

    def identity(self, cand) -> tuple | None:
        """(backend, DB key) of a candidate ``costs`` measured, else None."""
        found = self._func_of.get(cand)
        return (cand.backend, found[0]) if found is not None else None

    def retime_side_by_side(self, sets: list, backends: dict,
                            budget_s: float | None = None) -> list:
        """Time each set of candidates (all measured by ``costs``) side by side in one
        process, in alternating rounds, so drift between two measurements no longer decides
        (``side_by_side.retime``). Returns one ``{identity: ms}`` per set timed."""
        return side_by_side.retime(self, sets, backends, budget_s)
