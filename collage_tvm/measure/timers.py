"""Where a candidate is timed: in this process, in the measuring child, or on RPC servers.

A ``Measurer`` picks one ``Timer`` when it is made (``choose``) and times everything through
it: ``run(what, items, *extra)`` runs ``runner.<what>`` on ``[(backend, func, key), ...]``
where the timer times, and answers (cost, reason, extra); any failure is an infinite cost
with its reason, never a failed search. ``key``: the candidate's DB key, under which the
process that times keeps the built candidate for the next time (the second pass,
side-by-side re-timing); functions under one key differ at most in their weights' values,
which do not change their time.

- ``InProcess`` (``isolate=False``): here; a library that crashes takes the search along.
- ``InChild``: in the process's measuring child (``worker.shared_worker``), the weights left
  here; a backend whose lowering does not pickle is timed here all the same.
- ``OnServers``: on the RPC servers of a ``remote.RemoteDevices``, the costs keyed by their
  device; a backend whose lowering does not pickle cannot be timed there. It times the
  cost DB's misses ahead, on every server at once (``ahead``).
"""
from __future__ import annotations

import json
import logging
import math
import pickle

import tvm
from tvm import relax

from ..graph.subgraph import without_weights
from ..target import device_fingerprint
from . import runner
from .progress import progress_bar
from .worker import _message, new_owner, shared_worker

logger = logging.getLogger("collage_tvm")


def target_json(target) -> str:
    """``target`` as a measuring process (a child, an RPC server) receives it."""
    return json.dumps(dict(target.export()), default=list)


def function_json(func) -> str:
    """``func`` as a measuring or build process receives it: JSON, its large weights left
    here (random ones of the same shapes and scales stand in there: ``without_weights``)."""
    return tvm.ir.save_json(tvm.IRModule({"main": without_weights(func)}))


def has_call(func: relax.Function) -> bool:
    """Whether ``func`` computes anything (a Call); else it only moves values around."""
    return any(isinstance(b.value, relax.Call) for block in func.body.blocks
               for b in block.bindings)


def failure_reason(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip()[:400]}"


class Timer:
    """How a measurer's candidates are timed (module docstring). ``prebuilt``: the folder
    the measurer's build processes export into (``builds.prebuild``)."""

    prebuilds = True  # whether build processes build for it

    def __init__(self, target, build_vm, device: str, prebuilt: str):
        self.target = target
        self.build_vm = build_vm
        self.device = device
        self.target_json = target_json(target)
        self.prebuilt = prebuilt
        # This measurer's token for the measuring process (``worker._message``): a request
        # from another measurer first empties the child's caches.
        self.owner = new_owner()
        self._can_pickle: dict = {}

    def context(self) -> dict:
        """Who asks, for the measuring child (``worker._message``): the measurer's token
        and its build processes' folder (while none built, nothing is found there)."""
        return {"owner": self.owner, "prebuilt": self.prebuilt}

    def picklable(self, backend) -> bool:
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

    def run(self, what: str, items: list, *extra) -> tuple:
        raise NotImplementedError

    def ahead(self, measurer, order: list, by_key: dict, backends: dict) -> None:
        """Time the cost DB's misses among ``order`` before ``Measurer.costs`` asks for them
        one by one (``measured_ahead``); here: nothing."""

    def measured_ahead(self, backend_name: str, key: str) -> tuple | None:
        """The reply ``ahead`` got for (backend, DB key), taken; None when it got none."""
        return None

    def use_prebuilt(self) -> None:
        """Take candidates from the build processes' folder where they are timed."""
        runner.use_prebuilt(self.prebuilt)

    def close(self) -> None:
        """Forget what this process kept for the measurer."""
        runner.clear_cache()
        runner.use_prebuilt(None)


class InProcess(Timer):
    """Timed in this process."""

    def run(self, what: str, items: list, *extra) -> tuple:
        try:
            return getattr(runner, what)([(f, b, k) for b, f, k in items], self.target,
                                         self.build_vm, *extra)
        except Exception as err:  # noqa: BLE001 - a failure is a cost of inf with a reason
            return math.inf, failure_reason(err), {}


class InChild(InProcess):
    """Timed in the process's measuring child, shared with every other measurer (its caches
    are emptied when another measurer's request reaches it); a backend whose lowering does
    not pickle, in this process."""

    def __init__(self, target, build_vm, device: str, prebuilt: str):
        super().__init__(target, build_vm, device, prebuilt)
        self.worker = shared_worker()

    def run(self, what: str, items: list, *extra) -> tuple:
        if not all(self.picklable(b) for b, _, _ in items):
            return super().run(what, items, *extra)
        # The weights stay here: the worker times the kernel on random ones of the same
        # shapes and scales (``without_weights``); a model's gigabytes are not copied.
        entries = [(b, function_json(f), k) for b, f, k in items]
        return self.worker.call(what, entries, self.target_json, self.build_vm, *extra,
                                context=self.context())

    def use_prebuilt(self) -> None:
        """Nothing here: the child learns the folder with each request (``context``)."""

    def close(self) -> None:
        if self.worker.alive():  # the child stays; what it built for this measurer goes
            self.worker.call("release", [], self.target_json, None, context=self.context())


class OnServers(Timer):
    """Timed on the RPC servers of ``remote`` (a ``remote.RemoteDevices``; its owner closes
    it), spread over them by ``ahead``."""

    prebuilds = False

    def __init__(self, target, build_vm, prebuilt: str, remote):
        super().__init__(target, build_vm, remote.device, prebuilt)
        self.remote = remote
        self._done: dict = {}  # (backend, key) -> reply measured by ``ahead``

    def run(self, what: str, items: list, *extra) -> tuple:
        unsent = sorted({b.name for b, _, _ in items if not self.picklable(b)})
        if unsent:
            return math.inf, (f"{', '.join(unsent)}: its lowering does not pickle, so it "
                              "cannot be sent to an RPC server"), {}
        entries = [(b, function_json(f), k) for b, f, k in items]
        return self.remote.call(_message(what, entries, self.target_json, self.build_vm,
                                         extra, {"owner": self.owner}))

    def measured_ahead(self, backend_name: str, key: str) -> tuple | None:
        return self._done.pop((backend_name, key), None)

    def ahead(self, measurer, order: list, by_key: dict, backends: dict) -> None:
        """The DB's misses among ``order`` measured on every RPC server at once: the
        libraries' first, then TVM's with the cutoffs their times give (as ``costs`` sets
        them). The replies wait in ``measured_ahead`` for ``costs``, which stores them as
        it would its own measurements."""
        best: dict = {}
        for external in (True, False):
            todo, messages = [], []
            for bk in order:
                backend = backends[bk[0]]
                func, cands = by_key[bk]
                if backend.is_external != external or not has_call(func) \
                        or not self.picklable(backend):
                    continue
                rec = measurer.db.get(backend.name, backend.version(), bk[1], self.device)
                if rec is not None and not rec.retry:
                    for c in cands:
                        best[c.nodes] = min(rec.cost_ms, best.get(c.nodes, math.inf))
                    continue
                known = [best[c.nodes] for c in cands if c.nodes in best]
                cutoff = measurer.cutoff_factor * min(known) if known else None
                todo.append(bk)
                messages.append(_message("measure_function", [(backend, function_json(func),
                                                              bk[1])], self.target_json,
                                         self.build_vm, (cutoff, measurer._flush_for([bk[1]])),
                                         {"owner": self.owner}))
            if not todo:
                continue
            bar = progress_bar(len(todo), measurer.progress, f"measuring on "
                               f"{len(self.remote.sessions)} RPC server(s)")
            for i, reply in self.remote.map(messages):
                self._done[todo[i]] = reply
                if math.isfinite(reply[0]):
                    for c in by_key[todo[i]][1]:
                        best[c.nodes] = min(reply[0], best.get(c.nodes, math.inf))
                bar.update(1)
            bar.close()


def choose(target, build_vm, prebuilt: str, isolate: bool, remote) -> Timer:
    """The one way a measurer times its candidates: on ``remote``'s servers when given, else
    in the measuring child when ``isolate``, else here."""
    if remote is not None:
        timer = OnServers(target, build_vm, prebuilt, remote)
    elif isolate:
        timer = InChild(target, build_vm, device_fingerprint(target), prebuilt)
    else:
        timer = InProcess(target, build_vm, device_fingerprint(target), prebuilt)
    if not isolate:
        runner.clear_cache()  # builds of an earlier search may apply other tuning
    return timer
