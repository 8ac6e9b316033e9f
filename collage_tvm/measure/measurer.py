"""Cost of every distinct candidate: cost DB first, then measurement (paper §4.1)."""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pickle
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import tvm
from tvm import relax

from ..graph import DataflowGraph
from ..graph.subgraph import (PART_ATTR, constant_bytes, extract_function, function_key,
                              one_op_function, without_weights)
from ..candidates import generate_candidates
from ..target import cache_bytes, device_fingerprint, host_cores
from . import runner
from .db import CostDB
from .worker import WorkerPool, _message, new_owner, shared_worker

logger = logging.getLogger("collage_tvm")

EPSILON_KEY = "__epsilon__"
# The suffix of a candidate's key when it is timed with cold caches. "|cold2": since the
# flush runs on every core (``timing._Flush``); costs after TVM's own flush ("|cold") ran
# higher (ViT-B/16's OpenVINO region 238 ms against 162) and are not mixed with these.
COLD_KEY = "|cold2"
WHOLE_KEY = "|whole"  # the suffix of a candidate's key when it is the whole model
# The cost model's revision, part of the placement-log key (``build.placement_key``): a
# placement searched on costs the measurer no longer gives is searched again (most of its
# costs come back from the DB). "cold": large candidates timed with cold caches (2026-11-25);
# "cold2": after a flush on every core (``COLD_KEY``, 2026-11-28); "cold2-look": a first
# run near the cutoff gets a second look (``timing.SECOND_LOOK_MS``) and the costs cut on
# such a run before are measured again (``timing.cut_before_second_look``), 2026-11-29.
COST_MODEL = "cold2-look"
SWITCH_KEY = "__switch__"
SIDE_KEY = "__side_by_side__"
# A lean search's verdict: which candidates it left unmeasured (``Measurer.keep_skipped``).
LEAN_KEY = "__lean__"


def probe_function(backend) -> relax.Function:
    """A tiny kernel whose time is the backend's per-call overhead (switching cost epsilon):
    the lowering's own ``probe()`` when it has one, else a 1-element ``add``."""
    low = backend.get_lowering()
    func = low.probe() if low is not None and hasattr(low, "probe") else None
    return func if func is not None else add_probe()


def switch_probes(variant: int = 0) -> list:
    """Kernels big enough to wake a runtime's thread pool (~0.05-0.3 ms on 2 cores), in
    order of preference: an elementwise op, a 3x3 convolution, a GEMM. ``variant`` widens
    the last input dimension, giving a second, distinct kernel of the same kind."""
    import numpy as np

    rng = np.random.default_rng(variant)
    v = variant

    def const(*shape):
        return relax.const(rng.standard_normal(shape).astype("float32"))

    return [
        one_op_function((1, 64, 56, 56 + v), relax.op.nn.relu),
        one_op_function((1, 32, 28, 28 + v),
                        lambda x: relax.op.nn.conv2d(x, const(32, 32, 3, 3), padding=1)),
        one_op_function((64 + v, 256), lambda x: relax.op.matmul(x, const(256, 256))),
    ]


def switch_probe(backend, variant: int = 0) -> relax.Function | None:
    """The first of ``switch_probes(variant)`` that ``backend``'s patterns run as one kernel."""
    for func in switch_probes(variant):
        graph = DataflowGraph(func)
        whole = frozenset(range(len(graph)))
        if any(c.nodes == whole for c in generate_candidates(graph, [backend])):
            return func
    return None


def add_probe() -> relax.Function:
    """The default probe: a 1-element ``add``."""
    return one_op_function((1,), lambda x: relax.op.add(x, x))


def _has_call(func: relax.Function) -> bool:
    """Whether ``func`` computes anything (a Call); else it only moves values around."""
    return any(isinstance(b.value, relax.Call) for block in func.body.blocks
               for b in block.bindings)


def _reason(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip()[:400]}"


def _function_json(func) -> str:
    """``func`` as a measuring or build process receives it: JSON, its large weights left
    here (random ones of the same shapes and scales stand in there: ``without_weights``)."""
    return tvm.ir.save_json(tvm.IRModule({"main": without_weights(func)}))


def target_json(target) -> str:
    """``target`` as a measuring process (a child, an RPC server) receives it."""
    return json.dumps(dict(target.export()), default=list)


def _prebuilds(backend) -> bool:
    """Whether build processes build ``backend``'s candidates: TVM's (exported), and a
    library's whose builds leave a cache on disk (``Lowering.build_cache``)."""
    if not backend.is_external:
        return True
    try:
        return bool(getattr(backend.get_lowering(), "build_cache", False))
    except Exception:  # noqa: BLE001 - an unresolvable lowering fails where it is timed
        return False


def default_build_jobs(target) -> int:
    """Build processes for ``Measurer.prebuild`` when the user names none: one per core (at
    most 16) on a GPU target, where a candidate's build (TVM's passes, then NVRTC) is most
    of measuring it, and on a CPU of 8 cores and more; none on a smaller CPU, where the
    export each build process adds (a C link, ~50 ms) leaves little gain (2 vCPUs: 23.0 s
    against 25.5 s for 187 candidates of resnet_small)."""
    cores = host_cores()
    if target.kind.name == "cuda" or cores >= 8:
        return min(cores, 16)
    return 0


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
        closes it."""
        self.target = target
        self.build_vm = build_vm
        self.db = db
        self.isolate = isolate
        self.progress = progress
        self.cutoff_factor = cutoff_factor
        self.remote = remote
        self.device = remote.device if remote is not None else device_fingerprint(target)
        self.target_json = target_json(target)
        self.build_jobs = max(0, int(build_jobs)) if remote is None else 0
        self._remote_done: dict = {}  # (backend, key) -> reply measured by ``_measure_remote``
        # Written through the caches before a cold timing (``costs``): twice the last level.
        self.flush_bytes = 2 * cache_bytes(3) if target.kind.name != "cuda" else 0
        self._prebuilt = os.path.join(tempfile.gettempdir(),
                                      f"collage-builds-{os.getpid()}-{id(self):x}")
        # The process's measuring child, shared with every other measurer (its caches are
        # emptied when another measurer's request reaches it); ``_context`` names this one.
        self._worker = shared_worker() if isolate and remote is None else None
        self._owner = new_owner()
        if not isolate:
            runner.clear_cache()  # builds of an earlier search may apply other tuning
        self.measured = 0
        self.hits = 0
        self.failures: list = []  # (backend, label, reason)
        self.retried = 0  # earlier failures of the moment measured again (``CostRecord.retry``)
        self._can_pickle: dict = {}
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
        jobs = default_build_jobs(target) if options.build_jobs is None else options.build_jobs
        return cls(target, db, build_vm, isolate=options.isolate,
                   progress=options.progress if progress is None else progress,
                   tuning=tuning, build_jobs=jobs, remote=remote)

    def _context(self) -> dict:
        """Who asks, for the measuring child (``worker._message``): this measurer's token
        and its build processes' folder (while none built, nothing is found there)."""
        return {"owner": self._owner, "prebuilt": self._prebuilt}

    def close(self) -> None:
        if self._worker is not None:
            if self._worker.alive():  # the child stays; what it built for this one goes
                self._worker.call("release", [], self.target_json, None, context=self._context())
        else:
            runner.clear_cache()
            runner.use_prebuilt(None)
        shutil.rmtree(self._prebuilt, ignore_errors=True)

    def _picklable(self, backend) -> bool:
        """Whether ``backend``'s lowering can travel to the worker (checked once per backend)."""
        if backend.name not in self._can_pickle:
            try:
                pickle.dumps(backend.lowering)
                self._can_pickle[backend.name] = True
            except Exception:  # noqa: BLE001 - any pickling failure means "measure here"
                logger.info("backend %s has an unpicklable lowering: measuring in-process",
                            backend.name)
                self._can_pickle[backend.name] = False
        return self._can_pickle[backend.name]

    def _run(self, what: str, items: list, *extra) -> tuple:
        """``runner.<what>`` on ``[(backend, func, key), ...]``: in the worker when every
        backend's lowering pickles, else here; any exception is an infinite cost with its
        reason, never a failed search. ``key``: the candidate's DB key, under which the
        process that measures keeps the built candidate for the next time (the second pass,
        side-by-side re-timing); functions under one key differ at most in their weights'
        values, which do not change their time."""
        if self.remote is not None:
            unsent = sorted({b.name for b, _, _ in items if not self._picklable(b)})
            if unsent:
                return math.inf, (f"{', '.join(unsent)}: its lowering does not pickle, so it "
                                  "cannot be sent to an RPC server"), {}
            entries = [(b, _function_json(f), k) for b, f, k in items]
            return self.remote.call(_message(what, entries, self.target_json, self.build_vm,
                                             extra, {"owner": self._owner}))
        if self._worker is not None and all(self._picklable(b) for b, _, _ in items):
            # The weights stay here: the worker times the kernel on random ones of the same
            # shapes and scales (``without_weights``); a model's gigabytes are not copied.
            entries = [(b, _function_json(f), k) for b, f, k in items]
            return self._worker.call(what, entries, self.target_json, self.build_vm, *extra,
                                     context=self._context())
        try:
            return getattr(runner, what)([(f, b, k) for b, f, k in items], self.target,
                                         self.build_vm, *extra)
        except Exception as err:  # noqa: BLE001 - a failure is a cost of inf with a reason
            return math.inf, _reason(err), {}

    def _flush_for(self, keys) -> int:
        """Bytes to flush before each timed call of candidates under ``keys``: the
        measurer's flush size when any was costed cold (``COLD_KEY``), else 0."""
        return self.flush_bytes if any(k and k.endswith(COLD_KEY) for k in keys) else 0

    def _measure(self, backend, func, cutoff_ms, key=None) -> tuple:
        return self._run("measure_function", [(backend, func, key)], cutoff_ms,
                         self._flush_for([key]))

    def _lookup_or_measure(self, backend, key, func, label, cutoff_ms=None) -> float:
        done = self._remote_done.pop((backend.name, key), None)
        return self._cached(backend.name, backend.version(), key, label,
                            (lambda: done) if done is not None else
                            (lambda: self._measure(backend, func, cutoff_ms, key)))

    def _cached(self, name: str, version: str, key: str, label: str, measure) -> float:
        """The DB's cost for (name, version, key, device), else ``measure()`` -> (cost,
        reason, extra), stored; a failure (inf) is recorded with its reason."""
        rec = self.db.get(name, version, key, self.device)
        if rec is not None and not rec.retry:
            self.hits += 1
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
        kept = {"label": label, **{k: v for k, v in extra.items() if k != "traceback"}}
        if rec is not None and math.isinf(cost):
            kept["retried"] = True  # failed twice: it stays a failure
        self.db.put(name, version, key, self.device, cost, reason, kept)
        return cost

    def epsilon(self, backends) -> dict:
        """Measured per-kernel switching cost of each backend (ms)."""
        return {b.name: max(0.0, self._lookup_or_measure(
            b, EPSILON_KEY, probe_function(b), "epsilon-probe")) for b in backends}

    def switch_costs(self, backends) -> dict:
        """``(a, b) -> ms``: measured cost of running a kernel of ``b`` right after one of
        ``a`` (thread pools of two runtimes waking and competing), for every pair.

        Each backend runs its ``switch_probe``; a pair is timed alternating against each
        alone (``runner.time_switch``), once per device and library versions (cost DB).
        ``(a, a)`` is measured for graph libraries: each of their kernels is a session of its
        own (own threads, own state), so two different ones in a row can cost more than one
        repeated; op libraries share one runtime per process and pay nothing there.
        A pair that cannot be measured counts as 0 (the additive model) with a logged reason.
        """
        backends = sorted(backends, key=lambda b: b.name)
        probes = {b.name: switch_probe(b) for b in backends}
        out: dict = {}
        for i, a in enumerate(backends):
            for b in backends[i:]:
                if probes[a.name] is None or probes[b.name] is None:
                    continue
                probe_b = probes[b.name]
                if a is b:
                    if a.kind != "graph":
                        continue
                    probe_b = switch_probe(a, variant=1)
                cost = self._cached(
                    a.name, f"{a.version()}|{b.version()}", f"{SWITCH_KEY}:{b.name}",
                    f"switch {a.name}<->{b.name}",
                    lambda a=a, b=b, pb=probe_b: self._measure_switch(a, probes[a.name], b, pb))
                if math.isfinite(cost):
                    out[(a.name, b.name)] = cost
        return out

    def _measure_side_by_side(self, items: list) -> tuple:
        return self._run("measure_side_by_side", items, self._flush_for([k for _, _, k in items]))

    def _measure_switch(self, a, func_a, b, func_b) -> tuple:
        return self._run("measure_switch", [(a, func_a, None), (b, func_b, None)])

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
            self.prebuild([bk for bk in order if _has_call(by_key[bk][0])
                           and _prebuilds(backends[bk[0]])], by_key, backends)
        if self.remote is not None:
            self._measure_remote(order, by_key, backends)
        best_for_nodes = self._on(graph).best
        costs: dict = {}
        fresh: list = []  # (bk, cutoff) of library candidates measured (not from the DB) now
        bar = _progress(len(order), self.progress)
        for bk in order:
            backend = backends[bk[0]]
            func, cands = by_key[bk]
            known = [best_for_nodes[c.nodes] for c in cands if c.nodes in best_for_nodes]
            known += [cutoffs[c] / self.cutoff_factor for c in cands if c in (cutoffs or {})]
            cutoff = self.cutoff_factor * min(known) if known else None
            before = self.measured
            if not backend.is_external and not _has_call(func):
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
        """The identities (``identities``) a lean search over these same candidates, with
        the parameters ``tag``, left unmeasured, as the cost DB keeps them (``keep_skipped``);
        None when it keeps no such verdict."""
        rec = self.db.get(*self._lean_key(graph, candidates, backends, tag), self.device)
        if rec is None or not isinstance(rec.extra.get("skipped"), list):
            return None
        return {tuple(x) for x in rec.extra["skipped"]}

    def keep_skipped(self, graph, candidates, backends: dict, skipped: set, lower_ms: float,
                     tag: str = "") -> None:
        """Keep a lean search's verdict in the cost DB: the identities it left unmeasured
        (``skipped``) and its floors' bound (``lower_ms``). The next search over the same
        candidates and DB takes it rather than asking the DP again on floors that the
        costs measured since (carved regions, a later stage's) may have lowered."""
        name, version, key = self._lean_key(graph, candidates, backends, tag)
        self.db.put(name, version, key, self.device,
                    lower_ms if math.isfinite(lower_ms) else 0.0, None,
                    {"label": "lean search", "skipped": sorted(list(x) for x in skipped)})

    def _lean_key(self, graph, candidates, backends: dict, tag: str) -> tuple:
        """(backend, version, key) of the lean verdict over ``candidates``."""
        idents = sorted(set(self.identities(graph, candidates, backends).values()))
        names = sorted({name for name, _ in idents})
        digest = hashlib.sha1("|".join([tag, *(f"{n}:{k}" for n, k in idents)]).encode())
        return ("+".join(names), "+".join(backends[n].version() for n in names),
                f"{LEAN_KEY}:{digest.hexdigest()}")

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
            if not backend.is_external and not _has_call(func):
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
        """Build the candidates of ``keys`` ((backend, DB key) pairs) the DB does not
        answer, in ``build_jobs`` processes side by side, for the measuring process to load
        rather than build (``runner.prebuild``; a library's with a ``build_cache``: built
        and run once, so that its cache holds them). Worth it where a build is long beside its
        timing: on a GPU (NVRTC), or with more cores than a timing needs. A failed build is
        left to the measuring process, which builds it again and records why it fails."""
        keys = [bk for bk in keys if self.db.get(bk[0], backends[bk[0]].version(), bk[1],
                                                 self.device) is None]
        keys = [bk for bk in keys if not backends[bk[0]].is_external
                or self._picklable(backends[bk[0]])]
        jobs = min(self.build_jobs, len(keys) // 2)  # a process costs a start: two builds each
        if jobs < 1 or not runner.can_prebuild(self.build_vm):
            return
        t0 = time.perf_counter()
        os.makedirs(self._prebuilt, exist_ok=True)
        if self._worker is None:
            runner.use_prebuilt(self._prebuilt)
        requests = [[(backends[bk[0]], _function_json(by_key[bk][0]), bk[1])] for bk in keys]
        # The cores shared out: torch.compile would start a pool of a process per core in
        # every build process.
        threads = str(max(1, host_cores() // jobs))
        pool = WorkerPool(jobs, env={"TORCHINDUCTOR_COMPILE_THREADS": threads})
        bar = _progress(len(keys), self.progress, f"building candidates ({jobs} processes)")
        failed = 0
        try:
            for _, (cost, _reason, _extra) in pool.map("prebuild", requests, self.target_json,
                                                        self.build_vm, self._prebuilt):
                failed += math.isinf(cost)
                bar.update(1)
        finally:
            pool.close()
            bar.close()
        self.prebuilt += len(keys) - failed
        self.seconds["parallel builds"] += time.perf_counter() - t0
        logger.info("built %d candidates in %d processes in %.1f s (%d failed: built "
                    "again where they are timed)", len(keys), jobs, time.perf_counter() - t0,
                    failed)

    def _measure_remote(self, order: list, by_key: dict, backends: dict) -> None:
        """The DB's misses among ``order`` measured on every RPC server at once: the
        libraries' first, then TVM's with the cutoffs their times give (as ``costs`` sets
        them). The replies wait in ``_remote_done`` for ``costs``, which stores them as it
        would its own measurements."""
        best: dict = {}
        for external in (True, False):
            todo, messages = [], []
            for bk in order:
                backend = backends[bk[0]]
                func, cands = by_key[bk]
                if backend.is_external != external or not _has_call(func) \
                        or not self._picklable(backend):
                    continue
                rec = self.db.get(backend.name, backend.version(), bk[1], self.device)
                if rec is not None and not rec.retry:
                    for c in cands:
                        best[c.nodes] = min(rec.cost_ms, best.get(c.nodes, math.inf))
                    continue
                known = [best[c.nodes] for c in cands if c.nodes in best]
                cutoff = self.cutoff_factor * min(known) if known else None
                todo.append(bk)
                messages.append(_message("measure_function", [(backend, _function_json(func),
                                                              bk[1])], self.target_json,
                                         self.build_vm, (cutoff, self._flush_for([bk[1]])),
                                         {"owner": self._owner}))
            if not todo:
                continue
            bar = _progress(len(todo), self.progress, f"measuring on {len(self.remote.sessions)} "
                            f"RPC server(s)")
            for i, reply in self.remote.map(messages):
                self._remote_done[todo[i]] = reply
                if math.isfinite(reply[0]):
                    for c in by_key[todo[i]][1]:
                        best[c.nodes] = min(reply[0], best.get(c.nodes, math.inf))
                bar.update(1)
            bar.close()

    def _second_pass(self, keys: list, by_key: dict, backends: dict) -> dict:
        """Re-time ``keys`` (in the order given) and keep each one's lower time in the DB;
        returns {key: lower ms}."""
        out: dict = {}
        t0 = time.perf_counter()
        bar = _progress(len(keys), self.progress, "library candidates, second pass")
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
        process, in alternating rounds, so drift between two measurements no longer decides.
        Returns one ``{identity: ms}`` per set timed (see ``fit_side_by_side``).

        Each set's times are kept in the cost DB (key ``__side_by_side__:<hash of its
        members>``) and reused by the next build. Once ``budget_s`` seconds have gone on
        re-timing, only sets the DB already holds are used; a set whose re-timing fails is
        left out (its candidates keep their first times)."""
        timed: list = []
        t_start, skipped = time.perf_counter(), 0
        bar = _progress(len(sets), self.progress, "re-timing close calls side by side")
        for members in sets:
            bar.update(1)
            entries = sorted({(c.backend, *self._func_of[c][:1]): (c.backend, *self._func_of[c])
                              for c in members}.values(), key=lambda e: (e[0], e[1]))
            names = sorted({name for name, _, _ in entries})
            backend = "+".join(names)
            version = "+".join(backends[n].version() for n in names)
            key = f"{SIDE_KEY}:" + hashlib.sha1("|".join(
                f"{name}:{k}" for name, k, _ in entries).encode()).hexdigest()
            rec = self.db.get(backend, version, key, self.device)
            if rec is not None and len(rec.extra.get("times", [])) == len(entries):
                self.hits += 1
                times = rec.extra["times"]
            elif budget_s is not None and time.perf_counter() - t_start > budget_s:
                skipped += 1
                continue
            else:
                times, reason, _ = self._measure_side_by_side(
                    [(backends[name], func, k) for name, k, func in entries])
                self.side_by_side += 1
                if not isinstance(times, list):
                    logger.info("side-by-side re-timing of %s failed: %s",
                                ", ".join(c.label or c.backend for c in members), reason)
                    continue
                times = [float(t) for t in times]
                if not all(math.isfinite(t) and t > 0 for t in times):
                    continue
                self.db.put(backend, version, key, self.device, sum(times), None,
                            {"label": "side-by-side", "times": times,
                             "members": [[name, k] for name, k, _ in entries]})
            timed.append({(name, k): t for (name, k, _), t in zip(entries, times)})
        bar.close()
        self.seconds["re-time"] += time.perf_counter() - t_start
        if skipped:
            logger.info("side-by-side re-timing: %d of %d close calls left on their first "
                        "times (the %.0f s budget went on the larger ones)", skipped, len(sets),
                        budget_s)
        return timed


class _LineStream:
    """tqdm's output for a log file or pipe: each refresh on a line of its own."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def _progress(total: int, enabled: bool, desc: str = "measuring candidates"):
    """A progress bar on a terminal; on a log file or pipe, a progress line every 30 s."""
    import sys

    from tqdm.auto import tqdm

    if enabled and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return tqdm(total=total, desc=desc, unit="cand", file=_LineStream(sys.stderr),
                    mininterval=30.0, ascii=True, ncols=100, leave=False)
    return tqdm(total=total, desc=desc, unit="cand", disable=None if enabled else True,
                leave=False, dynamic_ncols=True)


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
