"""Targets and device fingerprints."""
from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import platform

import tvm


def host_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# The cores a library lowered now may use (``thread_share``); None: all of this process's.
_SHARE: contextvars.ContextVar = contextvars.ContextVar("collage_thread_share", default=None)


@contextlib.contextmanager
def thread_share(threads: int | None):
    """Libraries lowered inside use ``threads`` threads (a concurrent stage's share of the
    cores, ``collage_tvm.schedule``); ``None``: every core, as outside."""
    if threads is not None and (isinstance(threads, bool) or int(threads) < 1):
        raise ValueError(f"a thread share is a positive count, not {threads!r}")
    token = _SHARE.set(None if threads is None else int(threads))
    try:
        yield
    finally:
        _SHARE.reset(token)


def library_threads() -> int:
    """Threads a library lowered now may use: the current ``thread_share``, else every core
    this process may run on."""
    share = _SHARE.get()
    return share if share is not None else host_cores()


def share_now() -> int | None:
    """The current ``thread_share`` (None outside one)."""
    return _SHARE.get()


def tvm_threads() -> int:
    """How many threads TVM's runtime runs a parallel kernel on (its pool's size)."""
    return int(tvm.get_global_func("runtime.NumThreads")())


def make_target(target="llvm") -> tvm.target.Target:
    """``"llvm"`` means this host: its CPU (so LLVM uses AVX2/AVX-512) and its cores. A
    host CPU target given any other way (``Target({"kind": "llvm"})``, a dict, JSON) without
    an ``mcpu`` is the same target: this CPU's ``mcpu`` and cores are filled in (``host``),
    so it compiles for this CPU and finds the costs and tuning records measured here."""
    if isinstance(target, tvm.target.Target):
        return _host(target)
    if isinstance(target, dict):
        return _host(tvm.target.Target(target))
    if target in ("llvm", "cpu"):
        return _host(tvm.target.Target({"kind": "llvm"}))
    if isinstance(target, str) and target.startswith("{"):
        import json

        return _host(tvm.target.Target(json.loads(target)))
    if target == "cuda":
        arch, why = cuda_arch()
        if arch is None:
            raise ValueError(f"target 'cuda': {why}. To build for a GPU that is not here, "
                             "name its architecture: 'cuda:sm_90'")
        return tvm.target.Target({"kind": "cuda", "arch": arch})
    if isinstance(target, str) and target.startswith("cuda:"):
        arch = target.split(":", 1)[1]
        if not (arch.startswith("sm_") and arch[3:].isdigit()):
            raise ValueError(f"target {target!r}: the architecture must look like sm_90")
        return tvm.target.Target({"kind": "cuda", "arch": arch})
    raise ValueError(f"unsupported target {target!r}: use 'llvm', 'cuda' (this machine's "
                     "GPU), 'cuda:sm_90' or a target dict")


def _host(target: tvm.target.Target) -> tvm.target.Target:
    """``target`` with this CPU's ``mcpu`` and ``num-cores`` filled in where it is an LLVM
    target for this host (no triple, or this host's) that names no CPU; else unchanged."""
    if target.kind.name != "llvm" or target.attrs.get("mcpu"):
        return target
    triple = str(target.attrs.get("mtriple", "") or "")
    if triple and triple != tvm.target.codegen.llvm_get_system_triple():
        return target  # another machine's: its CPU is not this one
    cpu = tvm.target.codegen.llvm_get_system_cpu()
    config = target.export()
    spec = {str(k): config[k] for k in config if str(k) not in ("tag", "keys", "mtriple")}
    if cpu and cpu != "generic":
        spec["mcpu"] = cpu
    spec.setdefault("num-cores", host_cores())
    return tvm.target.Target(spec)


def cuda_arch() -> tuple[str | None, str]:
    """(``"sm_90"``, "") for this machine's first CUDA device, else (None, why not).

    TVM's CUDA runtime loads only where ``libcudart`` of its CUDA is found: importing a
    CUDA build of torch first loads it (docs/DESIGN.md, platform facts)."""
    try:
        import torch  # noqa: F401 - loads libcudart for TVM's CUDA runtime, where it has one
    except Exception:  # noqa: BLE001 - no torch: TVM may still find CUDA on its own
        pass
    if tvm.get_global_func("device_api.cuda", True) is None:
        return None, ("TVM's CUDA runtime is not loaded (its libcudart.so was not found: "
                      "import a CUDA 13 build of torch first, or put CUDA 13's lib folder on "
                      "LD_LIBRARY_PATH)")
    dev = tvm.cuda(0)
    if not dev.exist:
        return None, "no CUDA device is visible"
    return "sm_" + str(dev.compute_version).replace(".", ""), ""


def device_kind(target: tvm.target.Target) -> str:
    """The device a backend declares for ``target``: "cuda" on a CUDA target, else "cpu"."""
    return "cuda" if target.kind.name == "cuda" else "cpu"


def target_device(target: tvm.target.Target):
    return tvm.cuda() if device_kind(target) == "cuda" else tvm.cpu()


def device_sync(target: tvm.target.Target):
    """What a timing loop calls before reading the clock: the GPU's synchronize on a CUDA
    target (a call returns once its kernels are queued), None on the CPU."""
    return tvm.cuda().sync if target.kind.name == "cuda" else None


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


@functools.lru_cache(maxsize=None)
def cache_bytes(level: int) -> int:
    """The size of CPU 0's unified or data cache of ``level`` (2: per core, 3: the last
    level), from sysfs; a common size where the machine does not say (1 MiB, 32 MiB)."""
    default = {2: 1 << 20, 3: 32 << 20}.get(level, 1 << 20)
    root = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for index in sorted(os.listdir(root)):
            path = os.path.join(root, index)
            if not index.startswith("index"):
                continue
            with open(os.path.join(path, "level")) as f:
                if int(f.read()) != level:
                    continue
            with open(os.path.join(path, "type")) as f:
                if f.read().strip() == "Instruction":
                    continue
            with open(os.path.join(path, "size")) as f:
                size = f.read().strip()
            units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
            return int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    except (OSError, ValueError):
        pass
    return default


def device_fingerprint(target: tvm.target.Target) -> str:
    """What a measured cost depends on besides the kernel: CPU model, cores, target; on a
    CUDA target the GPU's name and architecture too."""
    cpu = f"{cpu_model()}|{host_cores()}c"
    if target.kind.name == "cuda":
        dev = tvm.cuda(0)
        gpu = dev.device_name if dev.exist else "no-gpu"
        return f"{gpu}|{cpu}|cuda:{target.attrs.get('arch', '')}"
    return f"{cpu}|{target.kind.name}:{target.attrs.get('mcpu', '')}"
