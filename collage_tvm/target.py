"""Targets and device fingerprints."""
from __future__ import annotations

import functools
import os
import platform

import tvm


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def make_target(target="llvm") -> tvm.target.Target:
    """``"llvm"`` means this host: its CPU (so LLVM uses AVX2/AVX-512) and its cores."""
    if isinstance(target, tvm.target.Target):
        return target
    if isinstance(target, dict):
        return tvm.target.Target(target)
    if target in ("llvm", "cpu"):
        spec = {"kind": "llvm", "num-cores": host_cores()}
        cpu = tvm.target.codegen.llvm_get_system_cpu()
        if cpu and cpu != "generic":
            spec["mcpu"] = cpu
        return tvm.target.Target(spec)
    if isinstance(target, str) and target.startswith("{"):
        import json

        return tvm.target.Target(json.loads(target))
    raise ValueError(f"unsupported target {target!r}: use 'llvm' or a target dict "
                     "(GPU targets come with the GPU backends)")


def target_device(target: tvm.target.Target):
    return tvm.cuda() if target.kind.name == "cuda" else tvm.cpu()


@functools.lru_cache(maxsize=None)
def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_fingerprint(target: tvm.target.Target) -> str:
    """What a measured cost depends on besides the kernel: CPU model, cores, target."""
    return f"{cpu_model()}|{host_cores()}c|{target.kind.name}:{target.attrs.get('mcpu', '')}"
