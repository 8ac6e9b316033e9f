"""int8 as a precision under the user's accuracy budget (issue #78, part 3): the f32 model
quantized by Collage itself, with accuracy control.

``--accuracy int8`` (``int8:TOL``: another tolerance; default ``INT8_TOLERANCE`` of the
output scale) with ``--calibration inputs.npz`` (without: random inputs, said in the
report):

1. **Quantized.** ONNX Runtime's ``quantize_static`` (QDQ, u8 activations, s8 weights per
   channel, MinMax calibration on the calibration inputs), as its docs show: the int8 file
   both graph libraries fuse into int8 kernels (OpenVINO reads the QDQ pairs as its own
   FakeQuantize).
2. **Where it pays, within the budget.** The quantized model's outputs on the validation
   inputs (the calibration inputs and ``VALIDATION_SEEDS`` random ones) are compared with
   the f32 model's on ONNX Runtime.
   - The operators int8 made slower where it runs stay in float first (``int8_gain``:
     OpenVINO's per-layer profile of the f32 model and of the quantized one; resnet18's
     convolutions before its residual adds ran in f32 there, 2-3x slower with their inputs
     quantized).
   - Where the error breaks the budget, the quantizable operators are ranked by the error
     each adds (its output's error against the f32 model's, less its input's:
     ``local_errors``), and the worst are left in float, 1, 2, 4, ... of them, then halved
     back to the fewest that fit, as NNCF's accuracy control reverts layers in order of
     their error.
   - The error ranking is a guess: those left in float go back to int8 where the budget
     still holds, those int8 saves most on first (``int8_gain``; ONNX Runtime's profile of
     the f32 model where OpenVINO's cannot be taken, ``node_costs``), half of them at once,
     then fewer (``_back_to_int8``).
   - Where even all of them in float break the budget (the error is in the quantized
     products and sums between them), the control runs again quantizing only the
     quantizable operators, which all in float is the f32 model.
3. Then ``build.optimize`` searches the quantized file as any int8 model (its regions on
   the libraries that run it fastest, judged in its own precision) beside the f32 model
   under the same tolerance (bf16 regions allowed), both judged against the f32 model,
   and ships the faster (``build._int8``).
"""
from __future__ import annotations

import logging
import os
import tempfile

import numpy as np

from . import int8_gain
from .precision import INT8_TOLERANCE  # noqa: F401 (the budget's default, re-exported)

logger = logging.getLogger("collage_tvm")

# Random inputs the calibration uses where the user gives none, and the extra random inputs
# every quantized model is validated on
CALIBRATION_SAMPLES = 8
VALIDATION_SEEDS = (101, 102)
# The share of the budget the accuracy control aims the quantized file at (ONNX Runtime's run
# of it against the f32 model): the library that runs the int8 file rounds inside every
# quantized layer in its own way, about 1% of the output scale from ONNX Runtime's
# (precision.INT8_MODEL_TOLERANCE), and the shipped build must stay within the whole budget
# (efficientnet_b0 on the Zen 4, aimed at the whole budget: its int8 build outside it).
CONTROL_SHARE = 0.6
# The operators whose outputs are ranked and left in float by the accuracy control
QUANTIZABLE = ("Conv", "ConvTranspose", "MatMul", "Gemm")
# Tries the control may spend sending operators it left in float back to int8, the costliest
# first (``_back_to_int8``)
RETURN_TRIES = 10


class QuantizeError(ValueError):
    """A model Collage cannot quantize, or calibration inputs that do not fit it."""


def _ort_session(proto_or_path):
    import onnxruntime as ort

    from .target import host_cores

    so = ort.SessionOptions()
    so.intra_op_num_threads = host_cores()
    data = proto_or_path if isinstance(proto_or_path, str) else proto_or_path.SerializeToString()
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])


def input_specs(proto, input_shapes: dict | None = None) -> list:
    """[(name, dtype, shape)] of ``proto``'s inputs; a dynamic dimension at
    ``input_shapes``' size, else 1."""
    import onnx

    weights = {t.name for t in proto.graph.initializer}
    out = []
    for vi in proto.graph.input:
        if vi.name in weights:
            continue
        t = vi.type.tensor_type
        given = (input_shapes or {}).get(vi.name)
        dims = [int(d.dim_value) if d.HasField("dim_value") and d.dim_value > 0 else None
                for d in t.shape.dim]
        shape = tuple(given) if given else tuple(d if d is not None else 1 for d in dims)
        out.append((vi.name, np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).name,
                    shape))
    return out


def random_feeds(specs: list, seeds) -> list:
    """A feed (name -> array) per seed: floats standard normal, integers zero."""
    feeds = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        feeds.append({n: (rng.standard_normal(s).astype(t) if np.dtype(t).kind == "f"
                          else np.zeros(s, t)) for n, t, s in specs})
    return feeds


def calibration_feeds(specs: list, path=None) -> tuple:
    """(feeds, where they came from): ``path`` an .npz keyed by input name, each array one
    input or a stack of them along a new first axis; None: ``CALIBRATION_SAMPLES`` random
    ones."""
    if path is None:
        return (random_feeds(specs, range(CALIBRATION_SAMPLES)),
                f"{CALIBRATION_SAMPLES} random inputs (no --calibration given: the int8 "
                "ranges are the random inputs', which may not be your data's)")
    try:
        data = np.load(os.fspath(path))
    except (OSError, ValueError) as err:
        raise QuantizeError(f"--calibration {path}: cannot read it as an .npz ({err})") from None
    names = [n for n, _, _ in specs]
    missing = [n for n in names if n not in data.files]
    if missing:
        raise QuantizeError(f"--calibration {path}: no array for input(s) "
                            f"{', '.join(missing)} (it has {', '.join(data.files) or 'none'})")
    stacks = {}
    for name, dtype, shape in specs:
        a = np.asarray(data[name])
        given = list(a.shape)
        if a.ndim == len(shape):
            a = a[None]
        if a.ndim != len(shape) + 1 or any(
                want not in (None, got) for want, got in zip(shape, a.shape[1:])
                if want != 1):
            raise QuantizeError(f"--calibration {path}: input {name} is {given}, "
                                f"expected {list(shape)} or N x {list(shape)}")
        stacks[name] = a.astype(dtype, copy=False)
    n = {len(a) for a in stacks.values()}
    if len(n) != 1:
        raise QuantizeError(f"--calibration {path}: the inputs hold different numbers of "
                            f"samples ({sorted(n)})")
    count = n.pop()
    return ([{k: np.ascontiguousarray(v[i]) for k, v in stacks.items()} for i in range(count)],
            f"{count} input{'s' if count != 1 else ''} from {os.fspath(path)}")


def named(proto):
    """``proto`` with a name on every node (the quantizer leaves nodes out by name)."""
    import onnx

    out = onnx.ModelProto()
    out.CopyFrom(proto)
    seen = set()
    for k, node in enumerate(out.graph.node):
        if not node.name or node.name in seen:
            node.name = f"{node.op_type}_{k}"
        seen.add(node.name)
    return out


def quantizers() -> dict:
    """name -> (available, why not) of the quantizers ``quantize`` can use: ``ort`` (ONNX
    Runtime's ``quantize_static``) and ``nncf`` (NNCF's post-training quantization on its
    ONNX backend: the QDQ placement OpenVINO's own tools make, with its hardware-aware
    patterns and fast bias correction)."""
    out = {"ort": (True, "")}
    try:
        import nncf  # noqa: F401

        out["nncf"] = (True, "")
    except Exception as err:  # noqa: BLE001 - left out, with the reason
        out["nncf"] = (False, f"{type(err).__name__}: {err}")
    return out


def quantize(proto, feeds: list, exclude=(), op_types=None, method: str = "ort") -> object:
    """``proto`` (f32, named) quantized by ONNX Runtime's ``quantize_static`` (QDQ, u8
    activations, s8 weights per channel, MinMax on ``feeds``), the nodes named in
    ``exclude`` left in float; ``op_types``: only operators of these types quantized
    (default: every type the quantizer knows). ``method`` "nncf": by NNCF instead
    (``_nncf``). The int8 ModelProto."""
    if method == "nncf":
        return _nncf(proto, feeds, exclude, op_types)
    import onnx
    from onnxruntime.quantization import (CalibrationDataReader, QuantFormat, QuantType,
                                          quantize_static)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    root = logging.getLogger()
    level = root.level
    with tempfile.TemporaryDirectory(prefix="collage-int8-") as tmp:
        src, dst = os.path.join(tmp, "f32.onnx"), os.path.join(tmp, "int8.onnx")
        onnx.save(proto, src)
        root.setLevel(logging.ERROR)  # (its advice to pre-process, on the root logger)
        try:
            quantize_static(src, dst, Reader(), quant_format=QuantFormat.QDQ,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            per_channel=True, nodes_to_exclude=list(exclude),
                            op_types_to_quantize=list(op_types) if op_types else None)
        finally:
            root.setLevel(level)
        return onnx.load(dst)


def _nncf(proto, feeds: list, exclude=(), op_types=None):
    """``proto`` quantized by NNCF (``nncf.quantize`` on the ModelProto: QDQ, its default
    mixed preset, calibration on ``feeds``), the nodes named in ``exclude`` left in float;
    ``op_types``: operators of other types ignored. A model with Softmax and MatMul is
    quantized as a transformer (``ModelType.TRANSFORMER``), as NNCF's docs ask."""
    import contextlib
    import io

    import nncf

    types = {n.op_type for n in proto.graph.node}
    ignored = {}
    if exclude:
        ignored["names"] = list(exclude)
    if op_types:
        ignored["types"] = sorted(types - set(op_types))
    kw = {}
    if ignored:
        kw["ignored_scope"] = nncf.IgnoredScope(**ignored, validate=False)
    if {"Softmax", "MatMul"} <= types:
        kw["model_type"] = nncf.ModelType.TRANSFORMER
    nncf_log = logging.getLogger("nncf")
    level = nncf_log.level
    nncf_log.setLevel(logging.ERROR)
    try:  # (its progress bars go to stdout: the control prints its own line a try)
        with contextlib.redirect_stdout(io.StringIO()):
            return nncf.quantize(proto, nncf.Dataset(feeds), subset_size=len(feeds), **kw)
    finally:
        nncf_log.setLevel(level)


def outputs_on(proto, feeds: list, extra: list = ()) -> list:
    """ONNX Runtime's outputs of ``proto`` on each feed: [[graph outputs..., the tensors
    named in ``extra``...]]."""
    import onnx

    model = proto
    if extra:
        model = onnx.ModelProto()
        model.CopyFrom(proto)
        have = {o.name for o in model.graph.output}
        for name in extra:
            if name not in have:
                model.graph.output.append(onnx.ValueInfoProto(name=name))
    sess = _ort_session(model)
    names = [o.name for o in proto.graph.output] + list(extra)
    return [sess.run(names, feed) for feed in feeds]


def error(outputs: list, reference: list) -> float:
    """The largest error of ``outputs`` against ``reference`` (per feed, per output) as a
    share of that reference output's largest magnitude."""
    worst = 0.0
    for outs, refs in zip(outputs, reference):
        for o, r in zip(outs, refs):
            r = np.asarray(r, dtype=np.float64)
            scale = float(np.max(np.abs(r))) if r.size else 0.0
            diff = float(np.max(np.abs(np.asarray(o, np.float64) - r))) if r.size else 0.0
            worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def _dequantized(int8, tensor: str) -> str:
    """The tensor downstream operators of the quantized model read for ``tensor``: the
    output of the QuantizeLinear -> DequantizeLinear pair that takes it, where one does;
    else ``tensor``."""
    consumers: dict = {}
    for node in int8.graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    for q in consumers.get(tensor, ()):
        if q.op_type == "QuantizeLinear":
            for dq in consumers.get(q.output[0], ()):
                if dq.op_type == "DequantizeLinear":
                    return dq.output[0]
    return tensor


def _f32_name(tensor: str, f32_tensors: set, int8=None) -> str | None:
    """The f32 model's tensor a quantized model's ``tensor`` stands for: the same name, the
    name the quantizer derived it from (``X_DequantizeLinear_Output``,
    ``X_QuantizeLinear_Input``), or (``int8`` given) the tensor a DequantizeLinear <-
    QuantizeLinear pair producing it took (NNCF names its pairs' tensors otherwise)."""
    if tensor in f32_tensors:
        return tensor
    for suffix in ("_DequantizeLinear_Output", "_QuantizeLinear_Input"):
        if tensor.endswith(suffix) and tensor[:-len(suffix)] in f32_tensors:
            return tensor[:-len(suffix)]
    if int8 is not None:
        made = {o: n for n in int8.graph.node for o in n.output}
        dq = made.get(tensor)
        q = made.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" \
            else None
        if q is not None and q.op_type == "QuantizeLinear" and q.input[0] in f32_tensors:
            return q.input[0]
    return None


def local_errors(f32, int8, feeds: list) -> list:
    """[(node name, error it adds)] of the quantizable nodes of ``f32`` (``QUANTIZABLE``)
    that the quantized model ``int8`` quantized, worst first: the error of what the next
    operator reads from it (its quantized output; the quantizer may have folded a Relu
    after it into that) against the f32 model's same tensor, less the same of its own
    first input, each a share of the tensor's scale. A node whose tensors cannot be told
    apart is ranked after the others, in graph order, at 0."""
    f32_tensors = {o for n in f32.graph.node for o in n.output} | {
        i.name for i in f32.graph.input}
    by_name = {n.name: n for n in int8.graph.node}
    pairs, order = {}, []
    for node in f32.graph.node:
        mine = by_name.get(node.name)
        if node.op_type not in QUANTIZABLE or mine is None or mine.op_type != node.op_type:
            continue
        order.append(node.name)
        out_q = _dequantized(int8, mine.output[0])
        out_f = _f32_name(mine.output[0], f32_tensors) or _f32_name(out_q, f32_tensors)
        in_f = _f32_name(mine.input[0], f32_tensors, int8)
        if out_f is None:
            continue
        pairs[node.name] = ((out_q, out_f), (mine.input[0], in_f) if in_f else None)
    if not order:
        return []
    want_q = sorted({p[0] for o, i in pairs.values() for p in (o, i) if p})
    want_f = sorted({p[1] for o, i in pairs.values() for p in (o, i) if p})
    hidden = lambda names, proto: [t for t in names  # noqa: E731 (not inputs or outputs)
                                   if t not in {x.name for x in proto.graph.input}]
    k_f, k_q = len(f32.graph.output), len(int8.graph.output)
    extra_f, extra_q = hidden(want_f, f32), hidden(want_q, int8)
    ref = outputs_on(f32, feeds, extra_f)
    got = outputs_on(int8, feeds, extra_q)

    def values(rows, k, extra, proto, feed_index, name):
        if name in extra:
            return rows[feed_index][k + extra.index(name)]
        outs = [o.name for o in proto.graph.output]
        if name in outs:
            return rows[feed_index][outs.index(name)]
        return feeds[feed_index][name]

    def err(pair):
        q_name, f_name = pair
        return error([[values(got, k_q, extra_q, int8, i, q_name)] for i in range(len(feeds))],
                     [[values(ref, k_f, extra_f, f32, i, f_name)] for i in range(len(feeds))])

    ranked = [(name, err(out) - (err(inp) if inp else 0.0)) for name, (out, inp) in pairs.items()]
    ranked.sort(key=lambda kv: -kv[1])
    return ranked + [(n, 0.0) for n in order if n not in pairs]


def controlled(proto, feeds: list, validation: list, tolerance: float, progress=None,
               method: str = "ort", hint=None) -> dict:
    """``proto`` quantized within ``tolerance`` on ``validation`` (module docstring, step 2):
    {"model": the int8 ModelProto (None: no operator could stay int8), "error", "excluded":
    node names left in float, "quantizable", "tries": [(excluded count, error)],
    "compute_only": whether only the ``QUANTIZABLE`` operators are quantized,
    "whole_model", "whole_error": the first try, every operator int8, "unpaid": operators
    left in float because int8 ran them slower on OpenVINO (``int8_gain``), "returned":
    operators the error ranking left in float that went back to int8}.

    ``hint``: the precision the float parts run in where OpenVINO's per-operator times are
    taken (None: its default, bf16 on CPUs with bf16; "f32"), False: none taken.

    First every operator type the quantizer knows is quantized; where even every
    ``QUANTIZABLE`` operator left in float breaks the budget, the error lies in the others
    (efficientnet_b0's squeeze-and-excite products and sigmoids: 1e-1 of the output scale
    with all 82 convolutions in float), and the control runs again with only the
    ``QUANTIZABLE`` operators quantized, which leaving them in float takes back to the f32
    model."""
    proto = named(proto)
    reference = outputs_on(proto, validation)
    tries = []
    quantizable = [n.name for n in proto.graph.node if n.op_type in QUANTIZABLE]
    # (the f32 model's OpenVINO profile, once for both passes)
    f32_layers = int8_gain.layer_times(proto, validation[0], hint) if hint is not False \
        else None
    out = None
    for op_types in (None, QUANTIZABLE):
        found = _control(proto, feeds, validation, reference, tolerance, tries, progress,
                         quantizable, op_types, method, hint, f32_layers)
        found["compute_only"] = op_types is not None
        out = out or found  # (what the first pass tried is the report's, where none fits)
        if found["model"] is not None:
            # (every operator int8, as the first pass quantized it: a contender of its own
            # where it is within the whole budget, ``build._int8``)
            return {**found, "tries": tries, "whole_model": out["whole_model"],
                    "whole_error": out["whole_error"]}
    return {**out, "tries": tries}


def _control(proto, feeds, validation, reference, tolerance, tries, progress, quantizable,
             op_types, method="ort", hint=None, f32_layers=None) -> dict:
    """One pass of ``controlled`` quantizing ``op_types`` (None: every type); ``f32_layers``:
    OpenVINO's profile of ``proto`` at ``hint`` (``int8_gain.layer_times``), None: no
    per-operator times."""

    def attempt(exclude):
        model = quantize(proto, feeds, exclude, op_types, method)
        err = error(outputs_on(model, validation), reference)
        tries.append((len(exclude), err))
        if progress:
            progress(len(exclude), err)
        return model, err

    model, err = attempt(())
    out = {"model": model, "error": err, "excluded": [], "quantizable": len(quantizable),
           "whole_model": model, "whole_error": err, "unpaid": [], "returned": []}
    times = {} if f32_layers is None else int8_gain.timed(
        proto, f32_layers, model, validation[0], quantizable, hint)
    unpaid = int8_gain.unpaid(times)
    out.update(timed_on="openvino" if times else None, unpaid=unpaid)
    if unpaid:  # (int8 made them slower where it runs: they stay in float from the start)
        paid, paid_err = attempt(unpaid)
        if paid_err <= tolerance:
            return {**out, "model": paid, "error": paid_err, "excluded": list(unpaid)}
    if err <= tolerance:
        return out

    def with_unpaid(exclude):
        return attempt(unpaid + [n for n in exclude if n not in unpaid])

    ranked = [name for name, _ in local_errors(proto, model, validation[:2])
              if name not in unpaid]
    ranked += [n for n in quantizable if n not in ranked and n not in unpaid]
    fits, fails, best = None, 0, None
    k = 1
    while k <= len(ranked):
        model, err = with_unpaid(ranked[:k])
        if err <= tolerance:
            fits, best = k, (model, err)
            break
        fails = k
        k *= 2
    if fits is None:
        if len(ranked) and fails < len(ranked):
            model, err = with_unpaid(ranked)
            if err <= tolerance:
                fits, best = len(ranked), (model, err)
        if fits is None:
            return {**out, "model": None, "excluded": unpaid + ranked}
    lo, hi = fails, fits  # (lo fails, hi fits): the fewest that fit, halving the gap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        model, err = with_unpaid(ranked[:mid])
        if err <= tolerance:
            hi, best = mid, (model, err)
        else:
            lo = mid
    excluded, returned = ranked[:hi], []
    if hi > 1:
        costs = int8_gain.saved(times) or node_costs(proto, validation[:1])
        excluded, found = _back_to_int8(excluded, costs, with_unpaid, tolerance)
        if found is not None:
            best = found
            returned = [n for n in ranked[:hi] if n not in excluded]
    return {**out, "model": best[0], "error": best[1], "excluded": unpaid + excluded,
            "returned": returned}


def _back_to_int8(excluded: list, costs: dict, attempt, tolerance: float,
                  tries: int = RETURN_TRIES) -> tuple:
    """The operators of ``excluded`` (the fewest of the error ranking that fit the budget)
    sent back to int8 where the budget still holds, those ``costs`` ranks highest first
    (what int8 saves per operator, ``int8_gain.saved``, or its f32 time, ``node_costs``):
    the costliest half first, then smaller chunks where a chunk breaks the
    budget (twice as many after one that fits), within ``tries`` tries of ``attempt``. The
    error ranking is a guess (regnety_002: 53 of 64 convolutions in float before the error
    dropped, one of them the cause). Returns (those left in float, in ``excluded``'s
    order; (model, error) of the last try that fit, or None where none did)."""
    pending = sorted(excluded, key=lambda n: -costs.get(n, 0.0))
    keep, best = set(excluded), None
    size = max(1, len(pending) // 2)
    while pending and tries > 0:
        chunk = pending[:min(size, len(pending))]
        trial = [n for n in excluded if n in keep and n not in chunk]
        if not trial:  # (every one back: the first try of the control, which broke it)
            size = max(1, len(chunk) // 2)
            if len(chunk) == 1:
                pending = pending[1:]
            continue
        model, err = attempt(trial)
        tries -= 1
        if err <= tolerance:
            keep -= set(chunk)
            best = (model, err)
            pending = pending[len(chunk):]
            size = 2 * len(chunk)  # (the next ones may go back together too)
        elif len(chunk) > 1:
            size = len(chunk) // 2
        else:
            pending = pending[1:]  # (it stays in float)
    return [n for n in excluded if n in keep], best


def node_costs(proto, feeds: list, runs: int = 5) -> dict:
    """node name -> ms per run of each node of ``proto`` (named: ``named``) in ONNX
    Runtime's profile of ``runs`` runs on ``feeds`` (no graph optimization, so the nodes
    profiled are the file's own). {} where the profile cannot be read."""
    import json

    import onnxruntime as ort

    from .target import host_cores

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.intra_op_num_threads = host_cores()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.enable_profiling = True
        so.profile_file_prefix = os.path.join(tmp, "profile")
        try:
            sess = ort.InferenceSession(proto.SerializeToString(), so,
                                        providers=["CPUExecutionProvider"])
            for k in range(runs):
                sess.run(None, feeds[k % len(feeds)])
            with open(sess.end_profiling()) as f:
                events = json.load(f)
        except Exception as err:  # noqa: BLE001 - the control goes on in its error order
            logger.info("no profile of the f32 model: %s", err)
            return {}
    suffix = "_kernel_time"
    out: dict = {}
    for ev in events:
        name = ev.get("name", "")
        if ev.get("cat") == "Node" and name.endswith(suffix):
            out[name[:-len(suffix)]] = out.get(name[:-len(suffix)], 0.0) + ev["dur"] / 1e3 / runs
    return out


__all__ = ["CALIBRATION_SAMPLES", "INT8_TOLERANCE", "QuantizeError", "calibration_feeds",
           "controlled", "error", "input_specs", "local_errors", "node_costs", "quantize",
           "quantizers", "random_feeds"]
