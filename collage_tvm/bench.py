"""``collage-tvm bench``: Collage beside the builds a user would otherwise ship, in one run.

For each model of ``collage_tvm.models``: export it to ONNX, run the Collage search
(op-level, and two-level with ``--graph-level``) with the never-slower comparison, and
check our glue: the model placed wholly on ONNX Runtime through collage-tvm against
plain ONNX Runtime on the same ONNX file, timed interleaved in one process.
Writes ``results.json`` and ``results.md`` into the output folder.
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import time

import numpy as np

logger = logging.getLogger("collage_tvm")


def ort_glue_overhead(onnx_path: str, target="llvm") -> dict:
    """Plain onnxruntime on ``onnx_path`` vs the same model wholly on onnxruntime via collage-tvm."""
    import tvm
    from tvm import relax

    from .baselines import graph_lib_groups, interleaved, run_outputs
    from .build import compile_placement
    from .frontend import load_model, normalize_for_collage
    from .graph import DataflowGraph
    from .graph.subgraph import random_inputs
    from .registry import get_backend
    from .target import make_target, target_device

    target = make_target(target)
    backend = get_backend("onnxruntime")
    ok, why = backend.available()
    if not ok:
        return {"error": f"onnxruntime unavailable: {why}"}
    graph = DataflowGraph(normalize_for_collage(load_model(onnx_path))["main"])
    groups = graph_lib_groups(graph, backend)
    if any(g.backend != "onnxruntime" for g in groups):
        return {"error": "onnxruntime cannot run every operator of the model: "
                         + ", ".join(sorted({graph.nodes[i].op_name for g in groups
                                             if g.backend != "onnxruntime" for i in g.nodes}))}
    ex, _ = compile_placement(graph, groups, {"tvm": get_backend("tvm"),
                                              "onnxruntime": backend}, target)
    dev = target_device(target)
    vm = relax.VirtualMachine(ex, dev)
    arrays = random_inputs(graph.params)
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    sess = backend.get_lowering().session(open(onnx_path, "rb").read())
    feeds = {i.name: a for i, a in zip(sess.get_inputs(), arrays)}
    ours, plain = run_outputs(vm, args), sess.run(None, feeds)
    max_err = max(float(np.max(np.abs(a - b))) for a, b in zip(ours, plain))
    ms = interleaved({"plain": lambda: sess.run(None, feeds), "collage": lambda: vm["main"](*args)})
    return {"plain_onnxruntime_ms": ms["plain"], "collage_onnxruntime_ms": ms["collage"],
            "overhead": ms["collage"] / ms["plain"] - 1.0, "max_err": max_err,
            "match": bool(all(np.allclose(a, b, rtol=1e-3, atol=1e-3) for a, b in zip(ours, plain)))}


def machine() -> dict:
    from .target import _cpu_model, host_cores

    import onnxruntime
    import torch
    import tvm

    info = {"cpu": _cpu_model(), "cores": host_cores(), "python": platform.python_version(),
            "tvm": tvm.__version__, "onnxruntime": onnxruntime.__version__,
            "torch": torch.__version__}
    try:
        import openvino

        info["openvino"] = openvino.__version__.split("-")[0]
    except ImportError:
        pass
    return info


def model_onnx(name: str, size: str, out_dir: str) -> str:
    """Export ``name`` (a zoo model at ``size``, or a ``collage_tvm.models`` name) to ONNX."""
    from . import models, zoo

    if name in zoo.ZOO:
        return zoo.export_onnx(name, size, os.path.join(out_dir, f"{name}_{size}.onnx"))
    if name in models.MODELS:
        return models.export_onnx(name, os.path.join(out_dir, f"{name}.onnx"))
    raise ValueError(f"unknown model {name!r}; known: {', '.join(known_models())}")


def known_models() -> list:
    from . import models, zoo

    return sorted(set(zoo.names()) | set(models.MODELS))


def bench_model(name: str, out_dir: str, backends, db, graph_level: bool, budget: float,
                glue: bool = True, size: str = "paper") -> dict:
    from .build import optimize

    path = model_onnx(name, size, out_dir)
    entry: dict = {"model": name, "size": size}
    # The two-level run's comparison already holds the op-level placement ("collage-op-level")
    # whenever the graph-level search changed it: one run covers both levels.
    for gl in [graph_level]:
        label = "two-level" if gl else "op-level"
        print(f"\n== {name}: Collage {label} ({', '.join(backends)})", flush=True)
        t0 = time.perf_counter()
        res = optimize(path, "llvm", backends, db=db, compare=True, graph_level=gl,
                       budget=budget, on_generation=_print_generation if gl else None)
        rep = res.report
        entry[label] = {"comparison": rep.comparison, "shipped": rep.shipped,
                        "times": rep.times, "wall_s": time.perf_counter() - t0,
                        "measured": rep.distinct_measured, "db_hits": rep.db_hits,
                        "from_log": rep.placement_from_log,
                        "ops_per_backend": rep.ops_per_backend,
                        "graph_level": {k: v for k, v in rep.graph_level.items() if k != "history"}}
        _print_comparison(rep.comparison, rep.shipped)
    if glue and "onnxruntime" in backends:
        print(f"\n== {name}: glue overhead, wholly on onnxruntime vs plain onnxruntime", flush=True)
        entry["glue"] = ort_glue_overhead(path)
        print(json.dumps(entry["glue"], indent=1))
    return entry


def _print_generation(e) -> None:
    print(f"  generation {e['gen']:>3}: best {e['best_ms']:.3f} ms "
          f"({e['evaluated']} placements measured, {e['elapsed_s']:.0f} s)", flush=True)


def _print_comparison(comparison: dict, shipped: str) -> None:
    base = comparison.get("collage", {}).get("ms", math.nan)
    for n, r in comparison.items():
        flag = "  <- shipped" if n == shipped else ""
        print(f"  {n:<18} {r['ms']:>10.3f} ms  x{r['ms'] / base:>6.2f}  "
              f"match={r['match']}{flag}", flush=True)


def markdown(results: dict) -> str:
    lines = [f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores; "
             f"TVM {results['machine']['tvm']}, onnxruntime {results['machine']['onnxruntime']}, "
             f"OpenVINO {results['machine'].get('openvino', '-')}, torch {results['machine']['torch']}",
             ""]
    for m in results["models"]:
        for level in ("op-level", "two-level"):
            if level not in m:
                continue
            r = m[level]
            comp = r["comparison"]
            lines += [f"### {m['model']}, Collage {level} (shipped: {r['shipped']})", "",
                      "| build | latency ms | relative to Collage | matches tvm-only |",
                      "|---|---:|---:|---|"]
            base = comp.get("collage", {}).get("ms", math.nan)
            for n, c in comp.items():
                same = f" (same placement as {c['same_as']})" if c.get("same_as") else ""
                lines.append(f"| {n}{same} | {c['ms']:.3f} | {c['ms'] / base:.2f}x | "
                             f"{'yes' if c['match'] else 'NO'} |")
            t = r["times"]
            lines += ["", "Search: " + ", ".join(f"{k} {v:.1f} s" for k, v in t.items()), ""]
        if "glue" in m and "overhead" in m["glue"]:
            g = m["glue"]
            lines += [f"Glue: plain onnxruntime {g['plain_onnxruntime_ms']:.3f} ms, through "
                      f"collage-tvm {g['collage_onnxruntime_ms']:.3f} ms "
                      f"({g['overhead'] * 100:+.1f}%)", ""]
    return "\n".join(lines)


def run(models, out_dir: str, backends, db=None, graph_level: bool = False,
        budget: float = 300.0, size: str = "paper") -> dict:
    os.makedirs(out_dir, exist_ok=True)
    results = {"machine": machine(), "backends": list(backends), "models": []}
    for name in models:
        results["models"].append(bench_model(name, out_dir, backends, db, graph_level, budget,
                                             size=size))
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(results))
    return results
