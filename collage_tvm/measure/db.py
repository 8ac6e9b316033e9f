"""The cost database: measured kernel costs, cached across runs and processes.

Collage measures every candidate kernel once per (backend, backend version,
candidate, device) and reuses the number afterwards.  The cache is a SQLite file:

* primary key ``(backend, version, key, device)`` where ``key`` is a structural
  hash of the candidate supplied by the caller;
* ``cost_ms`` may be ``math.inf`` for a candidate that failed to build or run,
  with ``reason`` saying why;
* safe for several processes at once: WAL journal, a 30 s busy timeout, one short
  transaction per write and ``INSERT ... ON CONFLICT DO UPDATE``;
* nothing is lost: a damaged file (not SQLite, truncated, failing
  ``PRAGMA quick_check``, or a schema from an unknown version) is reported with a
  WARNING on the ``collage_tvm`` logger, moved aside to
  ``<path>.corrupt-<YYYYmmdd-HHMMSS>`` and replaced by a fresh database.
  ``CostDB.recovered_from`` names the moved-aside file.

Open one :class:`CostDB` per process (a connection must not cross ``fork``; if it
does, the child transparently opens its own).
"""
from __future__ import annotations

import json
import logging
import math
import os
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from .._files import aside_name, file_lock, write_json_atomic
# CostRecord, failure_kind, TRANSIENT: where the DB's users import them from
from .records import (EXPORT_FORMAT, EXPORT_VERSION, FAILURE_KINDS, TRANSIENT,  # noqa: F401
                      CostRecord, check_cost, cost_to_json, dump_extra, failure_kind,
                      import_rows, load_extra)

logger = logging.getLogger("collage_tvm")

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 30.0
LOCKED_RETRIES, LOCKED_WAIT_S = 10, 1.0  # a write still locked out after the busy timeout
_MEMORY = ":memory:"
_CHUNK = 500  # bound on SQL variables per statement

# SQLite primary result codes that mean "this file is damaged / not a database".
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26

_SCHEMA = """
CREATE TABLE IF NOT EXISTS costs (
    backend     TEXT NOT NULL,
    version     TEXT NOT NULL,
    key         TEXT NOT NULL,
    device      TEXT NOT NULL,
    cost_ms     REAL NOT NULL,
    reason      TEXT,
    measured_at REAL NOT NULL,
    extra       TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (backend, version, key, device)
) WITHOUT ROWID
"""

_UPSERT = """
INSERT INTO costs (backend, version, key, device, cost_ms, reason, measured_at, extra)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (backend, version, key, device) DO UPDATE SET
    cost_ms = excluded.cost_ms,
    reason = excluded.reason,
    measured_at = excluded.measured_at,
    extra = excluded.extra
"""
# Import: only replace what we hold when the incoming measurement is newer.
_UPSERT_IF_NEWER = _UPSERT + " WHERE excluded.measured_at > costs.measured_at"

_COLUMNS = ("backend", "version", "key", "device", "cost_ms", "reason", "measured_at", "extra")

# Connections inherited through fork(): never closed in the child (closing would
# run SQLite's last-connection cleanup on files the parent still uses).
_abandoned_after_fork: list = []


class _DamagedDB(Exception):
    """Internal: the file at the DB path is not a usable cost database."""


def _is_corruption(err: sqlite3.DatabaseError) -> bool:
    code = getattr(err, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    msg = str(err).lower()  # Python < 3.11: no error codes
    return "not a database" in msg or "malformed" in msg or "corrupt" in msg


class CostDB:
    """Persistent cache of measured kernel costs (see module docstring)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self._lock = threading.Lock()
        self.recovered_from: str | None = None
        if path is None or str(path) == _MEMORY:
            self.path: str = _MEMORY
            self._file: Path | None = None
        else:
            self._file = Path(os.fspath(path)).expanduser()
            self.path = str(self._file)
            self._file.parent.mkdir(parents=True, exist_ok=True)
        self._conn: sqlite3.Connection | None = None
        self._pid = os.getpid()
        self._conn = self._open()

    # ------------------------------------------------------------------ opening
    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(
            self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        return conn

    def _open(self) -> sqlite3.Connection:
        if self._file is None:
            conn = self._connect()
            self._init_schema(conn)
            return conn
        lock_path = self._file.with_name(self._file.name + ".lock")
        # Serialise validate-and-maybe-recover across processes, so two processes
        # opening the same damaged file do not both move things aside.
        with file_lock(lock_path):
            try:
                return self._open_checked()
            except _DamagedDB as damage:
                reason = str(damage)
            aside = self._move_aside()
            self.recovered_from = str(aside)
            logger.warning(
                "cost database %s is damaged (%s); moved it aside to %s and started a fresh one",
                self.path, reason, aside,
            )
            try:
                return self._open_checked()
            except _DamagedDB as damage:  # pragma: no cover - a fresh file should never fail
                raise RuntimeError(f"cost database {self.path}: cannot create a fresh database: {damage}")

    def _open_checked(self) -> sqlite3.Connection:
        conn = self._connect()
        try:
            try:
                conn.execute("PRAGMA journal_mode = WAL").fetchone()
                conn.execute("PRAGMA synchronous = NORMAL")
                rows = conn.execute("PRAGMA quick_check").fetchall()
                if [r[0] for r in rows] != ["ok"]:
                    detail = "; ".join(str(r[0]) for r in rows[:3])
                    raise _DamagedDB(f"PRAGMA quick_check failed: {detail}")
                version = conn.execute("PRAGMA user_version").fetchone()[0]
                tables = {
                    r[0]
                    for r in conn.execute(
                        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
                    )
                }
                if version == 0 and tables:
                    raise _DamagedDB(
                        f"not a cost database (no schema version, tables: {', '.join(sorted(tables))})"
                    )
                if version not in (0, SCHEMA_VERSION):
                    raise _DamagedDB(
                        f"unknown schema version {version} (this code reads version {SCHEMA_VERSION})"
                    )
                self._init_schema(conn)
                cols = [r[1] for r in conn.execute("PRAGMA table_info(costs)")]
                if tuple(cols) != _COLUMNS:
                    raise _DamagedDB(f"unexpected columns in table costs: {cols}")
            except sqlite3.DatabaseError as e:
                if _is_corruption(e):
                    raise _DamagedDB(f"{type(e).__name__}: {e}") from None
                raise
        except BaseException:
            conn.close()
            raise
        return conn

    @staticmethod
    def _init_schema(conn: sqlite3.Connection) -> None:
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(_SCHEMA)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def _move_aside(self) -> Path:
        assert self._file is not None
        aside = aside_name(self._file)
        os.replace(self._file, aside)
        # A stale WAL must not be replayed into the fresh database: keep it next
        # to the moved-aside file (so SQLite would pair them if it is opened).
        wal = self._file.with_name(self._file.name + "-wal")
        if wal.exists():
            os.replace(wal, aside.with_name(aside.name + "-wal"))
        shm = self._file.with_name(self._file.name + "-shm")
        try:
            shm.unlink()  # only an index, rebuilt from the WAL
        except FileNotFoundError:
            pass
        return aside

    # ------------------------------------------------------------------ helpers
    @contextmanager
    def _use(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            if self._conn is None:
                raise ValueError(f"cost database {self.path} is closed")
            if os.getpid() != self._pid:
                # Inherited through fork: leave the parent's connection alone.
                _abandoned_after_fork.append(self._conn)
                self._pid = os.getpid()
                self._conn = None
                self._conn = self._open()
            yield self._conn

    @staticmethod
    def _record(row) -> CostRecord:
        cost_ms, reason, measured_at, extra = row
        return CostRecord(float(cost_ms), reason, float(measured_at), load_extra(extra))

    # ------------------------------------------------------------------ API
    def get(self, backend: str, version: str, key: str, device: str) -> CostRecord | None:
        with self._use() as conn:
            row = conn.execute(
                "SELECT cost_ms, reason, measured_at, extra FROM costs"
                " WHERE backend = ? AND version = ? AND key = ? AND device = ?",
                (backend, version, key, device),
            ).fetchone()
        return None if row is None else self._record(row)

    def get_many(self, backend: str, version: str, keys: list[str], device: str) -> dict[str, CostRecord]:
        """Records for those of ``keys`` that are cached (missing keys are absent)."""
        wanted = list(dict.fromkeys(keys))
        out: dict[str, CostRecord] = {}
        with self._use() as conn:
            for i in range(0, len(wanted), _CHUNK):
                chunk = wanted[i : i + _CHUNK]
                marks = ",".join("?" * len(chunk))
                for row in conn.execute(
                    "SELECT key, cost_ms, reason, measured_at, extra FROM costs"
                    f" WHERE backend = ? AND version = ? AND device = ? AND key IN ({marks})",
                    (backend, version, device, *chunk),
                ):
                    out[row[0]] = self._record(row[1:])
        return out

    def put(
        self,
        backend: str,
        version: str,
        key: str,
        device: str,
        cost_ms: float,
        reason: str | None = None,
        extra: dict | None = None,
    ) -> None:
        """Store (or overwrite) one measurement, stamped with the current time."""
        for name, value in (("backend", backend), ("version", version), ("key", key), ("device", device)):
            if not isinstance(value, str):
                raise TypeError(f"{name} must be a str, got {type(value).__name__}")
        if reason is not None and not isinstance(reason, str):
            raise TypeError(f"reason must be a str or None, got {type(reason).__name__}")
        row = (backend, version, key, device, check_cost(cost_ms), reason, time.time(), dump_extra(extra))
        for attempt in range(LOCKED_RETRIES + 1):
            try:
                with self._use() as conn:
                    conn.execute(_UPSERT, row)  # autocommit: one short transaction
                return
            except sqlite3.OperationalError as err:
                # Another process held the write lock past the busy timeout (a long import,
                # a stalled disk): wait and write again; the measurement is never dropped.
                if "locked" not in str(err) and "busy" not in str(err) or attempt == LOCKED_RETRIES:
                    raise
                logger.warning("cost database %s is locked (%s); writing again in %.0f s",
                               self.path, err, LOCKED_WAIT_S)
                time.sleep(LOCKED_WAIT_S)

    def __len__(self) -> int:
        with self._use() as conn:
            return conn.execute("SELECT COUNT(*) FROM costs").fetchone()[0]

    def stats(self) -> dict:
        with self._use() as conn:
            total = conn.execute("SELECT COUNT(*) FROM costs").fetchone()[0]
            by_backend = dict(
                conn.execute("SELECT backend, COUNT(*) FROM costs GROUP BY backend ORDER BY backend").fetchall()
            )
            failed = conn.execute("SELECT COUNT(*) FROM costs WHERE cost_ms = ?", (math.inf,)).fetchone()[0]
            reasons = [r[0] for r in conn.execute("SELECT reason FROM costs WHERE cost_ms = ?",
                                                  (math.inf,))]
        by_kind: dict = {}
        for reason in reasons:
            kind = failure_kind(reason)
            by_kind[kind] = by_kind.get(kind, 0) + 1
        return {"path": self.path, "records": total, "by_backend": by_backend, "failed": failed,
                "failed_by_kind": by_kind}

    def forget(self, backend: str | None = None, kind: str | None = None,
               label: str | None = None) -> int:
        """Delete the records matching every filter given, and return how many: ``backend``
        (its name), ``kind`` ("failed": every failure, one of ``FAILURE_KINDS``, or
        "measured": every success), ``label`` (a substring of the candidate's label, e.g. an
        operator's name). With no filter, nothing is deleted (use a fresh file for that)."""
        if backend is None and kind is None and label is None:
            raise ValueError("forget: name a backend, a kind or a label (nothing forgotten)")
        kinds = ("failed", "measured", *FAILURE_KINDS)
        if kind is not None and kind not in kinds:
            raise ValueError(f"forget: kind {kind!r} is not one of {', '.join(kinds)}")
        doomed = []
        for r in self.rows():
            failed = math.isinf(r["cost_ms"])
            if backend is not None and r["backend"] != backend:
                continue
            if kind == "measured" and failed or kind == "failed" and not failed:
                continue
            if kind in FAILURE_KINDS and not (failed and failure_kind(r["reason"]) == kind):
                continue
            if label is not None and label not in str(r["extra"].get("label", "")):
                continue
            doomed.append((r["backend"], r["version"], r["key"], r["device"]))
        with self._use() as conn:
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany("DELETE FROM costs WHERE backend = ? AND version = ? AND key = ?"
                                 " AND device = ?", doomed)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return len(doomed)

    def rows(self) -> list[dict]:
        with self._use() as conn:
            fetched = conn.execute(
                f"SELECT {', '.join(_COLUMNS)} FROM costs ORDER BY backend, version, key, device"
            ).fetchall()
        out = []
        for r in fetched:
            d = dict(zip(_COLUMNS, r))
            d["cost_ms"] = float(d["cost_ms"])
            d["measured_at"] = float(d["measured_at"])
            d["extra"] = load_extra(d["extra"])
            out.append(d)
        return out

    def export_json(self, path) -> int:
        """Write every record to ``path`` (atomically); infinite costs become "inf"."""
        records = self.rows()
        for r in records:
            r["cost_ms"] = cost_to_json(r["cost_ms"])
        doc = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "records": records}
        write_json_atomic(Path(os.fspath(path)).expanduser(), doc)
        return len(records)

    def import_json(self, path) -> int:
        """Merge records from a file written by :meth:`export_json`.

        On a key already present, the record with the newer ``measured_at`` wins.
        Returns the number of records that were added or replaced.  A malformed
        file raises ``ValueError`` naming the path and the problem; nothing is
        imported from it then.
        """
        src = Path(os.fspath(path)).expanduser()
        try:
            text = src.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{src}: not UTF-8 text: {e}") from None
        try:
            doc = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{src}: not valid JSON: {e}") from None
        rows = import_rows(doc, str(src))
        with self._use() as conn:
            before = conn.total_changes
            conn.execute("BEGIN IMMEDIATE")
            try:
                conn.executemany(_UPSERT_IF_NEWER, rows)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            return conn.total_changes - before

    def close(self) -> None:
        with self._lock:
            conn, self._conn = self._conn, None
            if conn is None:
                return
            if os.getpid() == self._pid:
                conn.close()
            else:  # inherited through fork: the parent still uses it
                _abandoned_after_fork.append(conn)

    def __enter__(self) -> "CostDB":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # best effort; explicit close() is preferred
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"CostDB({self.path!r})"
