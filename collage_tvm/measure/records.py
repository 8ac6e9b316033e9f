"""What the cost DB holds (``db.CostDB``): a measurement (``CostRecord``), the kinds of
failure, and a record as JSON (``CostDB.export_json`` / ``import_json``'s file format)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from .timing import cut_before_second_look

EXPORT_FORMAT = "collage_tvm.costdb"
EXPORT_VERSION = 1


@dataclass
class CostRecord:
    """One cached measurement."""

    cost_ms: float  # math.inf for a failed candidate
    reason: str | None  # why it failed / was cut short, else None
    measured_at: float  # unix time
    extra: dict = field(default_factory=dict)  # free-form JSON-able info

    @property
    def failed(self) -> bool:
        return math.isinf(self.cost_ms)

    @property
    def failure_kind(self) -> str | None:
        """None for a measurement; else "timeout", "memory", "crash" (the measuring process
        died) or "cannot-run" (the library refused or failed on it: ``failure_kind``)."""
        return failure_kind(self.reason) if self.failed else None

    @property
    def retry(self) -> bool:
        """A failure of the moment (timeout, out of memory, a crashed measuring process) not
        yet retried: measured again once by a later run; a real "cannot run" stays. So is a
        cost cut short on a first run that ``timing.time_main`` now gives a second look
        (``timing.cut_before_second_look``): a lazy start recorded as the candidate's cost."""
        if not self.failed:
            return cut_before_second_look(self.reason)
        return self.failure_kind in TRANSIENT and not self.extra.get("retried")


# Failures of the moment rather than of the candidate: retried once (``CostRecord.retry``).
TRANSIENT = ("timeout", "memory", "crash")
FAILURE_KINDS = (*TRANSIENT, "cannot-run")


def failure_kind(reason: str | None) -> str:
    """The kind of a failed measurement's ``reason`` (``CostRecord.failure_kind``): the
    measuring worker writes "timed out after N s" and "measurement process died (...)"."""
    text = (reason or "").lower()
    if text.startswith("timed out") or "timeout" in text.split(":")[0]:
        return "timeout"
    if "memoryerror" in text or "out of memory" in text or "cannot allocate memory" in text:
        return "memory"
    if text.startswith("measurement process died") or "sigkill" in text or "sigsegv" in text:
        return "crash"
    return "cannot-run"


# Signals that say the library itself crashed on the candidate (not the machine killing a
# process short of memory, SIGKILL): that library is not run on this model in the search's
# own process (``Measurer.crashed``), where the same crash would take the search down.
CRASH_SIGNALS = ("SIGSEGV", "SIGABRT", "SIGBUS", "SIGILL", "SIGFPE")


def crash_signal(reason: str | None) -> str | None:
    """The signal of a measuring process the library crashed (``CRASH_SIGNALS``), or None."""
    text = reason or ""
    if not text.startswith("measurement process died"):
        return None
    return next((s for s in CRASH_SIGNALS if s in text), None)


def check_cost(cost_ms) -> float:
    try:
        cost = float(cost_ms)
    except (TypeError, ValueError):
        raise TypeError(f"cost_ms must be a number, got {cost_ms!r}") from None
    if math.isnan(cost):
        raise ValueError("cost_ms must not be NaN (use math.inf for a failed candidate)")
    return cost


def dump_extra(extra) -> str:
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise TypeError(f"extra must be a dict, got {type(extra).__name__}")
    try:
        return json.dumps(extra, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise TypeError(f"extra is not JSON-able: {e}") from None


def load_extra(text: str | None) -> dict:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {"_unparsed": text}
    return value if isinstance(value, dict) else {"_value": value}


def cost_to_json(cost: float):
    if math.isinf(cost):
        return "inf" if cost > 0 else "-inf"
    return cost


def cost_from_json(value, where: str) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{where}: cost_ms must be a number or \"inf\", got {value!r}")
    if isinstance(value, (int, float)):
        cost = float(value)
    elif isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "infinity", "+infinity"):
        cost = math.inf
    elif isinstance(value, str) and value.strip().lower() in ("-inf", "-infinity"):
        cost = -math.inf
    else:
        raise ValueError(f"{where}: cost_ms must be a number or \"inf\", got {value!r}")
    if math.isnan(cost):
        raise ValueError(f"{where}: cost_ms is NaN")
    return cost


def import_rows(doc, where: str) -> list[tuple]:
    """The rows of an export (``CostDB.export_json``) read back, checked: a malformed
    document raises ``ValueError`` naming ``where`` and the problem."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: expected a JSON object with \"records\", got {type(doc).__name__}")
    fmt = doc.get("format", EXPORT_FORMAT)
    if fmt != EXPORT_FORMAT:
        raise ValueError(f"{where}: not a cost database export (format {fmt!r})")
    version = doc.get("version")
    if version != EXPORT_VERSION:
        raise ValueError(f"{where}: unsupported export version {version!r} (expected {EXPORT_VERSION})")
    records = doc.get("records")
    if not isinstance(records, list):
        raise ValueError(f"{where}: \"records\" must be a list")
    rows = []
    for i, r in enumerate(records):
        at = f"{where}: record {i}"
        if not isinstance(r, dict):
            raise ValueError(f"{at}: expected an object, got {type(r).__name__}")
        for name in ("backend", "version", "key", "device"):
            if name not in r:
                raise ValueError(f"{at}: missing field {name!r}")
            if not isinstance(r[name], str):
                raise ValueError(f"{at}: field {name!r} must be a string, got {r[name]!r}")
        if "cost_ms" not in r:
            raise ValueError(f"{at}: missing field 'cost_ms'")
        cost = cost_from_json(r["cost_ms"], at)
        reason = r.get("reason")
        if reason is not None and not isinstance(reason, str):
            raise ValueError(f"{at}: field 'reason' must be a string or null, got {reason!r}")
        measured_at = r.get("measured_at")
        if isinstance(measured_at, bool) or not isinstance(measured_at, (int, float)) or math.isnan(measured_at):
            raise ValueError(f"{at}: field 'measured_at' must be a number (unix time), got {measured_at!r}")
        extra = r.get("extra", {})
        if extra is None:
            extra = {}
        if not isinstance(extra, dict):
            raise ValueError(f"{at}: field 'extra' must be an object, got {type(extra).__name__}")
        rows.append(
            (r["backend"], r["version"], r["key"], r["device"], cost, reason, float(measured_at),
             json.dumps(extra, sort_keys=True))
        )
    return rows
