"""Cost of every distinct candidate: cost DB first, then measurement (paper §4.1)."""
from __future__ import annotations

import json
import logging
import math
import pickle

import tvm
from tvm import relax

from ..graph.subgraph import extract_function, function_key
from ..target import device_fingerprint
from .db import CostDB
from .runner import measure_function
from .worker import Worker

logger = logging.getLogger("collage_tvm")

EPSILON_KEY = "__epsilon__"


def probe_function(backend) -> relax.Function:
    """A tiny kernel whose time is the backend's per-call overhead (switching cost epsilon)."""
    low = backend.get_lowering()
    if low is not None and hasattr(low, "probe"):
        return low.probe()
    return add_probe()


def add_probe() -> relax.Function:
    """The default probe: a 1-element ``add``."""
    x = relax.Var("x", relax.TensorType((1,), "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit_output(relax.op.add(x, x))
        bb.emit_func_output(y)
    return bb.get()["main"]


class Measurer:
    """Looks costs up in ``db`` and measures the misses (in a child process when ``isolate``)."""

    def __init__(self, target, db: CostDB, isolate: bool = True, progress: bool = True,
                 cutoff_factor: float = 4.0):
        self.target = target
        self.db = db
        self.isolate = isolate
        self.progress = progress
        self.cutoff_factor = cutoff_factor
        self.device = device_fingerprint(target)
        self.target_json = json.dumps(dict(target.export()), default=list)
        self._worker = Worker() if isolate else None
        self.measured = 0
        self.hits = 0
        self.failures: list = []  # (backend, label, reason)
        self._can_pickle: dict = {}

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()

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

    def _measure(self, backend, func, cutoff_ms) -> tuple:
        if self._worker is not None:
            if self._picklable(backend):
                mod_json = tvm.ir.save_json(tvm.IRModule({"main": func}))
                return self._worker.measure(backend, mod_json, self.target_json, cutoff_ms)
        try:
            return measure_function(func, backend, self.target, cutoff_ms)
        except Exception as err:
            return math.inf, f"{type(err).__name__}: {str(err).strip()[:400]}", {}

    def _lookup_or_measure(self, backend, key, func, label, cutoff_ms=None) -> float:
        version = backend.version()
        rec = self.db.get(backend.name, version, key, self.device)
        if rec is not None:
            self.hits += 1
            return rec.cost_ms
        cost, reason, extra = self._measure(backend, func, cutoff_ms)
        self.measured += 1
        if math.isinf(cost):
            self.failures.append((backend.name, label, reason))
            logger.info("%s %s failed: %s", backend.name, label, reason)
        self.db.put(backend.name, version, key, self.device, cost, reason,
                    {"label": label, **{k: v for k, v in extra.items() if k != "traceback"}})
        return cost

    def epsilon(self, backends) -> dict:
        """Measured per-kernel switching cost of each backend (ms)."""
        return {b.name: max(0.0, self._lookup_or_measure(
            b, EPSILON_KEY, probe_function(b), "epsilon-probe")) for b in backends}

    def costs(self, graph, candidates, backends: dict) -> dict:
        """Measured cost (ms, inf when failed) of every candidate."""
        by_key: dict = {}
        for cand in candidates:
            func = extract_function(graph, cand.nodes)[0]
            by_key.setdefault((cand.backend, function_key(func)), (func, []))[1].append(cand)
        # External libraries first (fast): their times give the cutoff for slow TVM candidates.
        order = sorted(by_key, key=lambda bk: (not backends[bk[0]].is_external,
                                               min(len(c.nodes) for c in by_key[bk][1])))
        best_for_nodes: dict = {}
        costs: dict = {}
        bar = _progress(len(order), self.progress)
        for bk in order:
            backend = backends[bk[0]]
            func, cands = by_key[bk]
            known = [best_for_nodes[c.nodes] for c in cands if c.nodes in best_for_nodes]
            cutoff = self.cutoff_factor * min(known) if known else None
            cost = self._lookup_or_measure(backend, bk[1], func, cands[0].label, cutoff)
            for c in cands:
                costs[c] = cost
                best_for_nodes[c.nodes] = min(cost, best_for_nodes.get(c.nodes, math.inf))
            bar.set_postfix_str(f"measured {self.measured}, cached {self.hits}")
            bar.update(1)
        bar.close()
        return costs


def _progress(total: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="measuring candidates", unit="cand", disable=None if enabled else True,
                leave=False, dynamic_ncols=True)
