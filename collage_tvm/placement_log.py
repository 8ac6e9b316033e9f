"""Placements chosen by the search, kept as one JSON file.

The file is ``{"version": 1, "placements": {key: record}}``.  Every ``put`` is a
read-modify-write under an exclusive ``fcntl`` lock on ``<path>.lock`` and ends
with an atomic replace (temp file in the same directory, then ``os.replace``), so
readers never see a half-written file and two processes putting different keys
lose nothing.  A damaged file is reported with a WARNING on the ``collage_tvm``
logger, moved aside to ``<path>.corrupt-<YYYYmmdd-HHMMSS>`` and the log starts
empty; ``PlacementLog.recovered_from`` names the moved-aside file.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
from pathlib import Path

from ._files import aside_name, file_lock, write_json_atomic

logger = logging.getLogger("collage_tvm")

LOG_VERSION = 1


class _Damaged(Exception):
    """Internal: the file exists but is not a readable placement log."""


class PlacementLog:
    """Key -> placement record, persisted as JSON (``path=None``: in memory only)."""

    def __init__(self, path: str | os.PathLike | None):
        self._lock = threading.Lock()
        self.recovered_from: str | None = None
        self._placements: dict[str, dict] = {}
        self._sig = None  # stat signature of the file the cache was read from
        if path is None:
            self.path: Path | None = None
            return
        self.path = Path(os.fspath(path)).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.path.with_name(self.path.name + ".lock")
        with self._lock:
            self._refresh()

    # ------------------------------------------------------------------ file I/O
    def _file_lock(self):
        return file_lock(self._lock_path)

    def _signature(self):
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        return (st.st_ino, st.st_size, st.st_mtime_ns)

    def _read(self) -> dict[str, dict]:
        """Parse the file (missing -> empty); raise _Damaged if it is unusable."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            doc = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise _Damaged(f"not UTF-8: {e}") from None
        except ValueError as e:
            raise _Damaged(f"invalid JSON: {e}") from None
        if not isinstance(doc, dict):
            raise _Damaged(f"expected a JSON object, got {type(doc).__name__}")
        if doc.get("version") != LOG_VERSION:
            raise _Damaged(f"unsupported version {doc.get('version')!r} (expected {LOG_VERSION})")
        placements = doc.get("placements")
        if not isinstance(placements, dict):
            raise _Damaged("\"placements\" is not an object")
        for key, rec in placements.items():
            if not isinstance(rec, dict):
                raise _Damaged(f"placement {key!r} is not an object")
        return placements

    def _load_locked(self) -> dict[str, dict]:
        """Read the file; caller holds the file lock.  Recovers a damaged file."""
        sig = self._signature()
        try:
            placements = self._read()
        except _Damaged as damage:
            aside = aside_name(self.path)
            os.replace(self.path, aside)
            self.recovered_from = str(aside)
            logger.warning(
                "placement log %s is damaged (%s); moved it aside to %s and started empty",
                self.path, damage, aside,
            )
            placements, sig = {}, None
        self._placements, self._sig = placements, sig
        return placements

    def _refresh(self) -> None:
        """Re-read the file if another writer changed it since we last looked."""
        sig = self._signature()
        if sig is not None and sig == self._sig:
            return
        if sig is None:
            self._placements, self._sig = {}, None
            return
        try:
            # Writers replace the file atomically, so an unlocked read is consistent.
            self._placements, self._sig = self._read(), sig
        except _Damaged:
            with self._file_lock():  # re-check under the lock, then recover
                self._load_locked()

    def _write_locked(self, placements: dict[str, dict]) -> None:
        doc = {"version": LOG_VERSION, "placements": placements}
        write_json_atomic(self.path, doc)
        self._placements, self._sig = placements, self._signature()

    # ------------------------------------------------------------------ API
    def get(self, key: str) -> dict | None:
        with self._lock:
            if self.path is not None:
                self._refresh()
            rec = self._placements.get(key)
            return None if rec is None else copy.deepcopy(rec)

    def put(self, key: str, record: dict) -> None:
        """Store ``record`` under ``key`` (replacing any previous one).

        A copy is stored, stamped with ``saved_at`` (unix time).
        """
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {type(key).__name__}")
        if not isinstance(record, dict):
            raise TypeError(f"record must be a dict, got {type(record).__name__}")
        rec = dict(record)
        rec["saved_at"] = time.time()
        try:
            rec = json.loads(json.dumps(rec))  # JSON-able check and deep copy
        except (TypeError, ValueError) as e:
            raise TypeError(f"placement record for {key!r} is not JSON-able: {e}") from None
        with self._lock:
            if self.path is None:
                self._placements[key] = rec
                return
            with self._file_lock():
                placements = dict(self._load_locked())
                placements[key] = rec
                self._write_locked(placements)

    def keys(self) -> list[str]:
        with self._lock:
            if self.path is not None:
                self._refresh()
            return sorted(self._placements)

    def __contains__(self, key: str) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        return len(self.keys())

    def __repr__(self) -> str:
        return f"PlacementLog({str(self.path) if self.path else None!r})"
