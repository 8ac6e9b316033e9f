"""Tune a list of TVM kernels with MetaSchedule, within a time budget, into a TuningDB.

Kernels are tuned one at a time, in the order given (the caller puts the largest expected
gain first): MetaSchedule's evolutionary search with its XGBoost cost model, candidate
schedules built and timed in this process (``inprocess``). Each record is written to the
database as it is measured, so an interrupted tune keeps what it found; a kernel whose
tuning fails is reported, remembered (``failed.json``: not tried again) and skipped; a
kernel the database already holds ``trials`` records for is not tuned again.
"""
from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import time
from dataclasses import dataclass, field

from .database import TuningDB
from .compile import kernel_key, workload

logger = logging.getLogger("collage_tvm")

UNTUNED = "untuned.json"  # kernel key -> untuned ms, beside the MetaSchedule files
FAILED = "failed.json"    # kernel key -> why tuning it failed (not tried again; delete to retry)
MIN_TRIALS = 16  # one round of the evolutionary search


@dataclass
class KernelToTune:
    name: str
    kernel: object            # tvm.tirx.PrimFunc
    stake_ms: float = 0.0     # what the placement spends on it today (see collage_tvm.tune)
    count: int = 1            # occurrences in the model
    best_library_ms: float = math.nan
    info: dict = field(default_factory=dict)
    # 0: a kernel of TVM's own fusion of the whole model (a TVM-only build runs it); the
    # budget is spread evenly over these first. 1: another fusion variant, in order.
    tier: int = 0

    @property
    def key(self) -> str:
        return kernel_key(self.kernel)


@dataclass
class KernelResult:
    name: str
    key: str
    status: str               # "tuned", "cached" (enough records already), "failed", "skipped"
    trials: int = 0           # trials run now
    untuned_ms: float = math.nan
    tuned_ms: float = math.nan
    best_library_ms: float = math.nan
    seconds: float = 0.0
    reason: str = ""
    info: dict = field(default_factory=dict)  # what chose it: stake, uses (collage_tvm.tune)


def _untuned_ms(db: TuningDB, item: KernelToTune, table: dict) -> float:
    """The kernel's time as TVM builds it without a schedule (cached in ``untuned.json``)."""
    if item.key in table:
        return table[item.key]
    from tvm.s_tir.meta_schedule.arg_info import ArgInfo

    from .inprocess import build_kernel, time_kernel

    mod = workload(item.kernel)
    secs = time_kernel(build_kernel(mod, db.target),
                       [a.as_json() for a in ArgInfo.from_prim_func(mod["main"])])
    table[item.key] = ms = 1e3 * sorted(secs)[len(secs) // 2]
    return ms


def _save(db: TuningDB, name: str, table: dict) -> None:
    from pathlib import Path

    from .._files import write_json_atomic

    write_json_atomic(Path(db.path) / name, table)


def _load(db: TuningDB, name: str, kind) -> dict:
    """A side table of the database directory; a missing or damaged one is empty."""
    try:
        with open(os.path.join(db.path, name)) as f:
            return {str(k): kind(v) for k, v in json.load(f).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def _tune_one(db: TuningDB, item: KernelToTune, trials: int, seed: int) -> None:
    from tvm.s_tir import meta_schedule as ms

    from .inprocess import InProcessBuilder, InProcessRunner, tensor_intrinsics

    tensor_intrinsics(db.target)  # before TuneContext imports them all
    # MetaSchedule reports every round at INFO (tables, XGBoost fits): kept out of the
    # user's log; our progress bar says what happened.
    quiet = logging.getLogger("collage_tvm.metaschedule")
    quiet.setLevel(logging.WARNING)
    logging.getLogger("tvm.s_tir.meta_schedule").setLevel(logging.WARNING)
    ctx = ms.TuneContext(mod=workload(item.kernel), target=db.target,
                         space_generator="post-order-apply", search_strategy="evolutionary",
                         task_name=item.name, logger=quiet, rand_state=seed,
                         num_threads="physical").clone()
    with tempfile.TemporaryDirectory(prefix="collage-tune-") as work_dir:
        ms.tune.tune_tasks(tasks=[ctx], task_weights=[1.0], work_dir=work_dir,
                           max_trials_global=trials, num_trials_per_iter=MIN_TRIALS,
                           builder=InProcessBuilder(), runner=InProcessRunner(),
                           database=db.database, cost_model="xgb",
                           measure_callbacks=[ms.measure_callback.AddToDatabase(),
                                              ms.measure_callback.UpdateCostModel()])


def tune_kernels(db: TuningDB, items: list, budget_s: float, trials: int = 64,
                 progress: bool = True, on_kernel=None) -> list:
    """Tune ``items`` (``KernelToTune``, in order) into ``db`` for at most about
    ``budget_s`` seconds; ``trials`` per kernel at most. Returns a ``KernelResult`` per item
    (kernels the budget did not reach are "skipped"). ``on_kernel(result)`` after each."""
    from tqdm import tqdm

    trials = max(MIN_TRIALS, int(trials))
    state = {"deadline": time.perf_counter() + budget_s,
             "per_trial": 1.5,  # seconds, until a kernel has been tuned here
             "untuned": _load(db, UNTUNED, float), "failed": _load(db, FAILED, str)}
    results = []
    bar = tqdm(total=len(items), desc="tuning TVM kernels", unit="kernel", disable=not progress,
               dynamic_ncols=True)
    try:
        for i, item in enumerate(items):
            res = KernelResult(item.name, item.key, "skipped",
                               best_library_ms=item.best_library_ms)
            results.append(res)
            t0 = time.perf_counter()
            _tune_item(db, items, i, res, trials, state)
            best = db.best(item.kernel)
            if best is not None:
                res.tuned_ms = 1e3 * best[1]
            res.seconds = time.perf_counter() - t0
            left = max(0.0, state["deadline"] - time.perf_counter())
            bar.set_postfix_str(f"{item.name[:40]} {res.untuned_ms:.3g} -> {res.tuned_ms:.3g} ms, "
                                f"{left:.0f} s left", refresh=False)
            bar.update(1)
            if on_kernel is not None:
                on_kernel(res)
    finally:
        bar.close()
        _save(db, UNTUNED, state["untuned"])
        _save(db, FAILED, state["failed"])
    return results


def _tune_item(db: TuningDB, items: list, i: int, res: KernelResult, trials: int,
               state: dict) -> None:
    """Kernel ``items[i]`` into ``db`` (``res`` says what happened); ``state``: the
    deadline, the running time per trial, the untuned and failed tables."""
    item, untuned, failed = items[i], state["untuned"], state["failed"]
    res.untuned_ms = untuned.get(item.key, math.nan)
    if item.key in failed:
        res.status, res.reason = "failed", f"in an earlier tune: {failed[item.key]}"
        return
    have = db.trials(item.kernel)
    if have < trials and state["deadline"] - time.perf_counter() < MIN_TRIALS * state["per_trial"]:
        res.reason = "out of budget"  # not even its untuned time is measured
        return
    try:
        res.untuned_ms = _untuned_ms(db, item, untuned)
    except Exception as err:  # noqa: BLE001 - reported, the next kernel goes on
        res.status, res.reason = "failed", f"untuned build/run: {type(err).__name__}: {err}"
        failed[item.key] = res.reason
        logger.warning("kernel %s: %s", item.name, res.reason)
        return
    left = state["deadline"] - time.perf_counter()
    if have >= trials:
        res.status = "cached"
        return
    if left < MIN_TRIALS * state["per_trial"]:
        res.reason = "out of budget"
        return
    # Tier 0 shares what is left evenly (a TVM-only build needs every one of them tuned);
    # after it, each kernel takes what it may.
    share = max(1, sum(1 for later in items[i:] if later.tier == 0) if item.tier == 0 else 1)
    n = max(MIN_TRIALS, min(trials - have, int(left / state["per_trial"] / share)
                            // MIN_TRIALS * MIN_TRIALS))
    try:
        # One round first: its time per trial (a large kernel's trials take seconds each)
        # decides how many more fit this kernel's share.
        t1 = time.perf_counter()
        _tune_one(db, item, MIN_TRIALS, seed=i)
        res.status, res.trials = "tuned", MIN_TRIALS
        mine = (time.perf_counter() - t1) / MIN_TRIALS
        state["per_trial"] = 0.5 * state["per_trial"] + 0.5 * mine
        share_s = (state["deadline"] - time.perf_counter()) / share
        more = min(n - MIN_TRIALS, int(share_s / max(mine, 1e-3)) // MIN_TRIALS * MIN_TRIALS)
        if more >= MIN_TRIALS:
            _tune_one(db, item, more, seed=i + 7919)
            res.trials += more
    except KeyboardInterrupt:
        res.status, res.reason = "failed", "interrupted"
        raise
    except Exception as err:  # noqa: BLE001 - reported, the next kernel goes on
        res.status, res.reason = "failed", f"{type(err).__name__}: {str(err)[:300]}"
        failed[item.key] = res.reason
        logger.warning("tuning kernel %s failed: %s", item.name, res.reason)
