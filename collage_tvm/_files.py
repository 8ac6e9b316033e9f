"""File helpers shared by the cost DB and the placement log: a cross-process lock on a side
file, the name a damaged file is moved aside to, and an atomic JSON write."""
from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - non-POSIX: no cross-process lock
    fcntl = None  # type: ignore[assignment]


def aside_name(path: Path) -> Path:
    """``<name>.corrupt-<stamp>[-n]`` next to ``path``, a name no file has yet."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    candidate = path.with_name(f"{path.name}.corrupt-{stamp}")
    n = 1
    while candidate.exists():
        candidate = path.with_name(f"{path.name}.corrupt-{stamp}-{n}")
        n += 1
    return candidate


@contextmanager
def file_lock(lock_path: Path) -> Iterator[None]:
    """Exclusive advisory lock on a side file (never on the data file itself: for SQLite,
    closing any descriptor of the DB would drop its own POSIX locks)."""
    if fcntl is None:  # pragma: no cover
        yield
        return
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def write_json_atomic(path: Path, doc) -> None:
    """Write ``doc`` as JSON to ``path`` so that readers see the old file or the new one,
    never half of it: a temp file in the same folder, synced, then ``os.replace``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
