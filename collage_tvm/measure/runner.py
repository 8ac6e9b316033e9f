"""Build candidates on their backends and time them (in whatever process calls this).

Each entry point takes ``[(func, backend, key), ...]``, the target, and ``build_vm(func,
backend, target) -> VirtualMachine``: how a candidate is built exactly as the final build
would run it. The build lives in a later stage (``collage_tvm.lower.candidate_vm``) and
comes in as that callback, so measuring never imports it; the measurement worker gets it
by pickle (a reference to the function, not its code). ``key`` names the function for
the cache of built candidates (see ``_vm_and_args``), or is None.
"""
from __future__ import annotations

from collections import OrderedDict

import tvm

from ..graph.subgraph import constant_bytes, random_inputs, tensor_bytes
from ..target import device_sync, target_device
from .timing import time_main, time_side_by_side, time_switch

# What the worker may be asked to run (``Worker.call``).
ENTRY_POINTS = ("measure_function", "measure_switch", "measure_side_by_side")

# Built candidates kept for the next measurement of the same one (the second pass of the
# library candidates, side-by-side re-timing): a build is 10-50 ms, as long as the timing.
# Least recently used first out once their weights and inputs pass CACHE_BYTES.
CACHE_BYTES = 1 << 30
_built: OrderedDict = OrderedDict()  # key -> (vm, args, bytes)


def clear_cache() -> None:
    """Forget every built candidate (the measurer calls it when it starts and closes)."""
    _built.clear()


def _held_bytes(func) -> int:
    """What a built ``func`` holds: its weights, plus its inputs and as much again four
    times over for the buffers the VM keeps (a rough bound)."""
    return 5 * sum(tensor_bytes(p.ty.shape, p.ty.dtype) for p in func.params) + sum(
        constant_bytes(b.value) for block in func.body.blocks for b in block.bindings)


def _vm_and_args(func, backend, target, build_vm, key=None) -> tuple:
    """A VM running ``func`` on ``backend`` and random inputs for it. With a ``key`` (the
    measurer's DB key: functions under one key differ at most in their weights' values,
    which do not change their time), built once and then taken from the cache."""
    if key is None:
        return _build(func, backend, target, build_vm)
    key = (backend.name, str(target), repr(build_vm), key)
    hit = _built.get(key)
    if hit is not None:
        _built.move_to_end(key)
        return hit[0], hit[1]
    vm, args = _build(func, backend, target, build_vm)
    size = _held_bytes(func)
    if size <= CACHE_BYTES // 4:
        _built[key] = (vm, args, size)
        total = sum(v[2] for v in _built.values())
        while total > CACHE_BYTES:
            total -= _built.popitem(last=False)[1][2]
    return vm, args


def _build(func, backend, target, build_vm) -> tuple:
    dev = target_device(target)
    vm = build_vm(func, backend, target)
    return vm, [tvm.runtime.tensor(a, dev) for a in random_inputs(func)]


def measure_function(funcs: list, target, build_vm, cutoff_ms=None) -> tuple:
    """(cost_ms, reason, extra) of the one ``(func, backend, key)``; raises on build/run
    failure."""
    (entry,) = funcs
    vm, args = _vm_and_args(*entry[:2], target, build_vm, entry[2])
    return time_main(vm, args, target_device(target), cutoff_ms=cutoff_ms,
                     sync=device_sync(target))


def measure_switch(funcs: list, target, build_vm) -> tuple:
    """(switch_ms, reason, extra) between two ``(probe func, backend, key)``: see
    ``time_switch``."""
    (vm_a, args_a), (vm_b, args_b) = (_vm_and_args(f, b, target, build_vm, k)
                                      for f, b, k in funcs)
    cost, extra = time_switch(vm_a["main"], args_a, vm_b["main"], args_b,
                              sync=device_sync(target))
    return cost, None, extra


def measure_side_by_side(funcs: list, target, build_vm) -> tuple:
    """(list of ms, None, extra) of ``[(func, backend, key), ...]`` timed side by side."""
    vms = [_vm_and_args(f, b, target, build_vm, k) for f, b, k in funcs]
    return time_side_by_side([(vm["main"], args) for vm, args in vms],
                             sync=device_sync(target)), None, {}
