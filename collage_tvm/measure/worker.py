"""Measure candidates in a child process, so a backend that crashes cannot kill the search.

The parent sends (backend name, lowering spec, function JSON, target JSON, cutoff); the child
builds and times, and answers (cost_ms, reason, extra). A dead child is an infinite cost with
its exit status as the reason, and a fresh child takes over.
"""
from __future__ import annotations

import math
import os
import pickle
import select
import subprocess
import sys
import traceback

from ..registry import Backend

_TIMEOUT_S = 300.0


def _serve() -> None:
    """Child main loop: pickled requests on stdin, pickled replies on the saved stdout."""
    import json

    import tvm

    from .runner import measure_function, measure_side_by_side, measure_switch

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # library chatter goes to stderr, never into the reply stream
    inp = sys.stdin.buffer
    backends: dict = {}
    while True:
        try:
            msg = pickle.load(inp)
        except EOFError:
            return
        if msg is None:
            return
        try:
            if msg[0] == "__switch__":  # ("__switch__", (name, lowering, func_json) x 2, target_json)
                _, *pair, target_json = msg
                target = tvm.target.Target(json.loads(target_json))
                args = []
                for name, lowering, func_json in pair:
                    if name not in backends:
                        backends[name] = Backend(name=name, lowering=lowering)
                    args += [tvm.ir.load_json(func_json)["main"], backends[name]]
                reply = ("ok",) + tuple(measure_switch(*args, target))
            elif msg[0] == "__side_by_side__":  # (tag, [(name, lowering, func_json)], target_json)
                _, entries, target_json = msg
                target = tvm.target.Target(json.loads(target_json))
                funcs = []
                for name, lowering, func_json in entries:
                    if name not in backends:
                        backends[name] = Backend(name=name, lowering=lowering)
                    funcs.append((tvm.ir.load_json(func_json)["main"], backends[name]))
                reply = ("ok",) + tuple(measure_side_by_side(funcs, target))
            else:
                name, lowering, func_json, target_json, cutoff_ms = msg
                if name not in backends:
                    backends[name] = Backend(name=name, lowering=lowering)
                func = tvm.ir.load_json(func_json)["main"]
                target = tvm.target.Target(json.loads(target_json))
                reply = ("ok",) + tuple(measure_function(func, backends[name], target, cutoff_ms))
        except BaseException as err:  # any failure is a cost of inf with a reason
            tb = traceback.format_exc(limit=3)
            reply = ("err", f"{type(err).__name__}: {str(err).strip()[:400]}", tb[-800:])
        pickle.dump(reply, out)
        out.flush()


class Worker:
    """One child process (``python -m collage_tvm.measure.worker``); restarted when it dies."""

    def __init__(self, timeout_s: float = _TIMEOUT_S):
        self.timeout_s = timeout_s
        self._proc = None

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "collage_tvm.measure.worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(
                p for p in [_package_root(), os.environ.get("PYTHONPATH", "")] if p)})

    def measure(self, backend, func_json: str, target_json: str, cutoff_ms) -> tuple:
        """(cost_ms, reason, extra); cost is inf when the build or the child failed."""
        return self._ask((backend.name, backend.lowering, func_json, target_json, cutoff_ms))

    def measure_switch(self, backend_a, json_a: str, backend_b, json_b: str,
                       target_json: str) -> tuple:
        """(switch_ms, reason, extra) between two backends' probe kernels (inf on failure)."""
        return self._ask(("__switch__", (backend_a.name, backend_a.lowering, json_a),
                          (backend_b.name, backend_b.lowering, json_b), target_json))

    def measure_side_by_side(self, entries: list, target_json: str) -> tuple:
        """([ms, ...], reason, extra) of ``[(backend, func_json), ...]`` timed in alternating
        rounds (inf on failure)."""
        return self._ask(("__side_by_side__", [(b.name, b.lowering, j) for b, j in entries],
                          target_json))

    def _ask(self, msg) -> tuple:
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        try:
            pickle.dump(msg, self._proc.stdin)
            self._proc.stdin.flush()
            ready, _, _ = select.select([self._proc.stdout], [], [], self.timeout_s)
            if not ready:
                self._kill()
                return math.inf, f"timed out after {self.timeout_s:.0f} s", {}
            reply = pickle.load(self._proc.stdout)
        except (EOFError, BrokenPipeError, ConnectionResetError, OSError, pickle.UnpicklingError):
            self._proc.wait(5)
            code = self._proc.returncode
            self._kill()
            return math.inf, f"measurement process died ({_describe(code)})", {}
        if reply[0] == "ok":
            return reply[1], reply[2], reply[3]
        return math.inf, reply[1], {"traceback": reply[2]}

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(5)
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


def _describe(code) -> str:
    if code is not None and code < 0:
        import signal

        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


if __name__ == "__main__":
    _serve()
