"""The machine's other work: the share of its CPU other processes took while builds were
timed against each other (``OtherLoad``); past ``BUSY_SHARE`` a verdict is unsure."""
from __future__ import annotations

import time

#: Share of the machine's CPU other processes may take while builds are timed against each
#: other before the verdict counts as unsure (the five timm rows first searched beside other
#: work shipped builds 0.61-0.87x of the best; docs/COVERAGE.md, "Read with care").
BUSY_SHARE = 0.15


def _cpu_busy_s() -> tuple[float, int] | None:
    """(busy CPU seconds of the whole machine since boot, its CPUs), from /proc/stat:
    user, nice, system, irq, softirq and steal (a VM's neighbours)."""
    import os

    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
        ticks = [int(v) for v in lines[0].split()[1:9]]
        cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        user, nice, system, _idle, _iowait, irq, softirq, steal = ticks
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"), cpus
    except (OSError, ValueError, IndexError):
        return None


def _own_cpu_s() -> float:
    import os

    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class OtherLoad:
    """``with OtherLoad() as load: ...``; then ``load.share``: the share of the machine's
    CPU that went to other processes while the block ran (NaN where /proc/stat cannot be
    read): about 0 on a quiet machine, 1 when others kept every core busy. Timing builds
    against each other, this process's own threads (and the children it waited for) are
    not counted."""

    share = float("nan")

    def __enter__(self) -> "OtherLoad":
        self._t0, self._busy0, self._own0 = time.perf_counter(), _cpu_busy_s(), _own_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        wall = time.perf_counter() - self._t0
        busy = _cpu_busy_s()
        if self._busy0 is None or busy is None or wall <= 0:
            return
        others = (busy[0] - self._busy0[0]) - (_own_cpu_s() - self._own0)
        self.share = min(1.0, max(0.0, others / (wall * max(1, busy[1]))))

    @property
    def busy(self) -> bool:
        return self.share > BUSY_SHARE
