"""What int8 saves per operator, measured on the library that runs int8 files fastest here
(OpenVINO), for the accuracy control of ``--accuracy int8`` (issue #78, part 3).

OpenVINO's per-layer profile (``PERF_COUNT``) of the f32 model and of the quantized one
names each layer after the ONNX node it came from (``/layer1/layer1.1/conv2/Conv`` runs as
``.../Conv/WithoutBiases``), and says how it ran (``brgconv_avx512_I8`` or ``_f32``). An
operator's gain is its time in the float model (at OpenVINO's default precision where the
budget allows bf16) less its time in the quantized one, with its share of the layers that
quantize its input (a QuantizeLinear the library runs as a kernel of its own). On the Zen 4,
ONNX Runtime's int8 file of resnet18 had the four convolutions before its residual adds run
in f32 on OpenVINO (1.0 ms each against 0.3 ms for the others, in int8): their
quantization costs and saves nothing.

Profiles run in a child process (``python -m collage_tvm.int8_gain``): OpenVINO 2026.4.1
segfaults compiling some quantized files (densenet121's).
"""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile

import numpy as np

logger = logging.getLogger("collage_tvm")

PROFILE_RUNS = 20
PROFILE_TIMEOUT_S = 600
# An operator whose quantized run (with its input's quantization) took over this many times
# its float run, and longer by over UNPAID_MS, stays in float (``unpaid``): beyond what a
# busy machine adds to a layer's fastest run of 20
UNPAID_RATIO = 1.2
UNPAID_MS = 0.01


def layer_times(proto, feed: dict, hint: str | None = None) -> dict | None:
    """OpenVINO layer name -> [ms of its fastest run, how it ran] of ``proto`` on ``feed``
    (``hint``: its INFERENCE_PRECISION_HINT, None for its default), profiled in a child
    process; None where OpenVINO failed or crashed there (logged)."""
    with tempfile.TemporaryDirectory() as tmp:
        model, inputs = os.path.join(tmp, "model.onnx"), os.path.join(tmp, "feed.npz")
        with open(model, "wb") as f:
            f.write(proto.SerializeToString())
        np.savez(inputs, **feed)
        try:
            done = subprocess.run([sys.executable, "-m", "collage_tvm.int8_gain", model, inputs,
                                   hint or ""], capture_output=True, text=True,
                                  timeout=PROFILE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.info("OpenVINO's profile of the model took over %d s", PROFILE_TIMEOUT_S)
            return None
    if done.returncode != 0:
        tail = (done.stderr or "").strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        logger.info("no OpenVINO profile of the model: %s", tail[0])
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def node_times(layers: dict, proto) -> dict:
    """ONNX node name -> ms of ``proto``'s nodes in OpenVINO's ``layers``: each layer named
    after a node (its name, or the name and "/..."), and each QuantizeLinear's layer shared
    among the operators that read its DequantizeLinear's output."""
    names = {n.name for n in proto.graph.node}
    readers: dict = {}
    for node in proto.graph.node:
        for tensor in node.input:
            readers.setdefault(tensor, []).append(node)
    out: dict = {}
    for layer, (ms, _) in layers.items():
        name = _node_of(layer, names)
        if name is not None:
            out[name] = out.get(name, 0.0) + ms
    for node in proto.graph.node:
        if node.op_type != "QuantizeLinear" or node.name not in out:
            continue
        users = [r.name for dq in readers.get(node.output[0], ())
                 if dq.op_type == "DequantizeLinear" for r in readers.get(dq.output[0], ())]
        for user in users:
            out[user] = out.get(user, 0.0) + out[node.name] / len(users)
    return out


def _node_of(layer: str, names: set) -> str | None:
    while layer:
        if layer in names:
            return layer
        cut = layer.rfind("/")
        if cut <= 0:
            return None
        layer = layer[:cut]
    return None


def timed(f32, f32_layers: dict, int8, feed: dict, nodes: list, hint: str | None = None) -> dict:
    """name -> (ms in ``f32``, ms in ``int8``) per run on OpenVINO, of each of ``nodes`` (the
    quantizable operators of ``f32``; ``int8``: the model with them quantized): its time in
    ``f32_layers`` (``layer_times`` of ``f32`` at ``hint``, taken once for every quantized
    model compared with it), and its time with its input's quantization in ``int8``'s
    profile (at the same hint: its float parts). {} where that profile could not be taken."""
    after = layer_times(int8, feed, hint)
    if after is None:
        return {}
    t_f32, t_int8 = node_times(f32_layers, f32), node_times(after, int8)
    return {n: (t_f32[n], t_int8[n]) for n in nodes if n in t_f32 and n in t_int8}


def unpaid(times: dict) -> list:
    """The operators of ``times`` (``timed``) int8 made slower: over ``UNPAID_RATIO`` times
    their float time, and by over ``UNPAID_MS``."""
    return [n for n, (f, i) in times.items() if i > UNPAID_RATIO * f and i - f > UNPAID_MS]


def saved(times: dict) -> dict:
    """name -> ms int8 saves, of the operators of ``times`` it makes faster."""
    return {n: f - i for n, (f, i) in times.items() if f > i}


def _profile(model: str, inputs: str, hint: str) -> dict:
    import openvino as ov

    config = {"PERF_COUNT": "YES"}
    if hint:
        config["INFERENCE_PRECISION_HINT"] = hint
    compiled = ov.Core().compile_model(model, "CPU", config)
    request = compiled.create_infer_request()
    data = np.load(inputs)
    feed = {i.get_any_name(): data[i.get_any_name()] for i in compiled.inputs}
    request.infer(feed)  # (a first run: memory, caches)
    runs: dict = {}
    for _ in range(PROFILE_RUNS):
        request.infer(feed)
        for p in request.get_profiling_info():
            runs.setdefault(p.node_name, ([], p.exec_type))[0].append(
                p.real_time.total_seconds() * 1e3)
    # (each layer's fastest run: other work on the machine only ever adds to a layer's time)
    return {k: [min(ms), how] for k, (ms, how) in runs.items()}


if __name__ == "__main__":
    print(json.dumps(_profile(*sys.argv[1:4])))
