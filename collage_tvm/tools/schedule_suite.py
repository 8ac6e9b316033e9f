"""``collage-tvm bench --suite torchvision --schedule``: multi-branch models run with a
concurrent schedule (issue #80, part 4).

Per model and batch: the model exported to ONNX (static shape) and searched at the op level
(the graph-level search puts a whole CNN on one graph library: one group, nothing to
schedule); the placement's schedule measured (``schedule.plan``); then, timed
interleaved in this process on the same inputs, the placement built sequentially (how it
runs today), the same placement built with the schedule (``schedule.compile_scheduled``),
and the same ONNX file on ONNX Runtime, OpenVINO at f32 and at its default precision, and
PyTorch eager, every output checked against PyTorch's and the concurrent build's against
the sequential one's. A row per (model, batch).
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

from .._errors import first_line

SCHEDULE_MODELS = ("googlenet", "inception_v3", "squeezenet1_1", "nasnet", "randwire",
                   "detection_head")
BATCHES = (1, 4)
# The placement as it runs today is the row's "collage" (the runoff's mark), beside it the
# same placement built with its schedule.
SEQUENTIAL, CONCURRENT = "collage", "collage (concurrent)"


def run_model(name: str, batch: int, out_dir: str, options, db, log=print) -> dict:
    """The row of ``name`` at ``batch`` (see the module)."""
    import numpy as np
    import torch
    import tvm
    from tvm import relax

    from ..build import search
    from ..byoc import compile_placement
    from ..check import run_outputs
    from ..graph import DataflowGraph
    from ..placement import order_groups
    from ..schedule.concurrent import compile_staged
    from ..schedule.plan import plan
    from ..schedule.split import remerge, split_for_schedule
    from . import bench, suites

    model, (example,) = _model(name)
    x = torch.randn(batch, *example.shape[1:])
    path = os.path.join(out_dir, f"{name}_b{batch}.onnx")
    os.makedirs(out_dir, exist_ok=True)
    torch.onnx.export(model, (x,), path, input_names=["x"], opset_version=17, dynamo=False)
    row = {"model": name, "batch": batch, "shape": "x".join(map(str, x.shape))}
    t0 = time.perf_counter()
    # the op-level placement: the graph-level search puts a whole CNN on one graph library
    # at these sizes (one group, nothing to schedule)
    # and no final check: its placement, not the file on a library that may beat it, is what
    # the schedule runs (the frameworks are timed beside it below)
    options = dataclasses.replace(options, graph_level=False, compare=False)
    found = search(path, "llvm", options, db, os.path.join(out_dir, "placements.json"), None,
                   None, None)
    row["search_s"] = round(time.perf_counter() - t0, 1)
    row["search_shipped"] = found.report.shipped
    graph = found.graph or DataflowGraph.from_module(found.module)
    groups = found.placement.groups
    if not groups:
        row["error"] = "the search kept no placement of groups (the whole model on one library)"
        return row
    # (its graph-library regions cut at their branches, put back where run in turn)
    pieces, origin = split_for_schedule(graph, groups, found.backends)
    p = plan(graph, pieces, found.backends, found.target)
    row["plan"] = p.summary()
    row["groups"] = len(groups)
    log(f"  plan: {p.summary()}")
    seq, _ = compile_placement(graph, order_groups(graph, groups), found.backends, found.target,
                               keep=True)
    builds = {}
    if p.concurrent_stages:
        staged, stages = remerge(p.ordered, p.schedule, origin)
        builds[CONCURRENT], _ = compile_staged(graph, order_groups(graph, staged), stages,
                                               found.backends, found.target)
    rows = bench.torch_frameworks(model, (x,), path, seq, suites._framework_check(1e-3, 1e-4),
                                  label=f"{name} b{batch}", more_builds=builds)
    if CONCURRENT in builds:  # the concurrent build's outputs against the sequential one's
        xs = [tvm.runtime.tensor(x.numpy())]
        got = [run_outputs(relax.VirtualMachine(exe, tvm.cpu()), xs)
               for exe in (builds[CONCURRENT], seq)]
        row["concurrent_max_diff"] = float(max(np.abs(np.asarray(a) - np.asarray(b)).max()
                                               for a, b in zip(*got)))
    row["frameworks"] = {n: {k: v for k, v in r.items() if k != "batches"}
                         for n, r in rows.items()}
    row.update(_ratios(rows))
    return row


def _model(name: str) -> tuple:
    """(module, (example input,)): a torchvision model at its usual size, or one defined in
    code at its paper size (the zoo's nasnet, IOS's randwire and detection head)."""
    from . import suites, zoo

    build = zoo.IOS.get(name) or (zoo.ZOO[name] if name in zoo.ZOO else None)
    if build is None:
        return suites.torchvision_model(name, "usual")
    model, example = build("paper")
    return model, (example,)


def _ratios(rows: dict) -> dict:
    seq = rows.get(SEQUENTIAL, {}).get("ms", math.nan)
    conc = rows.get(CONCURRENT, {}).get("ms", math.nan)
    f32 = [r["ms"] for n, r in rows.items()
           if n in ("onnxruntime", "openvino", "pytorch") and r.get("match")]
    best = min(f32) if f32 else math.nan
    out = {"sequential_ms": seq, "concurrent_ms": conc,
           "speedup": seq / conc if conc == conc else math.nan,
           "best_framework_ms": best}
    shipped = min(v for v in (seq, conc) if v == v)
    out["shipped"] = CONCURRENT if conc == conc and conc < seq else SEQUENTIAL
    out["vs_best_framework"] = best / shipped if shipped == shipped else math.nan
    return out


def summary(rows: list) -> dict:
    ok = [r for r in rows if "error" not in r]
    ratios = [r["speedup"] for r in ok
              if r["speedup"] == r["speedup"]]
    return {"rows": len(rows), "errors": len(rows) - len(ok),
            "concurrent_faster": sum(r["shipped"] == CONCURRENT for r in ok),
            "median_speedup": statistics.median(ratios) if ratios else None,
            "vs_best_framework": {f"{r['model']} b{r['batch']}": round(r["vs_best_framework"], 3)
                                  for r in ok}}


def run(suite: str, names, out_dir: str, options, db, on_row=None, log=print) -> list:
    """Every (model, batch) of ``names`` x ``BATCHES``: the rows (``on_row(rows)`` after
    each one)."""
    rows = []
    for name in names:
        for batch in BATCHES:
            log(f"== {suite} {name} batch {batch} (schedule)")
            try:
                row = run_model(name, batch, os.path.join(out_dir, "models"), options, db, log)
            except Exception as err:  # noqa: BLE001 - a row with its error, the suite goes on
                row = {"model": name, "batch": batch, "error": first_line(err)}
            rows.append(row)
            log(f"  {_row_text(row)}")
            if on_row is not None:
                on_row(rows)
    return rows


def markdown(suite: str, rows: list, machine: dict | None = None) -> str:
    """The table of the rows: per (model, batch) the sequential and concurrent builds of
    Collage's placement, the best f32 framework, and their ratios."""
    from .suites import machine_line

    where = f" {machine_line(machine)}." if machine else ""
    lines = [f"Concurrent schedules ({suite}, issue #80).{where}", "",
             "| model | batch | groups (on branches) | concurrent stages | sequential ms | "
             "concurrent ms | speed-up (sequential / concurrent) | best f32 framework ms | "
             "best framework / faster build |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['batch']} | error: {r['error']} | | | | | | |")
            continue
        p = r.get("plan", {})
        cut = r.get("groups", p.get("groups"))
        cut = f"{cut} cut into {p.get('groups')}" if cut != p.get("groups") else f"{cut}"
        lines.append(
            f"| {r['model']} | {r['batch']} | {cut} ({p.get('branches')}) | "
            f"{len(p.get('concurrent_stages', []))} | {r['sequential_ms']:.3f} | "
            f"{_ms(r['concurrent_ms'])} | {_fmt(r['speedup'])} | "
            f"{r['best_framework_ms']:.3f} | {r['vs_best_framework']:.3f}x |")
    sm = summary(rows)
    lines += ["", f"The concurrent build faster than the sequential one in "
              f"{sm['concurrent_faster']} of {sm['rows'] - sm['errors']} rows; median "
              f"sequential / concurrent {_fmt(sm['median_speedup'])}."]
    return "\n".join(lines) + "\n"


def _ms(v) -> str:
    return "—" if v is None or v != v else f"{v:.3f}"


def _fmt(v) -> str:
    return "—" if v is None or v != v else f"{v:.3f}x"


SCHEDULE_SUITES = {"torchvision": SCHEDULE_MODELS}


def _row_text(row: dict) -> str:
    if "error" in row:
        return f"error: {row['error']}"
    return (f"sequential {row['sequential_ms']:.3f} ms, concurrent {row['concurrent_ms']:.3f} ms "
            f"({row['speedup']:.3f}x), best framework "
            f"{row['best_framework_ms']:.3f} ms ({row['vs_best_framework']:.3f}x)")
