"""Measure candidates in a child process, so a backend that crashes cannot kill the search.

The parent sends which measurement to run (``runner.ENTRY_POINTS``), the candidates as
(backend name, lowering spec, function JSON, cache key; large weights replaced by random
ones of their shapes and scales: ``graph.subgraph.without_weights``), the target JSON and
the ``build_vm`` callback; the child builds and times, and answers (cost_ms, reason,
extra). A dead child is an infinite cost with its exit status as the reason, and a fresh
child takes over.

Starting a child (a fresh Python importing TVM and the libraries) takes seconds, longer
than measuring a small model's few candidates: one child serves every measurer of the
process (``shared_worker``), search after search. Each request names the measurer it
comes from; a request from another measurer than the last first empties the child's
caches (its built candidates, its backends), so a search never times what an earlier one
built.
"""
from __future__ import annotations

import atexit
import itertools
import math
import os
import pickle
import select
import subprocess
import sys
import threading
import time
import traceback

from ..registry import Backend

_TIMEOUT_S = 300.0
# A later stage's work run where the measuring runs (``runner.run_callback``: the final
# check of a search for another device, on an RPC server) builds and times whole models.
CALLBACK_TIMEOUT_S = 3600.0


def _serve() -> None:
    """Child main loop: pickled requests on stdin, pickled replies on the saved stdout.

    A request is ``(entry point, [(backend name, lowering, function JSON, cache key), ...],
    target JSON, build_vm, extra args, context)``; the entry point is one of
    ``runner.ENTRY_POINTS``; the context (``_message``) names the measurer asking and the
    folder its build processes export into."""
    import json

    import tvm

    from .._memory import release_memory
    from ..graph.subgraph import with_stand_ins
    from . import runner

    trim_above = _default_rss_limit() // 2

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # library chatter goes to stderr, never into the reply stream
    inp = sys.stdin.buffer
    backends: dict = {}
    owner = None
    while True:
        try:
            msg = pickle.load(inp)
        except EOFError:
            return
        if msg is None:
            return
        try:
            what, entries, target_json, build_vm, extra, context = msg
            if what not in runner.ENTRY_POINTS:
                raise ValueError(f"unknown measurement {what!r}")
            if context.get("owner") != owner:  # another measurer: nothing of the last kept
                runner.clear_cache(everything=True)
                backends.clear()
                owner = context.get("owner")
            runner.use_prebuilt(context.get("prebuilt"))
            target = tvm.target.Target(json.loads(target_json))
            funcs = []
            for name, lowering, func_json, key in entries:
                if name not in backends:
                    backends[name] = Backend(name=name, lowering=lowering)
                funcs.append((None if func_json is None else
                              with_stand_ins(tvm.ir.load_json(func_json)["main"]),
                              backends[name], key))
            reply = ("ok",) + tuple(getattr(runner, what)(funcs, target, build_vm, *extra))
        except BaseException as err:  # any failure is a cost of inf with a reason
            tb = traceback.format_exc(limit=3)
            reply = ("err", f"{type(err).__name__}: {str(err).strip()[:400]}", tb[-800:])
        if _rss(os.getpid()) > trim_above:  # freed heap back first: fewer restarts
            release_memory()
        pickle.dump(reply, out)
        out.flush()


def _default_rss_limit() -> int:
    """A quarter of the machine's memory, at least 4 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 16 << 30
    return max(4 << 30, total // 4)


def _rss(pid: int) -> int:
    """Resident memory of process ``pid`` in bytes (0 when it cannot be read)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Worker:
    """One child process (``python -m collage_tvm.measure.worker``); restarted when it dies,
    and after a request that leaves it holding more than ``rss_limit`` bytes: each
    candidate arrives with its weights (AlexNet's 150 MB fully connected layer in every
    candidate around it), and a child measuring AlexNet's candidates was seen holding 9 GB
    (why it keeps that much is not known yet). A fresh child takes over."""

    def __init__(self, timeout_s: float = _TIMEOUT_S, rss_limit: int | None = None,
                 env: dict | None = None):
        """``env``: variables the child gets beside this process's."""
        self.timeout_s = timeout_s
        self.env = dict(env or {})
        self.rss_limit = _default_rss_limit() if rss_limit is None else rss_limit
        self.restarts = 0  # for memory
        self._proc = None
        self._lock = threading.Lock()  # one request at a time on the pipe (``shared_worker``)

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "collage_tvm.measure.worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, **self.env, "PYTHONPATH": os.pathsep.join(
                p for p in [_package_root(), os.environ.get("PYTHONPATH", "")] if p)})

    def call(self, what: str, entries: list, target_json: str, build_vm, *extra,
             context: dict | None = None) -> tuple:
        """(cost, reason, extra) of ``runner.<what>`` on ``[(backend, func_json, key), ...]``
        in the child; cost is inf when the build or the child failed. ``context``: as
        ``_message`` takes it."""
        return self._ask(_message(what, entries, target_json, build_vm, extra, context))

    def _ask(self, msg) -> tuple:
        with self._lock:
            failed = self._send(msg)
            if failed is not None:
                return failed
            ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout_s)
            return self._receive() if ready else self._timed_out()

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _timed_out(self) -> tuple:
        """The reply for a request the child did not answer in time: the child killed."""
        self._kill()
        return math.inf, f"timed out after {self.timeout_s:.0f} s", {}

    def _send(self, msg) -> tuple | None:
        """Hand ``msg`` to the child (started if need be); a failure's reply, else None."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        try:
            pickle.dump(msg, self._proc.stdin)
            self._proc.stdin.flush()
        except (BrokenPipeError, ConnectionResetError, OSError):
            return self._died()
        return None

    def _receive(self) -> tuple:
        """The child's reply to the last message (its stdout is readable)."""
        try:
            reply = pickle.load(self._proc.stdout)
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError, pickle.UnpicklingError):
            return self._died()
        if _rss(self._proc.pid) > self.rss_limit:
            self.close()
            self.restarts += 1
        if reply[0] == "ok":
            return reply[1], reply[2], reply[3]
        return math.inf, reply[1], {"traceback": reply[2]}

    def _died(self) -> tuple:
        """The reply for a child whose pipe broke: its exit status, the child gone."""
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            pass  # its pipe is gone but it lingers (a large heap being freed): killed below
        code = self._proc.returncode
        self._kill()
        return math.inf, f"measurement process died ({_describe(code)})", {}

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()  # SIGKILL cannot be ignored; freeing gigabytes may take seconds
        self._proc = None

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                pickle.dump(None, self._proc.stdin)
                self._proc.stdin.close()
                self._proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()


class WorkerPool:
    """``jobs`` children answering requests side by side (``map``): the build processes of
    ``Measurer.prebuild``. Each request runs in whichever child is free; a child that dies
    or times out answers that request with an infinite cost and is restarted."""

    def __init__(self, jobs: int, timeout_s: float = _TIMEOUT_S, env: dict | None = None):
        if jobs < 1:
            raise ValueError(f"a worker pool needs at least one process, got {jobs}")
        self.timeout_s = timeout_s
        self.workers = [Worker(timeout_s, env=env) for _ in range(jobs)]

    def map(self, what: str, requests: list, target_json: str, build_vm, *extra):
        """Yields ``(index, (cost, reason, extra))`` for each request, as they finish; a
        request is ``[(backend, func_json, key), ...]`` as ``Worker.call`` takes it."""
        todo = list(enumerate(requests))[::-1]
        busy: dict = {}  # worker -> (index, deadline)
        free = list(self.workers)
        while todo or busy:
            while todo and free:
                w = free.pop()
                i, entries = todo.pop()
                failed = w._send(_message(what, entries, target_json, build_vm, extra))
                if failed is not None:
                    free.append(w)
                    yield i, failed
                    continue
                busy[w] = (i, time.monotonic() + self.timeout_s)
            if not busy:
                continue
            wait = max(0.0, min(d for _, d in busy.values()) - time.monotonic())
            ready, _, _ = select.select([w._proc.stdout for w in busy], [], [], wait)
            for w in list(busy):
                i, deadline = busy[w]
                if w._proc.stdout in ready:
                    reply = w._receive()
                elif time.monotonic() >= deadline:
                    reply = w._timed_out()
                else:
                    continue
                del busy[w]
                free.append(w)
                yield i, reply

    def close(self) -> None:
        for w in self.workers:
            w.close()


def _message(what: str, entries: list, target_json: str, build_vm, extra: tuple,
             context: dict | None = None) -> tuple:
    """The request a child reads (``_serve``): backends travel as (name, lowering spec).
    ``context``: ``owner``, a token of the measurer asking (``new_owner``; None: no one's),
    and ``prebuilt``, the folder its build processes export into (``runner.prebuild``)."""
    return (what, [(b.name, b.lowering, j, k) for b, j, k in entries], target_json, build_vm,
            extra, dict(context or {}))


_owners = itertools.count()


def new_owner() -> str:
    """A token no other measurer of any process has (``_message``'s context)."""
    return f"{os.getpid()}-{next(_owners)}"


_shared: Worker | None = None
_shared_made: tuple | None = None  # (process id, environment) it was made in
_shared_lock = threading.Lock()


def shared_worker() -> Worker:
    """This process's measuring child, kept for every measurer after the first (started on
    its first request, closed when the process exits). A child started in another
    environment (``PYTHONPATH`` naming where a lowering is imported from, a library's
    variables) is replaced, as a child of its own per measurer always saw the variables of
    its time; a process forked from this one starts its own (the pipe to this one's child
    is not its to use)."""
    global _shared, _shared_made
    made = (os.getpid(), dict(os.environ))
    with _shared_lock:
        if _shared is None or _shared_made != made:
            if _shared is not None and _shared_made[0] == made[0]:
                _shared.close()
            _shared, _shared_made = Worker(), made
            atexit.register(_shared.close)
        return _shared


def _describe(code) -> str:
    if code is not None and code < 0:
        import signal

        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


if __name__ == "__main__":
    _serve()
