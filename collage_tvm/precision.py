"""Precision as a placement dimension (issue #17): the user's accuracy budget, what the CPU
offers, and the check that a build stays within the budget.

A backend declares the precision it computes in (``register_backend(..., precision=)``);
a reduced-precision backend is a variant of a library (``openvino_bf16`` of ``openvino``)
with inputs and outputs in f32, so the casts at its boundaries are inside what is measured
and placed. The budget (``--accuracy``, ``SearchOptions.accuracy``) says which precisions
the search may use, and by how much the shipped build may differ from the f32 reference:

- ``f32`` (the default): strict; every candidate f32 and the per-element check of the
  final comparison (rtol 1e-3, atol 1e-3), as before precisions existed.
- ``bf16``: bf16 candidates allowed; the build's largest absolute error may reach 2e-2 of
  the reference output's largest magnitude (measured on the zoo at paper size, OpenVINO
  in bf16 reaches 1.8e-3 to 4.4e-3 of it: docs/BENCHMARKS.md).
- a number ``T``: the same rule with tolerance ``T``; bf16 candidates only when ``T`` is at
  least ``PRECISION_FLOOR["bf16"]`` (1e-2: bf16 keeps 8 bits of mantissa, 3.9e-3 of
  rounding at each operator), else every candidate stays f32.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import numpy as np

PRECISIONS = ("f32", "bf16")
# A quantized model (QuantizeLinear/DequantizeLinear, or int8 operators) is judged by its own
# precision, not f32 rounding: two correct int8 implementations of one model round inside
# every quantized layer and differ by about 1% of the output scale (resnet18 QDQ: ONNX
# Runtime against OpenVINO's int8 kernels, 1.1%). Its budget allows this share of the output
# scale and no reduced-precision backend beyond what the model itself quantizes.
INT8_MODEL = "int8-model"
# The budget under which Collage quantizes an f32 model itself (``collage_tvm.quantize``)
INT8 = "int8"
# Its default: the largest error allowed, a share of the f32 model's output scale. NNCF's
# accuracy control defaults to a 1% drop of a metric; on raw outputs, int8 implementations
# differ by about 1% of the scale from each other (INT8_MODEL_TOLERANCE), and a whole model
# quantized with MinMax calibration reaches a few percent (resnet18: ~2%).
INT8_TOLERANCE = 5e-2
INT8_MODEL_TOLERANCE = 5e-2
# The ONNX operators that make a model quantized (QDQ, and the QOperator form)
QUANTIZED_OPS = ("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv",
                 "QLinearMatMul", "MatMulInteger", "ConvInteger", "QGemm", "QLinearAdd",
                 "QLinearMul", "QLinearConcat", "QLinearGlobalAveragePool", "QLinearSigmoid",
                 "QLinearLeakyRelu", "QLinearAveragePool", "QLinearSoftmax", "QAttention",
                 "DynamicQuantizeMatMul", "MatMulIntegerToFloat")
# The smallest tolerance (error / output scale) at which a precision may be used at all.
PRECISION_FLOOR = {"f32": 0.0, "bf16": 1e-2}
LEVELS = {"f32": 0.0, "bf16": 2e-2}
STRICT_RTOL = STRICT_ATOL = 1e-3
CHECK_SEEDS = (0, 1, 2)  # random inputs a reduced-precision build is checked on


@dataclass(frozen=True)
class Accuracy:
    """An accuracy budget: ``tolerance`` 0 is strict f32."""

    name: str = "f32"
    tolerance: float = 0.0
    # whether reduced-precision backends may run a part of the model (False: the budget of
    # a quantized model, ``INT8_MODEL``: its outputs judged within the tolerance, every
    # backend at f32 beyond what the model quantizes itself)
    reduced: bool = True
    why: str = field(default="", compare=False)  # why the build is judged by this budget

    @property
    def strict(self) -> bool:
        return self.tolerance == 0.0

    @property
    def quantizes(self) -> bool:
        """Whether the budget lets Collage quantize the model to int8 itself (``--accuracy
        int8``: ``collage_tvm.quantize``)."""
        return self.name == INT8 or self.name.startswith(INT8 + ":")

    def allows(self, precision: str) -> bool:
        return precision == "f32" or (self.reduced and not self.strict
                                      and self.tolerance >= PRECISION_FLOOR[precision])

    def key(self) -> str:
        """The placement-log key part: "" for strict f32."""
        # (a quantized model's verdicts are judged against ONNX Runtime's run of its file
        # since "ort-ref": logs from before checked them against TVM's float emulation)
        return "" if self.strict else (f"|accuracy:{self.tolerance:g}"
                                        + ("" if self.reduced else "|f32-backends")
                                        + ("|ort-ref" if self.name == INT8_MODEL else ""))

    def check(self, outputs, reference) -> dict:
        """{"match", "max_err", "rel_err"} of ``outputs`` against the f32 ``reference``:
        strict: the per-element check (rtol 1e-3, atol ``scaled_atol`` of the output's
        scale); else
        ``max_err <= tolerance * scale`` per output (scale: the reference output's largest
        magnitude)."""
        max_err = compare_outputs(outputs, reference)[1]
        # atol follows each output's scale both ways (``scaled_atol``): above 1, float32
        # rounding of an output reaching 1e9 is thousands near zero; below 1, a fixed atol
        # would let an all-zero output "match" a reference of 1e-4.
        match = len(outputs) == len(reference) and all(
            compare_outputs([o], [r], STRICT_RTOL, scaled_atol(STRICT_ATOL, output_scale(r)))[0]
            for o, r in zip(outputs, reference))
        rel = relative_error(outputs, reference)
        if not self.strict and not match:
            match = len(outputs) == len(reference) and rel <= self.tolerance
        return {"match": bool(match), "max_err": max_err, "rel_err": rel}

    def check_seeds(self, outputs, reference) -> dict:
        """``check`` on each input's outputs (lists of output lists, one per random input):
        matching on every one, the largest errors over them."""
        checks = [self.check(o, r) for o, r in zip(outputs, reference)]
        return {"match": all(c["match"] for c in checks),
                "max_err": max(c["max_err"] for c in checks),
                "rel_err": max(c["rel_err"] for c in checks)}

    def __str__(self) -> str:
        return self.name


def compare_outputs(outputs, reference, rtol=1e-3, atol=1e-3) -> tuple:
    """(all outputs close to the reference, max absolute error) of two lists of arrays."""
    outputs = [np.asarray(o) for o in outputs]
    reference = [np.asarray(r) for r in reference]

    def err(a, b) -> float:
        if not a.size or a.shape != b.shape:
            return 0.0 if not a.size else math.inf
        return float(np.max(_abs_diff(a, b)))

    errs = [err(a, b) for a, b in zip(outputs, reference)]
    match = len(outputs) == len(reference) and all(
        a.shape == b.shape and np.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        for a, b in zip(outputs, reference))
    return bool(match), max(errs, default=0.0)


def parse_accuracy(spec) -> Accuracy:
    """``"f32"`` / ``"strict"`` / None, ``"bf16"``, or a tolerance (``1e-2``, ``"0.05"``)."""
    if spec is None or isinstance(spec, Accuracy):
        return spec or Accuracy()
    text = str(spec).strip().lower()
    if text in ("strict", "fp32", "float32"):
        text = "f32"
    if text == INT8_MODEL:
        return int8_model_budget()
    if text == INT8 or text.startswith(INT8 + ":"):
        tol = INT8_TOLERANCE
        if text != INT8:
            try:
                tol = float(text.split(":", 1)[1])
            except ValueError:
                tol = -1.0
            if not 0 < tol < 1:
                raise ValueError(f"accuracy {spec!r}: expected int8 or int8:TOL, TOL in (0, 1) "
                                 "(the largest error allowed, a share of the output's scale)")
        return Accuracy(INT8 if text == INT8 else f"{INT8}:{tol:g}", tol)
    if text in LEVELS:
        return Accuracy(text, LEVELS[text])
    try:
        tol = float(text)
    except ValueError:
        tol = -1.0
    if not tol >= 0 or tol >= 1:
        raise ValueError(f"accuracy {spec!r}: expected f32, bf16, int8 or a tolerance in [0, 1) "
                         "(the largest error allowed, as a fraction of the output's scale)")
    return Accuracy("f32" if tol == 0 else f"{tol:g}", tol)


def int8_model_budget(reduced: bool = False) -> Accuracy:
    """The budget a quantized model is judged by (``INT8_MODEL``). ``reduced``: its float
    parts may run in bf16 too (the model Collage quantized itself under ``--accuracy int8``,
    whose float build may: OpenVINO's default on a QDQ file does the same on a CPU with bf16
    instructions); a user's own quantized file keeps them at f32."""
    return Accuracy(INT8_MODEL, INT8_MODEL_TOLERANCE, reduced=reduced)


def quantized_ops(proto) -> dict:
    """op type -> count of the quantized operators (``QUANTIZED_OPS``) in ONNX ``proto``'s
    graph and its functions' bodies; empty for a float model."""
    count: dict = {}
    nodes = list(proto.graph.node) + [n for f in proto.functions for n in f.node]
    for node in nodes:
        if node.op_type in QUANTIZED_OPS:
            count[node.op_type] = count.get(node.op_type, 0) + 1
    return count


def model_budget(accuracy: Accuracy, proto) -> tuple:
    """(the budget a model is judged by, why, or "" where it is ``accuracy`` as given): a
    quantized ONNX model under the strict f32 budget is judged by ``int8_model_budget``
    (its own precision) instead."""
    if not accuracy.strict or proto is None:
        return accuracy, ""
    ops = quantized_ops(proto)
    if not ops:
        return accuracy, ""
    found = ", ".join(f"{n} {op}" for op, n in sorted(ops.items(), key=lambda kv: -kv[1]))
    why = (f"the model is quantized ({found}): its builds are judged within "
           f"{INT8_MODEL_TOLERANCE:g} of the output scale (two int8 implementations round "
           "differently in every quantized layer), not by f32 rounding; every backend runs "
           "at f32 beyond what the model quantizes")
    return replace(int8_model_budget(), why=why), why


def output_scale(reference) -> float:
    """An output's largest magnitude (0 when it is empty or all NaN)."""
    ref = np.asarray(reference, "float64")
    if not ref.size or np.all(np.isnan(ref)):
        return 0.0
    return float(np.nanmax(np.abs(ref)))


def scaled_atol(atol: float, scale: float) -> float:
    """The absolute tolerance for outputs whose largest magnitude is ``scale``: ``atol``
    at scale 1, at most 1e-3 of the scale below it (random weights can leave outputs at
    1e-9, which a fixed atol would match trivially), and ``atol`` times the scale above it
    (float32 elements near zero in an output reaching 1e9, inception_v3's with random
    batch-norm statistics, carry rounding errors of thousands)."""
    if scale <= 0:
        return atol
    return min(atol, 1e-3 * scale) if scale <= 1 else atol * scale


def relative_error(outputs, reference) -> float:
    """The largest ``max|out - ref| / max|ref|`` over the outputs (inf on a shape mismatch;
    an output whose reference is all zero counts its absolute error)."""
    worst = 0.0
    if len(outputs) != len(reference):
        return float("inf")
    for out, ref in zip(outputs, reference):
        out, ref = np.asarray(out, "float64"), np.asarray(ref, "float64")
        if out.shape != ref.shape:
            return float("inf")
        if not ref.size:
            continue
        diff = _abs_diff(out, ref)
        scale = output_scale(ref)
        # NaN left in the difference: one side has a number where the other has none
        err = float("inf") if np.isnan(diff).any() else float(np.max(diff))
        worst = max(worst, err / scale if scale > 0 else err)
    return worst


def _abs_diff(a, b) -> np.ndarray:
    """``|a - b|`` in float64, 0 where both are NaN (sqrt of a negative input: no error)."""
    d = np.atleast_1d(np.abs(a.astype("float64") - b.astype("float64")))
    d[np.atleast_1d(np.isnan(a) & np.isnan(b))] = 0.0
    return d


@functools.lru_cache(maxsize=None)
def cpu_precisions() -> dict:
    """precision -> (available, why): bf16 needs the CPU's bf16 instructions; the reason
    names the flag found (``avx512_bf16``, ``amx_bf16``) or that none was."""
    found = bf16_flags()
    out = {"f32": (True, "")}
    if found:
        out["bf16"] = (True, f"CPU flag {found[0]}")
    elif _cpu_flags():
        out["bf16"] = (False, "the CPU has no bf16 instructions (no avx512_bf16 or amx_bf16 "
                              "flag in /proc/cpuinfo)")
    else:
        out["bf16"] = (False, "the CPU's flags could not be read (/proc/cpuinfo)")
    return out


def bf16_flags() -> list:
    """The CPU's bf16 instructions among its flags (``amx_bf16``, ``avx512_bf16``; AMX's
    first): empty where it has none or they cannot be read."""
    flags = _cpu_flags()
    return [f for f in ("amx_bf16", "avx512_bf16") if f in flags]


def _cpu_flags() -> set:
    """The CPU's instruction-set flags (``/proc/cpuinfo``); empty where they cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
