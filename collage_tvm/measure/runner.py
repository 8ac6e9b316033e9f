"""Build candidates on their backends and time them (in whatever process calls this).

Each entry point takes ``[(func, backend, key), ...]``, the target, and ``build_vm(func,
backend, target) -> VirtualMachine``: how a candidate is built exactly as the final build
would run it. The build lives in a later stage (``collage_tvm.byoc.candidate_vm``) and
comes in as that callback, so measuring never imports it; the measurement worker gets it
by pickle (a reference to the function, not its code). ``key`` names the function for
the cache of built candidates (see ``_vm_and_args``), or is None.
"""
from __future__ import annotations

import hashlib
import inspect
import os
from collections import OrderedDict

import tvm

from ..graph.subgraph import constant_bytes, random_inputs, tensor_bytes
from ..target import device_sync, target_device
from .cuda_graph import capture
from .timing import time_main, time_side_by_side, time_switch

# What the worker may be asked to run (``Worker.call``).
ENTRY_POINTS = ("measure_function", "measure_switch", "measure_side_by_side", "prebuild",
                "run_callback", "release")

# Built candidates kept for the next measurement of the same one (the second pass of the
# library candidates, side-by-side re-timing): a build is 10-50 ms, as long as the timing.
# Least recently used first out once their weights and inputs pass CACHE_BYTES.
CACHE_BYTES = 1 << 30
_built: OrderedDict = OrderedDict()  # key -> (vm, args, bytes)


# Caches of later stages that a measuring child empties with its own between measurers
# (``byoc.external`` adds its lowered library callables, each holding its library's copy of
# the weights): measuring does not import them, they register here.
_ALSO_CLEARED: list = []


def also_cleared(fn) -> None:
    """Have ``clear_cache(everything=True)`` call ``fn()`` too."""
    if fn not in _ALSO_CLEARED:
        _ALSO_CLEARED.append(fn)


def clear_cache(everything: bool = False) -> None:
    """Forget every built candidate (the measurer calls it when it starts and closes);
    ``everything``: the caches registered with ``also_cleared`` too (a measuring child
    when its measurer changes or closes: the child outlives the search)."""
    _built.clear()
    if everything:
        for fn in _ALSO_CLEARED:
            fn()


def _held_bytes(func) -> int:
    """What a built ``func`` holds: its weights, plus its inputs and as much again four
    times over for the buffers the VM keeps (a rough bound)."""
    return 5 * sum(tensor_bytes(p.ty.shape, p.ty.dtype) for p in func.params) + sum(
        constant_bytes(b.value) for block in func.body.blocks for b in block.bindings)


def _vm_and_args(func, backend, target, build_vm, key=None) -> tuple:
    """A VM running ``func`` on ``backend`` and random inputs for it. With a ``key`` (the
    measurer's DB key: functions under one key differ at most in their weights' values,
    which do not change their time), built once and then taken from the cache; a build
    process may have built it already (``prebuild``)."""
    if key is None:
        return _build(func, backend, target, build_vm)
    cached = (backend.name, str(target), repr(build_vm), key)
    hit = _built.get(cached)
    if hit is not None:
        _built.move_to_end(cached)
        return hit[0], hit[1]
    vm, args = _load_prebuilt(func, backend.name, key, target) or \
        _build(func, backend, target, build_vm)
    size = _held_bytes(func)
    if size <= CACHE_BYTES // 4:
        _built[cached] = (vm, args, size)
        total = sum(v[2] for v in _built.values())
        while total > CACHE_BYTES:
            total -= _built.popitem(last=False)[1][2]
    return vm, args


def _build(func, backend, target, build_vm) -> tuple:
    dev = target_device(target)
    vm = build_vm(func, backend, target)
    return vm, [tvm.runtime.tensor(a, dev) for a in random_inputs(func)]


# ------------------------------------------------------------------ builds in other processes
# Building a TVM candidate is most of measuring it where timing is quick: on a GPU a
# kernel runs in microseconds and its build (TVM's passes, then NVRTC) takes a few hundred
# milliseconds. Build processes (``measure.worker.WorkerPool``) compile the candidates
# the measuring process will time and export each as a shared library into one folder;
# the measuring process loads a candidate from there instead of building it. Only
# candidates that are TVM kernels alone travel this way: a library's callable lives in the
# process that made it.
_prebuilt_root: str | None = None


def prebuilt_path(root: str, backend_name: str, key: str) -> str:
    """Where the build of (backend, DB key) is exported under ``root``."""
    digest = hashlib.sha256(f"{backend_name}|{key}".encode()).hexdigest()[:40]
    return os.path.join(root, f"{digest}.so")


def can_prebuild(build_vm) -> bool:
    """Whether ``build_vm`` can hand over an executable (``lower.candidate_vm``'s
    ``executable=True``) for a build process to export."""
    try:
        return "executable" in inspect.signature(build_vm).parameters
    except (TypeError, ValueError):
        return False


def use_prebuilt(root: str | None) -> None:
    """Take builds from ``root`` in this process (None: build everything here); a
    measuring child learns its measurer's folder with each request (``worker._message``)."""
    global _prebuilt_root
    _prebuilt_root = root


def prebuild(funcs: list, target, build_vm, root: str) -> tuple:
    """Build each ``(func, backend, key)`` and export it under ``root``
    (``prebuilt_path``); raises on a failed build (the measuring process then builds it
    again and records the failure with its reason, as it would have anyway). A library
    candidate (its lowering's ``build_cache``) is built and run once instead, filling its
    library's cache on disk: its callable cannot leave this process."""
    for func, backend, key in funcs:
        if backend.is_external:
            vm, args = _build(func, backend, target, build_vm)
            vm["main"](*args)
            sync = device_sync(target)
            if sync is not None:
                sync()
            continue
        executable = build_vm(func, backend, target, executable=True)
        path = prebuilt_path(root, backend.name, key)
        tmp = f"{path}.{os.getpid()}.tmp.so"
        executable.export_library(tmp)
        os.replace(tmp, path)  # whole or absent for the measuring process
    return 0.0, None, {}


def _load_prebuilt(func, backend_name: str, key: str, target) -> tuple | None:
    """(VM, inputs) from a build process's export of (backend, key), which is then
    deleted (its code stays mapped); None when there is none."""
    if _prebuilt_root is None:
        return None
    path = prebuilt_path(_prebuilt_root, backend_name, key)
    if not os.path.exists(path):
        return None
    from tvm import relax

    dev = target_device(target)
    try:
        vm = relax.VirtualMachine(tvm.runtime.load_module(path), dev)
    except Exception:  # noqa: BLE001 - a broken export is built again here
        return None
    finally:
        os.remove(path)
    return vm, [tvm.runtime.tensor(a, dev) for a in random_inputs(func)]


def measure_function(funcs: list, target, build_vm, cutoff_ms=None, flush_bytes=0) -> tuple:
    """(cost_ms, reason, extra) of the one ``(func, backend, key)``; raises on build/run
    failure. ``flush_bytes``: timed with cold caches (``time_main``)."""
    (entry,) = funcs
    vm, args = _vm_and_args(*entry[:2], target, build_vm, entry[2])
    return time_main(vm, args, target_device(target), cutoff_ms=cutoff_ms,
                     sync=device_sync(target), flush_bytes=flush_bytes,
                     run=capture(vm, args, target))


def _call(vm, args, target) -> tuple:
    """``(fn, args)`` that runs a candidate once: on a GPU its CUDA graph's replay where it
    was captured (``cuda_graph.capture``: as the final build runs), else the VM's main."""
    main = capture(vm, args, target)
    return (main.replay, []) if main.captured else (vm["main"], args)


def measure_switch(funcs: list, target, build_vm) -> tuple:
    """(switch_ms, reason, extra) between two ``(probe func, backend, key)``: see
    ``time_switch``."""
    (fn_a, args_a), (fn_b, args_b) = (_call(*_vm_and_args(f, b, target, build_vm, k), target)
                                      for f, b, k in funcs)
    cost, extra = time_switch(fn_a, args_a, fn_b, args_b, sync=device_sync(target))
    return cost, None, extra


def measure_side_by_side(funcs: list, target, build_vm, flush_bytes=0) -> tuple:
    """(list of ms, None, extra) of ``[(func, backend, key), ...]`` timed side by side
    (``flush_bytes``: with cold caches)."""
    runs = [_call(*_vm_and_args(f, b, target, build_vm, k), target) for f, b, k in funcs]
    return time_side_by_side(runs, sync=device_sync(target), flush_bytes=flush_bytes), None, {}


def run_callback(funcs: list, target, build_vm, fn, *args) -> tuple:
    """``fn(funcs, target, *args)``: the reply (result, reason, extra) of a later stage's work
    where the measuring runs (the final check on an RPC server: ``check.remote.judge_here``),
    ``fn`` coming in by pickle like ``build_vm`` (a reference, not its code); ``funcs``
    carry the backends (their functions may be None)."""
    return fn(funcs, target, *args)


def release(funcs: list, target, build_vm) -> tuple:
    """Forget every built candidate and hand the freed heap back: a measurer closing frees
    what the measuring child kept for it (the child stays for the next measurer:
    ``worker.shared_worker``), so an idle child does not sit on a large model's builds."""
    from .._memory import release_memory

    clear_cache(everything=True)
    release_memory()
    return 0.0, None, {}
