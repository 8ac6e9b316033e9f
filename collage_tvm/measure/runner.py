"""Build candidates on their backends and time them (in whatever process calls this).

Each entry point takes ``[(func, backend), ...]``, the target, and ``build_vm(func,
backend, target) -> VirtualMachine``: how a candidate is built exactly as the final build
would run it. The build lives in a later stage (``collage_tvm.lower.candidate_vm``) and
comes in as that callback, so measuring never imports it; the measurement worker gets it
by pickle (a reference to the function, not its code).
"""
from __future__ import annotations

import tvm

from ..graph.subgraph import random_inputs
from ..target import target_device
from .timing import time_main, time_side_by_side, time_switch

# What the worker may be asked to run (``Worker.call``).
ENTRY_POINTS = ("measure_function", "measure_switch", "measure_side_by_side")


def _vm_and_args(func, backend, target, build_vm) -> tuple:
    dev = target_device(target)
    vm = build_vm(func, backend, target)
    return vm, [tvm.runtime.tensor(a, dev) for a in random_inputs(func.params)]


def measure_function(funcs: list, target, build_vm, cutoff_ms=None) -> tuple:
    """(cost_ms, reason, extra) of the one ``(func, backend)``; raises on build/run failure."""
    (func, backend), = funcs
    vm, args = _vm_and_args(func, backend, target, build_vm)
    return time_main(vm, args, target_device(target), cutoff_ms=cutoff_ms)


def measure_switch(funcs: list, target, build_vm) -> tuple:
    """(switch_ms, reason, extra) between two ``(probe func, backend)``: see ``time_switch``."""
    (vm_a, args_a), (vm_b, args_b) = (_vm_and_args(f, b, target, build_vm) for f, b in funcs)
    cost, extra = time_switch(vm_a["main"], args_a, vm_b["main"], args_b)
    return cost, None, extra


def measure_side_by_side(funcs: list, target, build_vm) -> tuple:
    """(list of ms, None, extra) of ``[(func, backend), ...]`` timed side by side."""
    vms = [_vm_and_args(f, b, target, build_vm) for f, b in funcs]
    return time_side_by_side([(vm["main"], args) for vm, args in vms]), None, {}
