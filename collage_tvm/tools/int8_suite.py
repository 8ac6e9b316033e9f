"""``collage-tvm bench --suite torchvision|timm --int8``: quantized models as users ship them
(issue #78, part 4).

Per model (random weights, its usual input size), two rows:

- **qdq file**: the f32 export quantized as ONNX Runtime's docs show (``quantize_static``,
  QDQ, u8 activations, s8 weights, ``CALIBRATION_BATCHES`` random calibration batches),
  then ``collage_tvm.optimize(file)`` with no other argument (judged in its own precision),
  saved and loaded back, timed interleaved beside that file on ONNX Runtime and on OpenVINO
  (whose CPU plugin runs a QDQ file on its int8 kernels); every output judged against ONNX
  Runtime's run of the file within ``precision.INT8_MODEL_TOLERANCE`` of the output scale.
- **f32 under --accuracy int8**: the f32 export built with ``accuracy="int8"`` (Collage
  quantizes it with accuracy control: ``collage_tvm.quantize``), saved and loaded, timed
  beside OpenVINO at its default precision on the f32 file (bf16 on a CPU with bf16
  instructions), the ONNX-Runtime-quantized file on ONNX Runtime and OpenVINO, and the f32
  file on ONNX Runtime; every output judged against ONNX Runtime's f32 run within the
  budget (5e-2 of the output scale).

Timed as the final check times (``measure.timing.interleaved``, rounds in a fresh order
each, the figures taken round by round). ``summary`` gives the issue's figures.
"""
from __future__ import annotations

import math
import os
import statistics
import time

import numpy as np

from .._errors import first_line

INT8_SUITES = {
    "torchvision": ("resnet18", "resnet50", "mobilenet_v2", "mobilenet_v3_large",
                    "efficientnet_b0", "densenet121", "squeezenet1_1", "shufflenet_v2_x1_0",
                    "regnet_y_400mf", "googlenet"),
    "timm": ("resnet18", "efficientnet_b0", "mobilenetv3_large_100", "regnety_002",
             "ghostnet_100", "repvgg_a0", "densenet121", "convnext_atto",
             "vit_tiny_patch16_224", "deit_tiny_patch16_224"),
}
CALIBRATION_BATCHES = 8
ROUNDS = 9
BATCH_MS = 100.0
GOAL = 0.97
# The A/A control's suffix: a framework's second instance on the same file (``run_model``)
AA = "(A/A)"


def ort_quantized(f32_path: str, path: str, inputs: list, seed: int = 0) -> str:
    """``f32_path`` quantized as ONNX Runtime's docs show (QDQ, u8 activations, s8 weights,
    per tensor, MinMax on ``CALIBRATION_BATCHES`` random batches shaped as ``inputs``)."""
    import onnx
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static)

    proto = onnx.load(f32_path, load_external_data=False)
    weights = {t.name for t in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in weights]
    rng = np.random.default_rng(seed)
    feeds = [{n: rng.standard_normal(x.shape).astype(x.dtype) for n, x in zip(names, inputs)}
             for _ in range(CALIBRATION_BATCHES)]

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    quantize_static(f32_path, path, Reader(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return path


def nncf_quantized(f32_path: str, path: str, inputs: list, seed: int = 0) -> str | None:
    """``f32_path`` quantized as OpenVINO's docs show (NNCF's ``nncf.quantize``, its default
    preset, a transformer as one, on the same random batches as ``ort_quantized``): the
    int8 file an OpenVINO user makes. None where NNCF is not installed."""
    import onnx

    from ..quantize import _nncf, quantizers

    if not quantizers()["nncf"][0]:
        return None
    proto = onnx.load(f32_path)
    weights = {t.name for t in proto.graph.initializer}
    names = [i.name for i in proto.graph.input if i.name not in weights]
    rng = np.random.default_rng(seed)
    feeds = [{n: rng.standard_normal(x.shape).astype(x.dtype) for n, x in zip(names, inputs)}
             for _ in range(CALIBRATION_BATCHES)]
    onnx.save(_nncf(proto, feeds), path)
    return path


def _ort(path: str):
    import onnxruntime as ort

    from ..target import host_cores

    so = ort.SessionOptions()
    so.intra_op_num_threads = host_cores()
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return lambda *xs: sess.run(None, dict(zip(names, xs)))


_PROBED: dict = {}


def _crashes_openvino(path: str) -> str | None:
    """Why OpenVINO cannot be run on ``path`` in this process, or None: it compiled and ran
    the file once in a child process without dying (OpenVINO 2026.4.1 segfaults compiling
    torchvision densenet121's QDQ file, which would take the suite down with it)."""
    import subprocess
    import sys

    if path not in _PROBED:
        code = ("import sys, numpy as np, openvino as ov\n"
                "c = ov.Core().compile_model(sys.argv[1], 'CPU')\n"
                "r = c.create_infer_request()\n"
                "r.infer([np.zeros([int(d) for d in i.get_shape()], np.float32)"
                " for i in c.inputs])\n")
        try:
            done = subprocess.run([sys.executable, "-c", code, path], capture_output=True,
                                  timeout=600)
            rc = done.returncode
        except subprocess.TimeoutExpired:
            rc = None
        if rc is not None and rc < 0:
            import signal

            _PROBED[path] = (f"OpenVINO crashed ({signal.Signals(-rc).name}) compiling or "
                             "running this file in a child process")
        else:
            _PROBED[path] = None  # (an error is raised where it is run, as any other)
    return _PROBED[path]


def _ov(path: str, f32: bool = False):
    import openvino as ov

    crashed = _crashes_openvino(path)
    config = {"PERFORMANCE_HINT": "LATENCY"}
    if f32:
        config["INFERENCE_PRECISION_HINT"] = "f32"
    if crashed is None:
        try:
            compiled = ov.Core().compile_model(path, "CPU", config)
        except Exception as err:  # noqa: BLE001 - that column says why, the row goes on
            lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
            crashed = ("OpenVINO cannot compile this file: "
                       + (lines[-1] if lines else type(err).__name__)[:300])
    if crashed is not None:
        def refuse(*xs):
            raise RuntimeError(crashed)

        return refuse
    request = compiled.create_infer_request()
    n = len(compiled.outputs)

    def call(*xs):
        request.infer(list(xs))
        return [np.array(request.get_output_tensor(i).data) for i in range(n)]

    return call


def _error(outputs: list, reference: list) -> float:
    from ..quantize import error

    return error([outputs], [reference])


def timed(fns: dict, args: list, reference: list, budget: float) -> dict:
    """name -> {"ms", "error", "match"} of each of ``fns`` (numpy calls on ``args``): its
    error against ``reference`` (a share of the output scale) within ``budget``, timed
    interleaved with the others (``ROUNDS`` rounds, round by round); one that fails:
    {"error_text"}."""
    from ..measure.timing import by_round, interleaved

    out, runs = {}, {}
    for name, fn in fns.items():
        try:
            got = fn(*args)
            got = list(got) if isinstance(got, (list, tuple)) else [got]
            err = _error([np.asarray(g) for g in got], reference)
            out[name] = {"error": float(f"{err:.3g}"), "match": bool(err <= budget)}
            runs[name] = lambda fn=fn: fn(*args)
        except Exception as e:  # noqa: BLE001 - the row says why
            out[name] = {"error_text": first_line(e, 200), "match": False}
    samples: dict = {}
    medians = interleaved(runs, rounds=ROUNDS, min_ms=BATCH_MS, samples=samples)
    figures = {**medians, **by_round(samples)}
    for name, ms in figures.items():
        out[name]["ms"] = round(ms, 4)
    return out


def _loaded(res, folder: str):
    import shutil

    from .. import load, save

    shutil.rmtree(folder, ignore_errors=True)
    save(res, folder)
    module = load(folder)
    return module


def run_model(suite: str, name: str, out_dir: str, options, db, log=print) -> list:
    """The two rows of one model (module docstring); a failure is a row with "error"."""
    import dataclasses

    from .. import optimize
    from ..precision import INT8_MODEL_TOLERANCE, parse_accuracy
    from .suites import export_onnx, timm_model, torchvision_model

    folder = os.path.join(out_dir, "int8", suite, name)
    os.makedirs(folder, exist_ok=True)
    try:
        model, inputs = {"torchvision": torchvision_model, "timm": timm_model}[suite](
            name, "usual")
        arrays = [x.numpy() for x in inputs]
        f32 = export_onnx(model, inputs, os.path.join(folder, f"{name}.onnx"))
        qdq = ort_quantized(f32, os.path.join(folder, f"{name}_int8.onnx"), arrays)
    except Exception as err:  # noqa: BLE001 - a model that cannot be made here
        return [{"model": name, "kind": "qdq file", "error": f"export: {first_line(err, 300)}"}]
    shape = "x".join(map(str, arrays[0].shape))
    rows = []
    # 1. the QDQ file, no flags
    row = {"model": name, "kind": "qdq file", "shape": shape}
    try:
        t0 = time.perf_counter()
        res = optimize(qdq, "llvm", options=dataclasses.replace(
            options, accuracy=parse_accuracy("f32")), db=db)
        row.update(search_s=round(time.perf_counter() - t0, 1), shipped=res.report.shipped)
        module = _loaded(res, os.path.join(folder, "qdq.collage"))
        del res
        module.settle(*arrays)
        reference = [np.asarray(o) for o in _ort(qdq)(*arrays)]
        # each library's A/A: the file in a second session (compiled model), made after
        # the first, timed as one more framework: how far two instances land apart
        fws = {"collage": module, "onnxruntime": _ort(qdq), "openvino": _ov(qdq)}
        fws.update({f"{n} {AA}": make(qdq) for n, make in (("onnxruntime", _ort),
                                                             ("openvino", _ov))})
        row["frameworks"] = timed(fws, arrays, reference, INT8_MODEL_TOLERANCE)
        row["budget"] = INT8_MODEL_TOLERANCE
        del module
    except Exception as err:  # noqa: BLE001 - the row says why
        row["error"] = first_line(err, 300)
    rows.append(_versus(row, ("onnxruntime", "openvino")))
    log(f"  {name} qdq file: {_row_text(rows[-1])}")
    # 2. the f32 model under --accuracy int8
    budget = parse_accuracy("int8") if options.accuracy.strict else options.accuracy
    row = {"model": name, "kind": "f32, --accuracy int8", "shape": shape,
           "budget": budget.tolerance}
    try:
        t0 = time.perf_counter()
        res = optimize(f32, "llvm", options=dataclasses.replace(options, accuracy=budget),
                       db=db)
        info = res.report.precision.get("int8", {})
        row.update(search_s=round(time.perf_counter() - t0, 1), shipped=res.report.shipped,
                   chose=info.get("chose"), in_float=info.get("in_float", []),
                   unpaid=info.get("unpaid", []),
                   quantizable=info.get("quantizable"), calibration=info.get("calibration"))
        module = _loaded(res, os.path.join(folder, "int8.collage"))
        del res
        module.settle(*arrays)
        reference = [np.asarray(o) for o in _ort(f32)(*arrays)]
        fws = {"collage": module, "openvino (default)": _ov(f32),
               "onnxruntime (int8 file)": _ort(qdq), "openvino (int8 file)": _ov(qdq),
               "onnxruntime (f32)": _ort(f32)}
        nncf_file = nncf_quantized(f32, os.path.join(folder, f"{name}_nncf.onnx"), arrays)
        if nncf_file is not None:  # (an OpenVINO user's own int8 file)
            fws["openvino (NNCF file)"] = _ov(nncf_file)
        row["frameworks"] = timed(fws, arrays, reference, budget.tolerance)
        del module
    except Exception as err:  # noqa: BLE001 - the row says why
        row["error"] = first_line(err, 300)
    rows.append(_versus(row, ("openvino (default)", "onnxruntime (int8 file)",
                              "openvino (int8 file)", "openvino (NNCF file)",
                              "onnxruntime (f32)")))
    log(f"  {name} f32 under int8: {_row_text(rows[-1])}")
    return rows


def _versus(row: dict, others: tuple) -> dict:
    """``row`` with "vs": each other framework's time over Collage's (above 1: Collage is
    faster; only where both are within the budget), and "vs_best" over the fastest
    correct one."""
    fw = row.get("frameworks") or {}
    mine = fw.get("collage", {})
    if not (mine.get("match") and math.isfinite(mine.get("ms", math.nan))):
        return row
    vs = {o: fw[o]["ms"] / mine["ms"] for o in others
          if fw.get(o, {}).get("match") and math.isfinite(fw[o].get("ms", math.nan))}
    row["vs"] = {o: round(v, 4) for o, v in vs.items()}
    if vs:
        best = min(vs, key=vs.get)
        row["best"], row["vs_best"] = best, round(vs[best], 4)
        twin = fw.get(f"{best} {AA}", {})
        if twin.get("match") and math.isfinite(twin.get("ms", math.nan)):
            # (|ratio - 1|, as ``suites.versus``'s spreads, judged by ``within_noise``)
            row["aa_spread"] = round(abs(twin["ms"] / fw[best]["ms"] - 1.0), 4)
    return row


def _row_text(row: dict) -> str:
    if row.get("error"):
        return f"error: {row['error']}"
    fw = row.get("frameworks", {})
    return ", ".join(f"{n} {r['ms']:.3f} ms" + ("" if r.get("match") else " (outside budget)")
                     for n, r in fw.items() if "ms" in r) + (
        f"; vs best {row['vs_best']:.3f}x" if row.get("vs_best") else "")


def summary(rows: list) -> dict:
    """Per kind: the rows timed, Collage over the best correct framework (median, worst,
    below ``GOAL``), over each framework (median), and (f32 under int8) the rows where
    Collage left operators in float, and where it beats the whole-model int8 file."""
    from .suites import within_noise

    out = {}
    for kind in ("qdq file", "f32, --accuracy int8"):
        mine = [r for r in rows if r.get("kind") == kind]
        timed_rows = [r for r in mine if r.get("vs_best")]
        s = {"rows": len(mine), "timed": len(timed_rows)}
        if timed_rows:
            worst = min(timed_rows, key=lambda r: r["vs_best"])
            s.update(median=statistics.median(r["vs_best"] for r in timed_rows),
                     worst=(worst["model"], worst["vs_best"]),
                     below_goal=sum(r["vs_best"] < GOAL for r in timed_rows),
                     below_beyond_aa=sum(r["vs_best"] < GOAL
                                         and not within_noise(r, "vs_best")
                                         for r in timed_rows))
            names = sorted({n for r in timed_rows for n in r.get("vs", {})})
            s["per_framework"] = {n: statistics.median(r["vs"][n] for r in timed_rows
                                                       if n in r.get("vs", {}))
                                  for n in names}
        if kind != "qdq file":
            s["in_float"] = sum(1 for r in mine if r.get("in_float")
                                and str(r.get("chose")).startswith("int8"))
            s["beats_whole_int8"] = sum(
                1 for r in timed_rows if all(r["vs"].get(o, math.inf) >= 1.03 or not
                                             r["frameworks"].get(o, {}).get("match")
                                             for o in ("onnxruntime (int8 file)",
                                                       "openvino (int8 file)",
                                                       "openvino (NNCF file)")))
        out[kind] = s
    return out


def markdown(suite: str, rows: list, machine: dict | None = None) -> str:
    """The table of one int8 suite: two rows per model."""
    from .suites import machine_line

    cols = ("collage", "onnxruntime", "openvino", "openvino (default)",
            "onnxruntime (int8 file)", "openvino (int8 file)", "openvino (NNCF file)",
            "onnxruntime (f32)")
    lines = [f"### {suite}, int8" + (f" ({machine_line(machine)})" if machine else ""), "",
             "| model | kind | shipped | Collage ms | " + " | ".join(cols[1:])
             + " | Collage / best |", "|---|---|---|" + "---:|" * (len(cols) + 1)]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['model']} | {r.get('kind', '')} | error: {r['error'][:80]} |"
                         + " |" * (len(cols) + 1))
            continue
        fw = r.get("frameworks", {})

        def cell(n):
            f = fw.get(n)
            if not f or "ms" not in f:
                return "-" if not f else "error"
            return f"{f['ms']:.3f}" + ("" if f.get("match") else " (err {:.1e})".format(
                f.get("error", math.nan)))

        shipped = r.get("shipped", "")
        if r.get("chose"):
            shipped = f"{r['chose']} build" + (
                f", {len(r['in_float'])} of {r['quantizable']} in float" if r.get("in_float")
                else "") + (f" ({len(r['unpaid'])} slower in int8)" if r.get("unpaid") else "")
        lines.append(f"| {r['model']} | {r['kind']} | {shipped} | {cell('collage')} | "
                     + " | ".join(cell(c) for c in cols[1:]) + " | "
                     + (f"{r['vs_best']:.3f}x" if r.get("vs_best") else "-")
                     + (f" (A/A {100 * r['aa_spread']:.0f}%)" if "aa_spread" in r else "")
                     + " |")
    lines.append("")
    for kind, s in summary(rows).items():
        if "median" not in s:
            continue
        per = ", ".join(f"{n} {v:.2f}x" for n, v in s["per_framework"].items())
        lines.append(f"{kind}: Collage / best over {s['timed']} rows: median {s['median']:.3f}x, "
                     f"worst {s['worst'][1]:.3f}x ({s['worst'][0]}), {s['below_goal']} below "
                     f"{GOAL}x" + (f" ({s['below_beyond_aa']} by more than the row's A/A)"
                                   if s['below_goal'] else "")
                     + f"; each framework's time over Collage's (median): {per}."
                     + (f" Operators left in float (int8 shipped) in {s['in_float']} rows; "
                        f"faster than the whole-model int8 file by 3% or more (or that file "
                        f"outside the budget) in {s['beats_whole_int8']}."
                        if "in_float" in s else ""))
    return "\n".join(lines) + "\n"


def run(suite: str, names, out_dir: str, options, db, on_row=None, log=print) -> list:
    """Every model of int8 ``suite`` (``names``: only those), rows as ``run_model``;
    ``on_row(rows)`` after each model."""
    from .dynamic_suite import each_model

    return each_model(INT8_SUITES, "int8", run_model, suite, names, out_dir, options, db,
                      on_row, log)


__all__ = ["INT8_SUITES", "markdown", "run", "summary"]
