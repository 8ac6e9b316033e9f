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


logger = logging.getLogger("collage_tvm")


def ort_glue_overhead(onnx_path: str, target="llvm") -> dict:
    """Plain onnxruntime on ``onnx_path`` vs the same model wholly on onnxruntime via collage-tvm."""
    import tvm
    from tvm import relax

    from .baselines import compare_outputs, graph_lib_groups, interleaved, run_outputs
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
    match, max_err = compare_outputs(run_outputs(vm, args), sess.run(None, feeds))
    ms = interleaved({"plain": lambda: sess.run(None, feeds), "collage": lambda: vm["main"](*args)})
    return {"plain_onnxruntime_ms": ms["plain"], "collage_onnxruntime_ms": ms["collage"],
            "overhead": ms["collage"] / ms["plain"] - 1.0, "max_err": max_err, "match": match}


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


def model_and_input(name: str, size: str):
    """(torch module, example input tensor): the same model and input the ONNX file holds."""
    from . import models, zoo

    if name in zoo.ZOO:
        return zoo.get(name, size)
    model, shape = models.MODELS[name]()
    return model, models.example_input(name, shape)


def frameworks(name: str, size: str, onnx_path: str, collage_executable) -> dict:
    """The frameworks a user would pick instead, at their documented latency settings and
    this process's core count, timed interleaved with the shipped Collage build; every
    output is checked against PyTorch's (rtol/atol 1e-3).

    PyTorch eager (``inference_mode``), ONNX Runtime (all graph optimizations), OpenVINO
    (latency hint, f32 precision). torch.compile is not here yet.
    """
    import torch
    import tvm
    from tvm import relax

    from .baselines import compare_outputs, interleaved, run_outputs
    from .target import host_cores

    torch.set_num_threads(host_cores())
    model, x = model_and_input(name, size)
    with torch.inference_mode():
        ref = model(x)
    ref = [t.numpy() for t in (ref if isinstance(ref, (tuple, list)) else [ref])]
    runs: dict = {}
    outs: dict = {}

    def eager():
        with torch.inference_mode():
            return model(x)

    runs["pytorch"] = eager
    outs["pytorch"] = ref
    x_np = x.numpy()
    try:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = host_cores()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        sess = ort.InferenceSession(onnx_path, opts, providers=["CPUExecutionProvider"])
        feed = {sess.get_inputs()[0].name: x_np}
        runs["onnxruntime"] = lambda: sess.run(None, feed)
        outs["onnxruntime"] = sess.run(None, feed)
    except Exception as err:  # noqa: BLE001 - a missing framework is reported, not fatal
        outs["onnxruntime"] = f"{type(err).__name__}: {err}"
    try:
        import openvino as ov

        compiled = ov.Core().compile_model(onnx_path, "CPU", {
            "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": host_cores(),
            "INFERENCE_PRECISION_HINT": "f32"})
        req = compiled.create_infer_request()
        runs["openvino"] = lambda: req.infer([x_np])
        outs["openvino"] = [req.infer([x_np])[o] for o in compiled.outputs]
    except Exception as err:  # noqa: BLE001
        outs["openvino"] = f"{type(err).__name__}: {err}"
    dev = tvm.cpu()
    vm = relax.VirtualMachine(collage_executable, dev)
    args = [tvm.runtime.tensor(x_np, dev)]
    main = vm["main"]
    runs["collage"] = lambda: main(*args)
    outs["collage"] = run_outputs(vm, args)
    ms = interleaved(runs)
    result = {}
    for fw, out in outs.items():
        if isinstance(out, str):
            result[fw] = {"error": out, "ms": math.nan, "match": False}
            continue
        match, max_err = compare_outputs(out, ref)
        result[fw] = {"ms": ms[fw], "match": match, "max_err": max_err}
    return result


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
        print(f"\n== {name}: frameworks beside the shipped Collage build", flush=True)
        entry["frameworks"] = frameworks(name, size, path, res.executable)
        for fw, r in entry["frameworks"].items():
            print(f"  {fw:<12} {r['ms']:>10.3f} ms  match={r['match']}"
                  + (f"  ({r['error']})" if r.get("error") else ""), flush=True)
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
        if "frameworks" in m:
            fw = m["frameworks"]
            base = fw["collage"]["ms"]
            others = [r["ms"] for n, r in fw.items() if n != "collage" and r["match"]]
            best = min(others, default=math.nan)
            lines += [f"Frameworks (interleaved with the shipped Collage build; speedup = their "
                      f"latency / Collage's; best other: {best / base:.2f}x):", "",
                      "| framework | latency ms | Collage speedup | matches PyTorch |",
                      "|---|---:|---:|---|"]
            for n, r in fw.items():
                lines.append(f"| {n} | {r['ms']:.3f} | {r['ms'] / base:.2f}x | "
                             f"{'yes' if r['match'] else 'NO'} |")
            lines.append("")
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
