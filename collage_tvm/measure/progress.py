"""The progress bar of a long measurement: on a terminal a bar, on a log file or a pipe (CI,
nohup) a line every 30 s."""
from __future__ import annotations


class _LineStream:
    """tqdm's output for a log file or pipe: each refresh on a line of its own."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(total: int, enabled: bool, desc: str = "measuring candidates"):
    """A progress bar on a terminal; on a log file or pipe, a progress line every 30 s."""
    import sys

    from tqdm.auto import tqdm

    if enabled and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
        return tqdm(total=total, desc=desc, unit="cand", file=_LineStream(sys.stderr),
                    mininterval=30.0, ascii=True, ncols=100, leave=False)
    return tqdm(total=total, desc=desc, unit="cand", disable=None if enabled else True,
                leave=False, dynamic_ncols=True)
