"""The deploy figures of issue #36 (``collage-tvm bench MODEL --deploy``): a shipped build
saved, then loaded in a fresh process beside what creating an ONNX Runtime session for the
same model file costs there, its outputs against the in-process build's, and its latency
beside the in-process build's, timed interleaved."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np

# Run in a fresh Python: import collage_tvm, load the artifact, run it once on the inputs,
# then create an ONNX Runtime session for the model file as a user would
# (``InferenceSession(path)``, its import timed with it, as ``load`` imports the libraries
# it loads) and run it once; the times and the outputs come back.
_FRESH = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import collage_tvm
t_import = time.perf_counter() - t0
art, onnx_path, inputs, outputs, report = sys.argv[1:6]
arrays = [a for _, a in sorted(np.load(inputs).items())]
t0 = time.perf_counter()
module = collage_tvm.load(art)
t_load = time.perf_counter() - t0
t0 = time.perf_counter()
out = module(*arrays)
t_first = time.perf_counter() - t0
out = out if isinstance(out, tuple) else (out,)
np.savez(outputs, *[np.asarray(o) for o in out])
t0 = time.perf_counter()
import onnxruntime as ort  # (timed with the session, as the load times its libraries' imports)
sess = ort.InferenceSession(onnx_path, providers=["CPUExecutionProvider"])
t_ort = time.perf_counter() - t0
names = [i.name for i in sess.get_inputs()]
t0 = time.perf_counter()
sess.run(None, dict(zip(names, arrays)))
t_ort_first = time.perf_counter() - t0
json.dump({"import_s": t_import, "load_s": t_load, "first_run_s": t_first,
           "ort_session_s": t_ort, "ort_first_run_s": t_ort_first}, open(report, "w"))
"""


def deploy_row(onnx_path: str, result, out_dir: str, name: str, rounds: int = 7) -> dict:
    """Save ``result`` (``optimize``'s) into ``out_dir/<name>.collage``, load it in a fresh
    process (``_FRESH``), and time it here beside the in-process build. Returns {"save_s",
    "bytes", "import_s", "load_s", "first_run_s", "ort_session_s", "ort_first_run_s",
    "load_vs_ort", "identical", "in_process_ms", "loaded_ms"}."""
    import tvm
    from tvm import relax

    from ..artifact import load, save
    from ..check import run_outputs
    from ..measure.timing import interleaved

    art = os.path.join(out_dir, f"{name}.collage")
    t0 = time.perf_counter()
    save(result, art)
    row: dict = {"save_s": time.perf_counter() - t0,
                 "bytes": sum(os.path.getsize(os.path.join(d, f))
                              for d, _, files in os.walk(art) for f in files)}
    module = load(art)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal([int(d) for d in spec["shape"]]).astype(spec["dtype"])
              if np.dtype(spec["dtype"]).kind == "f" else
              np.zeros([int(d) for d in spec["shape"]], spec["dtype"]) for spec in module.inputs]
    inputs, outputs = os.path.join(out_dir, f"{name}.inputs.npz"), os.path.join(
        out_dir, f"{name}.outputs.npz")
    np.savez(inputs, **{f"a{k:03d}": a for k, a in enumerate(arrays)})
    report = os.path.join(out_dir, f"{name}.deploy.json")
    subprocess.run([sys.executable, "-c", _FRESH, art, onnx_path, inputs, outputs, report],
                   check=True, timeout=1800)
    with open(report) as f:
        row.update(json.load(f))
    row["load_vs_ort"] = row["load_s"] / row["ort_session_s"]
    vm = relax.VirtualMachine(result.executable, tvm.cpu())
    tensors = [tvm.runtime.tensor(a) for a in arrays]
    here = [np.asarray(o) for o in run_outputs(vm, tensors)]
    fresh = np.load(outputs)
    there = [fresh[f"arr_{k}"] for k in range(len(fresh.files))]
    row["identical"] = len(here) == len(there) and all(
        a.shape == b.shape and np.array_equal(a, b, equal_nan=True) for a, b in zip(here, there))
    main, loaded = vm["main"], module.vm["main"]
    ms = interleaved({"in-process": lambda: main(*tensors), "loaded": lambda: loaded(*tensors)},
                     rounds=rounds)
    row["in_process_ms"], row["loaded_ms"] = ms["in-process"], ms["loaded"]
    return row
