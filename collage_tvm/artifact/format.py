"""The artifact's format, shared by ``save`` and ``load``: the manifest's name and format
version, the names of the files beside it, the error both raise, the CPU features a build
records as needs and a load checks, and the manifest's JSON form (``_jsonable``)."""
from __future__ import annotations

import math

import numpy as np

FORMAT = "collage-tvm-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KERNELS = "kernels.so"
REGIONS = "regions"
# The user's model file, where an alternate at load runs it (``_save_regions``)
ALTERNATE_FILE = "model_file.onnx"
# A dynamic model's static build at the optimum, an artifact of its own inside this one
STATIC = "static"
PLACEMENT = "placement.json"

# LLVM features whose instructions TVM's kernels may hold: a CPU without one of them cannot
# run kernels compiled with it (SIGILL). The others LLVM lists for a CPU model (movdiri,
# wbnoinvd, ...) are not emitted for tensor code.
_ISA_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi", "lzcnt", "popcnt", "neon",
                 "sve", "fp16", "bf16", "dotprod", "i8mm")
BF16_FEATURES = ("avx512bf16", "amx-bf16")  # precision.cpu_precisions: either one


class ArtifactError(Exception):
    """A saved build that cannot be written or loaded here; the message says why and what
    to install or rebuild."""


# ---------------------------------------------------------------------------- machine

def host_cpu_features() -> set | None:
    """The features of this machine's CPU as LLVM names them (``avx512f``, ``amx-bf16``);
    None when they cannot be read."""
    import tvm

    get = tvm.get_global_func("tvm.codegen.llvm.GetHostCPUFeatures", allow_missing=True)
    if get is None:
        return None
    try:
        return {str(k) for k, v in get().items() if bool(v)}
    except Exception:  # noqa: BLE001 - unknown: not checked
        return None


def _kernel_features(target) -> list:
    """The instruction-set features TVM's kernels for ``target`` may use: those LLVM
    enables for its CPU model that are vector or bit-manipulation extensions; for this
    machine's own CPU model, only those this CPU has (LLVM lists a few for the model that
    a given part lacks, and the kernels ran here)."""
    import tvm

    if target.kind.name != "llvm":
        return []
    try:
        features = {str(f) for f in tvm.target.codegen.llvm_get_cpu_features(target)}
    except Exception:  # noqa: BLE001 - an LLVM without the query: nothing to require
        return []
    mcpu = str(target.attrs.get("mcpu", "") or "")
    if mcpu and mcpu == str(tvm.target.codegen.llvm_get_system_cpu()):
        host = host_cpu_features()
        if host:
            features &= host
    return sorted(f for f in features if f.startswith(_ISA_PREFIXES))


def _jsonable(value):
    """``value`` with NaN/inf as None and tuples, numpy scalars and TVM strings plain."""
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, tuple) else "<->".join(map(str, k)): _jsonable(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return None if not math.isfinite(float(value)) else float(value)
    if value is None or isinstance(value, str):
        return value
    return str(value)
