"""Build processes: the candidates a measurer will time built side by side beforehand, for
the measuring process to load rather than build (``runner.prebuild``, ``--build-jobs``)."""
from __future__ import annotations

import logging
import math
import os
import time

from ..target import host_cores
from . import runner
from .progress import progress_bar
from .timers import function_json
from .worker import WorkerPool

logger = logging.getLogger("collage_tvm")


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


def prebuilds(backend) -> bool:
    """Whether build processes build ``backend``'s candidates: TVM's (exported), and a
    library's whose builds leave a cache on disk (``Lowering.build_cache``)."""
    if not backend.is_external:
        return True
    try:
        return bool(getattr(backend.get_lowering(), "build_cache", False))
    except Exception:  # noqa: BLE001 - an unresolvable lowering fails where it is timed
        return False


def prebuild(measurer, keys: list, by_key: dict, backends: dict) -> None:
    """Build the candidates of ``keys`` ((backend, DB key) pairs) the DB does not answer, in
    ``measurer.build_jobs`` processes side by side, for the measuring process to load rather
    than build (``runner.prebuild``; a library's with a ``build_cache``: built and run once,
    so that its cache holds them). Worth it where a build is long beside its timing: on a
    GPU (NVRTC), or with more cores than a timing needs. A failed build is left to the
    measuring process, which builds it again and records why it fails."""
    timer = measurer.timer
    keys = [bk for bk in keys if measurer.db.get(bk[0], backends[bk[0]].version(), bk[1],
                                                 measurer.device) is None]
    keys = [bk for bk in keys if not backends[bk[0]].is_external
            or timer.picklable(backends[bk[0]])]
    jobs = min(measurer.build_jobs, len(keys) // 2)  # a process costs a start: two builds each
    if jobs < 1 or not runner.can_prebuild(measurer.build_vm):
        return
    t0 = time.perf_counter()
    os.makedirs(timer.prebuilt, exist_ok=True)
    timer.use_prebuilt()
    requests = [[(backends[bk[0]], function_json(by_key[bk][0]), bk[1])] for bk in keys]
    # The cores shared out: torch.compile would start a pool of a process per core in
    # every build process.
    threads = str(max(1, host_cores() // jobs))
    pool = WorkerPool(jobs, env={"TORCHINDUCTOR_COMPILE_THREADS": threads})
    bar = progress_bar(len(keys), measurer.progress, f"building candidates ({jobs} processes)")
    failed = 0
    try:
        for _, (cost, _reason, _extra) in pool.map("prebuild", requests, timer.target_json,
                                                    measurer.build_vm, timer.prebuilt):
            failed += math.isinf(cost)
            bar.update(1)
    finally:
        pool.close()
        bar.close()
    measurer.prebuilt += len(keys) - failed
    measurer.seconds["parallel builds"] += time.perf_counter() - t0
    logger.info("built %d candidates in %d processes in %.1f s (%d failed: built "
                "again where they are timed)", len(keys), jobs, time.perf_counter() - t0,
                failed)
