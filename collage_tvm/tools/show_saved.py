"""``collage-tvm show DIR``: what a saved build holds, read from its manifest alone (nothing
is loaded or compiled): what shipped and why, its inputs and outputs, which backend serves
each part (a dynamic model: which library serves each shape of its ranges, and the shapes
served by a file compiled for them), and the final check's latencies at the shapes it ran.
The placement picture needs the placement JSON (``collage-tvm optimize MODEL -o FILE``)."""
from __future__ import annotations

import math
from pathlib import Path


def _dims(spec: dict) -> str:
    shape = spec.get("shape")
    text = "?" if shape is None else ", ".join(str(d) for d in shape)
    return f"{spec.get('name', '?')} {spec.get('dtype', '?')}[{text}]"


def _ms(value) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.3f}"


def _dynamic_lines(entry: dict) -> list:
    from ..dynamic.shapes import ShapeRanges, point_key

    lines = []
    ranges = ShapeRanges.from_json(entry["ranges"])
    lines.append(f"ranges: {ranges.describe()}")
    table = entry.get("table", {})
    close = entry.get("close") or {}
    exact = entry.get("exact") or {}
    special = entry.get("special")
    lines.append("served per shape (a call goes to the least point at or above its sizes, the "
                 "largest beyond them):")
    width = max((len(k) for k in table), default=0)
    for key, lib in table.items():
        note = ""
        if key in close:
            note = f"  (within a few percent of {', '.join(x for x in close[key] if x != lib)}:" \
                   " the first calls race them)"
        lines.append(f"  {key:<{width}}  {lib}{note}")
    for key, lib in exact.items():
        lines.append(f"  exactly {key}: the file compiled by {lib} for those shapes")
    if special:
        lines.append(f"  exactly {point_key(special)}: Collage's build at the optimum"
                     + (f" ({entry['static']}/)" if entry.get("static") else ""))
    return lines


def describe(path) -> str:
    """The text ``collage-tvm show DIR`` prints for the saved build at ``path``; raises the
    loader's ``ArtifactError`` (naming the problem) for a directory that is not one."""
    from ..artifact.load import _read_manifest

    path = Path(path)
    m = _read_manifest(path)
    versions = m.get("versions", {})
    machine = m.get("machine", {})
    placement = m.get("placement", {})
    lines = [f"{path}: a collage-tvm build (collage-tvm {versions.get('collage_tvm', '?')}, "
             f"tvm {versions.get('tvm', '?')}), saved {m.get('created', '?')} on "
             f"{machine.get('cpu', '?')} for {m.get('device', '?')}; accuracy "
             f"{m.get('accuracy', 'f32')}",
             f"shipped: {placement.get('shipped', '?')}"]
    dynamic = [e for e in m.get("regions", []) if e.get("format") == "dynamic" and "ranges" in e]
    at, inputs = "", m.get("inputs", [])
    if dynamic:
        from ..dynamic.shapes import ShapeRanges, point_key

        ranges = ShapeRanges.from_json(dynamic[0]["ranges"])
        at = point_key(ranges.opt())
        # (the export's names of the dimensions: the signature's may be TVM's spelling)
        dims = {n: d for n, _, d in ranges.inputs}
        inputs = [{**i, "shape": dims.get(i.get("name"), i.get("shape"))} for i in inputs]
    whole = placement.get("whole_model")
    if whole:
        lines.append(f"  {'at the optimum (' + at + ') ' if at else ''}{whole.get('backend')}: "
                     f"{whole.get('why', '')}")
    lines.append("inputs: " + "; ".join(_dims(s) for s in inputs))
    lines.append("outputs: " + "; ".join(_dims(s) for s in m.get("outputs", [])))
    backends = m.get("backends", {})
    if backends:
        lines.append("backends: " + ", ".join(
            f"{n} ({b.get('version', '?')}, {b.get('regions', 0)} region(s))"
            for n, b in backends.items()))
    for entry in dynamic:
        lines.extend(_dynamic_lines(entry))
    ops = placement.get("ops_per_backend") or {}
    if ops and not dynamic:
        lines.append("operators per backend: " + ", ".join(f"{b} {n}" for b, n in ops.items()))
    groups = placement.get("groups") or []
    if groups:
        lines.append(f"{len(groups)} groups (library calls or TVM kernels)"
                     + (f", {len(placement['concurrent_stages'])} concurrent stage(s)"
                        if placement.get("concurrent_stages") else ""))
    latency = m.get("latency_ms") or {}
    comparison = m.get("comparison") or {}
    timed = {k: v for k, v in latency.items() if v is not None and math.isfinite(v)}
    if timed:
        lines.append("the final check's latencies (ms" + (f", at {at}" if at else "") + "):")
        for name, ms in sorted(timed.items(), key=lambda kv: kv[1]):
            c = comparison.get(name, {})
            note = ""
            if c.get("outside_budget"):
                note = f"  ({c['outside_budget']}, outside the budget: {c.get('advice', '')})"
            elif c.get("match") is False:
                note = "  (wrong outputs: not a contender)"
            elif c.get("timed_once"):
                note = "  (timed once: its first timed run was past the cutoff, >10x slower)"
            lines.append(f"  {name:<28} {_ms(ms)}{note}".rstrip())
    lines.append("(the placement picture: collage-tvm optimize MODEL -o placement.json, then "
                 "collage-tvm show placement.json)")
    return "\n".join(lines)
