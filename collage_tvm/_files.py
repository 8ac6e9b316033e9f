"""File helpers shared by the cost DB and the placement log: a cross-process lock on a side
file, and the name a damaged file is moved aside to."""
from __future__ import annotations

import os
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
