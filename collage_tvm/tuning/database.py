"""The tuning database: MetaSchedule's records for one target and TVM version, on disk.

A directory holding MetaSchedule's ``JSONDatabase`` (``database_workload.json``,
``database_tuning_record.json``) and ``meta.json`` naming the TVM version, target and
device it was tuned for. The default directory sits next to the cost DB
(``<costs>.tuning/<target id>/``), one per target: tuning for another CPU or TVM version
lands in another directory. A directory whose ``meta.json`` names another target or TVM
version is ignored with a message, never mixed in.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import weakref

import tvm

from ..target import device_fingerprint, tvm_threads
from .compile import kernel_key, kernels, workload

logger = logging.getLogger("collage_tvm")

META = "meta.json"
RECORDS = "database_tuning_record.json"  # MetaSchedule's JSONDatabase, one record a line


def _meta(target) -> dict:
    # threads: the records' times were measured on TVM's pool of that size (collage_tvm/
    # __init__); a schedule chosen on one thread is not the one that wins on two.
    return {"tvm": tvm.__version__, "target": str(target), "device": device_fingerprint(target),
            "threads": tvm_threads()}


def target_id(target) -> str:
    """A directory name for ``target`` on this machine and TVM version."""
    meta = _meta(target)
    digest = hashlib.sha1(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:10]
    cpu = re.sub(r"[^A-Za-z0-9]+", "-", str(target.attrs.get("mcpu", "") or target.kind.name))
    return f"{cpu}-{digest}"


def tuning_root(cost_db_path) -> str:
    """``<cost DB without extension>.tuning``: the tuning databases of every target."""
    return os.path.splitext(os.fspath(cost_db_path))[0] + ".tuning"


def default_dir(cost_db_path, target) -> str | None:
    """``<cost DB without extension>.tuning/<target id>``; None for an in-memory cost DB."""
    if cost_db_path in (None, ":memory:"):
        return None
    return os.path.join(tuning_root(cost_db_path), target_id(target))


class TuningDB:
    """MetaSchedule records for one target, with what Collage asks of them.

    ``TuningDB(path, target)`` opens (or creates) ``path``; :func:`open_tuning_db` is the
    forgiving entry point (a mismatched directory is reported and ignored)."""

    def __init__(self, path: str, target):
        from tvm.s_tir import meta_schedule as ms

        self.path = os.fspath(path)
        self.target = target
        meta_path = os.path.join(self.path, META)
        if os.path.exists(meta_path):
            with open(meta_path) as f:
                found = json.load(f)
            want = _meta(target)
            diff = [k for k in ("tvm", "target", "threads") if found.get(k) != want[k]]
            if diff:
                raise ValueError(f"tuning database {self.path} was made for "
                                 + ", ".join(f"{k} {found.get(k)!r}" for k in diff)
                                 + "; this build uses "
                                 + ", ".join(f"{k} {want[k]!r}" for k in diff))
        else:
            os.makedirs(self.path, exist_ok=True)
            with open(meta_path, "w") as f:
                json.dump(_meta(target), f, indent=1)
        self.database = ms.database.JSONDatabase(work_dir=self.path)
        self._signatures: dict = {}
        _LIVE.add(self)

    def __len__(self) -> int:
        return len(self.database)

    def reload(self) -> None:
        """Re-read the files (another process may have tuned meanwhile)."""
        from tvm.s_tir import meta_schedule as ms

        self.database = ms.database.JSONDatabase(work_dir=self.path)
        self._signatures.clear()

    def trials(self, kernel) -> int:
        """Records (measured schedules) held for ``kernel``; 0 when never tuned."""
        mod = workload(kernel)
        if not self.database.has_workload(mod):
            return 0
        return len(self.database.get_top_k(self.database.commit_workload(mod), 1 << 30))

    def best(self, kernel):
        """``(record, seconds)`` of ``kernel``'s best measured schedule, else None."""
        mod = workload(kernel)
        if not self.database.has_workload(mod):
            return None
        top = self.database.get_top_k(self.database.commit_workload(mod), 1)
        if not top or not top[0].run_secs:
            return None
        secs = [float(s) for s in top[0].run_secs]
        return top[0], sum(secs) / len(secs)

    def signature(self, func, key: str | None = None) -> str:
        """What of this database a build of ``func`` uses: a hash of the best record of each
        of its kernels that has one; ``""`` when none has (the build is untuned). ``key``
        (the function's own key) caches the answer."""
        if key is not None and key in self._signatures:
            return self._signatures[key]
        parts = []
        for _, kernel in kernels(func, self.target):
            found = self.best(kernel)
            if found is not None:
                parts.append(f"{kernel_key(kernel)}:{found[0].trace}")
        sig = hashlib.sha1("\n".join(parts).encode()).hexdigest()[:16] if parts else ""
        if key is not None:
            self._signatures[key] = sig
        return sig

    def digest(self) -> str:
        """A hash of the records file (MetaSchedule appends each measured schedule to it):
        changes whenever tuning recorded anything; ``""`` for an empty database."""
        try:
            with open(os.path.join(self.path, RECORDS), "rb") as f:
                data = f.read()
        except OSError:
            return ""
        return hashlib.sha1(data).hexdigest()[:16] if data.strip() else ""

    # What each model has had: tune's budget is cumulative, so the same command twice
    # tunes once (the second measures nothing new) and a larger budget tunes the rest.
    MODELS = "models.json"

    def spent(self, model_key: str) -> float:
        """Seconds of tuning earlier tunes gave the model ``model_key``."""
        try:
            with open(os.path.join(self.path, self.MODELS)) as f:
                return float(json.load(f).get(model_key, {}).get("seconds", 0.0))
        except (OSError, ValueError, AttributeError, TypeError):
            return 0.0

    def add_spent(self, model_key: str, seconds: float) -> None:
        from pathlib import Path

        from .._files import write_json_atomic

        try:
            with open(os.path.join(self.path, self.MODELS)) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = {}
        entry = doc.get(model_key, {}) if isinstance(doc.get(model_key), dict) else {}
        doc[model_key] = {"seconds": float(entry.get("seconds", 0.0)) + seconds}
        write_json_atomic(Path(self.path) / self.MODELS, doc)

    def stats(self) -> dict:
        """``{"path", "workloads", "records", "tvm", "target"}`` for ``db stats``."""
        workloads = {kernel_key(rec.workload.mod)
                     for rec in self.database.get_all_tuning_records()}
        return {"path": self.path, "workloads": len(workloads), "records": len(self),
                "tvm": tvm.__version__, "target": str(self.target)}


def open_tuning_db(path, target, create: bool = False) -> TuningDB | None:
    """The tuning database at ``path`` for ``target``; None when there is none (and not
    ``create``), or when it belongs to another target or TVM version (logged: it is left
    as it is, not used)."""
    if path is None:
        return None
    if not create and not os.path.exists(os.path.join(os.fspath(path), META)):
        return None
    try:
        return TuningDB(path, target)
    except (ValueError, OSError, RuntimeError) as err:  # RuntimeError: a damaged JSON file
        logger.warning("tuning database ignored: %s", err)
        return None


# ----------------------------------------------------------------- the active database
# Every TVM build of a search applies the same records: the build makes the database
# MetaSchedule's current one (``use_tuning_db``: ``with database:``, as MetaSchedule's own
# tuning and ``MetaScheduleApplyDatabase`` use it) and the compile step asks which TuningDB
# that is (``active_database``); a measuring child process gets its path through
# ``candidate_vm`` and opens it once.

_LIVE: "weakref.WeakSet[TuningDB]" = weakref.WeakSet()  # every TuningDB of this process
_OPENED: dict = {}  # path -> TuningDB, in a process that was handed paths


def active_database() -> TuningDB | None:
    """The TuningDB whose records MetaSchedule applies now (``Database.current()``), else
    None (untuned, or a MetaSchedule database that is not a TuningDB's)."""
    from tvm.s_tir import meta_schedule as ms

    current = ms.database.Database.current()
    if current is None:
        return None
    return next((db for db in list(_LIVE) if db.database.same_as(current)), None)


class use_tuning_db:  # noqa: N801 - used as a context manager, like tvm's ``with target:``
    """``with use_tuning_db(db_or_path, target):`` TVM builds inside apply ``db``'s records:
    its MetaSchedule database is the current one. ``None`` leaves the current database as
    it is. A path names the active database when it is that one (measuring in this process:
    the records as the build sees them now), else the copy this process opened from it
    first (a measuring child, one per search)."""

    def __init__(self, db, target=None):
        if isinstance(db, (str, os.PathLike)):
            path = os.fspath(db)
            active = active_database()
            if active is not None and active.path == path:
                db = active
            else:
                if path not in _OPENED:
                    _OPENED[path] = open_tuning_db(path, target)
                db = _OPENED[path]
        self.db = db
        self._entered = None

    def __enter__(self):
        if self.db is not None:
            self._entered = self.db.database  # the one entered is the one left (a reload
            self._entered.__enter__()         # inside replaces ``db.database``)
        return self.db

    def __exit__(self, *exc):
        if self._entered is not None:
            self._entered.__exit__(*exc)
            self._entered = None
        return False
