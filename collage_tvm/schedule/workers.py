"""Threads that run a concurrent stage's groups at the same time, each on its share of the
cores (issue #80, part 1).

A ``Worker`` is one long-lived thread, set up once for its share: TVM's thread pool of that
thread (``runtime.config_threadpool``: TVM keeps one pool per calling thread) and the
OpenMP team size of that thread (torch's oneDNN kernels), so two groups of one stage do not
both spread over every core. A library's own threads are its lowering's business: the
group's callable was lowered inside ``target.thread_share`` (an ONNX Runtime session or an
OpenVINO model made for that many threads, an MKL call limited to them).

``Crew.run(calls)`` hands each call to its worker and waits for all of them; the calling
thread (the Relax VM's) sleeps meanwhile without holding the GIL, and the workers' calls
into TVM or a library release it too, so the groups do run at once. An exception in a
group is raised in the caller, after every group has finished.
"""
from __future__ import annotations

import ctypes
import functools
import queue
import threading

import tvm

# TVM's affinity mode for ``runtime.config_threadpool``: the "big" cores (all of them on a
# homogeneous CPU).
_TVM_BIG_CORES = 1


@functools.lru_cache(maxsize=None)
def _omp_set_num_threads():
    """``omp_set_num_threads`` of the OpenMP runtime loaded in this process (torch's
    libgomp / libiomp), or None: it sets the calling thread's team size only."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


def limit_this_thread(threads: int) -> None:
    """Run this thread's TVM kernels and OpenMP regions on ``threads`` threads."""
    tvm.get_global_func("runtime.config_threadpool")(_TVM_BIG_CORES, int(threads))
    set_omp = _omp_set_num_threads()
    if set_omp is not None:
        set_omp(int(threads))


class Worker:
    """One thread, limited to ``threads`` threads, running the calls it is handed."""

    def __init__(self, threads: int, name: str = "collage-stage"):
        self.threads = int(threads)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        limit_this_thread(self.threads)
        while True:
            job = self._jobs.get()
            if job is None:
                return
            k, fn, args, done = job
            try:
                out = fn(*args)
            except BaseException as err:  # noqa: BLE001 - raised again in the caller
                out = err
            done.put((k, out))

    def submit(self, k: int, fn, args, done: queue.SimpleQueue) -> None:
        self._jobs.put((k, fn, args, done))

    def stop(self) -> None:
        self._jobs.put(None)


class Crew:
    """The workers of one concurrent stage: worker k runs group k on ``shares[k]`` threads.
    Made on first use (threads start in the process that runs the build)."""

    def __init__(self, shares):
        self.shares = [int(s) for s in shares]
        if not self.shares or min(self.shares) < 1:
            raise ValueError(f"a stage's thread shares are positive counts, not {shares!r}")
        self._workers: list | None = None
        self._lock = threading.Lock()

    def _ready(self) -> list:
        if self._workers is None:
            with self._lock:
                if self._workers is None:
                    self._workers = [Worker(s, f"collage-stage-{k}")
                                     for k, s in enumerate(self.shares)]
        return self._workers

    def run(self, calls) -> list:
        """``calls``: (fn, args) per group, in the workers' order -> their results."""
        workers = self._ready()
        if len(calls) != len(workers):
            raise ValueError(f"{len(calls)} calls for a stage of {len(workers)} groups")
        done: queue.SimpleQueue = queue.SimpleQueue()
        for k, ((fn, args), worker) in enumerate(zip(calls, workers)):
            worker.submit(k, fn, args, done)
        results: list = [None] * len(calls)
        failed = None
        for _ in calls:
            k, out = done.get()
            if isinstance(out, BaseException):
                failed = failed or out
            results[k] = out
        if failed is not None:
            raise failed
        return results

    def close(self) -> None:
        for worker in self._workers or ():
            worker.stop()
        self._workers = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def split_cores(cores: int, parts: int) -> list[int]:
    """Each of ``parts`` groups' share of ``cores``: as equal as can be, the first ones
    taking the remainder; one thread each when there are more groups than cores."""
    if parts < 1:
        raise ValueError("a stage has at least one group")
    base, extra = divmod(max(int(cores), 1), parts)
    return [max(1, base + (1 if k < extra else 0)) for k in range(parts)]
