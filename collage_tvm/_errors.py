"""A failure's reason in one line, as reports, logs and errors name it."""
from __future__ import annotations


def first_line(err: BaseException, limit: int | None = None) -> str:
    """``Type: first line of the message`` (the line cut at ``limit`` characters)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:limit] if text else ''}"
