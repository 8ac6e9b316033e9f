"""Replace calls to ``Codegen`` functions with calls into each backend's compiled callable.

The wheel has no ``relax.ext.*`` codegens for our libraries, so instead of ``RunCodegen``
each external function is lowered by its backend to a Python callable, registered as a
global packed function *before* the VM is created, and called with
``R.call_pure_packed`` (tensors cross by DLPack, zero-copy).
"""
from __future__ import annotations

import collections
import itertools
import os
import time
import weakref

import tvm
from tvm_ffi.structural import structural_equal, structural_hash
from tvm import relax

from ..measure.cuda_graph import replays_its_own_graph
from ..measure.runner import also_cleared
from ..target import share_now
from .partition import CODEGEN_PREFIX

# Registered callables by symbol. The VM resolves a packed function when it is created, so
# a registration must live as long as an executable that may still make a VM: see
# ``release_with``; those nobody releases live for the life of the process.
_LIVE: dict = {}
# How each live symbol's callable was made, for ``collage_tvm.save`` (``artifact``) to make it
# again in another process: ``("relax", backend name, the group's function)`` or, for a model
# run whole by a library, ``("onnx", backend name, ModelProto, output specs)``. Dropped with
# the registration.
_RECIPES: dict = {}
_COUNTER = itertools.count()
# Lowered callables by (backend, whole-model flag, structural hash incl. weights): the
# graph-level search rebuilds placements that share most groups, and a graph library's
# compile (an ONNX Runtime session, an OpenVINO model) is the slow part of a build. Each
# lowered callable holds the backend's own copy of the group's weights, so the cache is
# bounded by weight bytes (``COLLAGE_LOWER_CACHE_MB``, default 15% of the machine's memory),
# not only by count: at paper size one whole-model session is hundreds of MB.
_CACHE: "collections.OrderedDict" = collections.OrderedDict()
_CACHE_SIZE = 256


def _cache_budget_bytes() -> int:
    env = os.environ.get("COLLAGE_LOWER_CACHE_MB")
    if env:
        return int(float(env) * 2**20)
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * 2**30
    return int(0.15 * total)


def weight_bytes(func) -> int:
    """Bytes of the constants (weights) bound in ``func``."""
    from ..graph.subgraph import Constant

    seen, total = set(), 0

    def visit(e):
        nonlocal total
        if isinstance(e, Constant) and e not in seen:
            seen.add(e)
            value = e.value
            n = 1
            for d in value.shape:
                n *= int(d)
            total += n * tvm.runtime.DataType(str(value.dtype)).bits // 8

    relax.analysis.post_order_visit(func.body, visit)
    return total


def _lower_cached(backend, func):
    sole = bool(func.attrs.get("collage.sole_group", False))
    plain = relax.Function(func.params, func.body, func.ret_ty)
    key = (backend.name, backend.version(), sole, share_now(), structural_hash(plain))
    hit = _CACHE.get(key)
    if hit is not None and structural_equal(hit[0], plain):
        _CACHE.move_to_end(key)
        return hit[1]
    fn = backend.get_lowering().lower(func)
    _CACHE[key] = (plain, fn, weight_bytes(plain))
    budget = _cache_budget_bytes()
    while len(_CACHE) > 1 and (len(_CACHE) > _CACHE_SIZE
                               or sum(v[2] for v in _CACHE.values()) > budget):
        _CACHE.popitem(last=False)
    return fn


def forget_lowered() -> None:
    """Empty the cache of lowered callables (``_lower_cached``). Each holds its library's
    copy of its group's weights (an ONNX Runtime session or an OpenVINO model takes about
    twice the weights' bytes): a search's losing contenders would otherwise stay in memory
    after it, as would a measuring child's candidates after their search (the child serves
    the next one). A callable an executable registered lives on with it (``_LIVE``)."""
    _CACHE.clear()


also_cleared(forget_lowered)  # a measuring child between measurers


def _release(symbols) -> None:
    import tvm_ffi

    for symbol in symbols:
        replays_its_own_graph(symbol, False)
        _RECIPES.pop(symbol, None)
        if _LIVE.pop(symbol, None) is not None:
            try:
                tvm_ffi.remove_global_func(symbol)
            except Exception:  # noqa: BLE001 - already gone: nothing to free
                pass


def registered_symbols(mod: tvm.IRModule) -> list:
    """The packed-function symbols ``lower_external`` registered for ``mod``."""
    attrs = mod.attrs
    if attrs is None or "collage.symbols" not in attrs:
        return []
    return [str(s) for s in attrs["collage.symbols"]]


def recipe(symbol: str) -> tuple | None:
    """How the callable registered as ``symbol`` was made (``_RECIPES``); None when unknown
    or released."""
    return _RECIPES.get(symbol)


def live(symbol: str):
    """The callable registered as ``symbol`` (None when released or unknown)."""
    return _LIVE.get(symbol)


def release_with(executable, mod: tvm.IRModule) -> None:
    """Unregister ``mod``'s external callables (and free their weights) once ``executable`` is
    garbage: a VM made from it keeps the functions it resolved, so running VMs are unaffected.
    For the many executables a search builds and throws away."""
    symbols = registered_symbols(mod)
    if symbols:
        weakref.finalize(executable, _release, symbols)


def register(prefix: str, fn, how: tuple | None = None) -> str:
    """Register ``fn`` as a global packed function under a fresh symbol ``<prefix>.<n>``,
    kept alive in ``_LIVE`` until ``release_with`` frees it; returns the symbol.
    ``how``: how ``fn`` was made (see ``_RECIPES``), what ``collage_tvm.save`` writes."""
    symbol = f"{prefix}.{next(_COUNTER)}"
    tvm.register_global_func(symbol, fn, override=True)
    _LIVE[symbol] = fn
    if how is not None:
        _RECIPES[symbol] = how
    if getattr(fn, "captures_itself", False):  # no capture of the executable around it
        replays_its_own_graph(symbol)
    return symbol


def _timed(fn, log: list):
    clock = time.perf_counter

    def call(*args):
        t0 = clock()
        out = fn(*args)
        log.append(clock() - t0)
        return out

    call.captures_itself = getattr(fn, "captures_itself", False)
    return call


def lower_external(mod: tvm.IRModule, backends: dict, timings: dict | None = None) -> tvm.IRModule:
    """Lower every ``Codegen=collage_<backend>`` function of ``mod``; returns the new module.

    ``timings``: when given, each external call appends its wall time (s) to
    ``timings[group index]`` (the ``collage.group`` attribute partition sets): the
    in-context cost of each group in a whole run (``placer.calibrate``).
    """
    symbols = {}
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, relax.Function) or func.attrs is None:
            continue
        codegen = func.attrs.get("Codegen")
        if codegen is None or not str(codegen).startswith(CODEGEN_PREFIX):
            continue
        name = str(codegen)[len(CODEGEN_PREFIX):]
        if name not in backends:
            raise KeyError(f"function {gv.name_hint} asks for backend {name!r}, which is not loaded")
        fn = _lower_cached(backends[name], func)
        if timings is not None:
            fn = _timed(fn, timings.setdefault(int(func.attrs["collage.group"]), []))
        symbol = register(str(func.attrs["global_symbol"]), fn, ("relax", name, func))
        symbols[gv] = (symbol, func.ret_ty)
    if not symbols:
        return mod

    @relax.expr_functor.mutator
    class _Rewrite(relax.PyExprMutator):
        def visit_call_(self, call):  # noqa: N802 (TVM's visitor naming)
            call = super().visit_call_(call)
            if isinstance(call.op, relax.GlobalVar) and call.op in symbols:
                symbol, ret_ty = symbols[call.op]
                return relax.op.call_pure_packed(symbol, *call.args, ty_args=ret_ty)
            return call

    new_mod = tvm.IRModule()
    for gv, func in mod.functions.items():
        if gv in symbols:
            continue
        if isinstance(func, relax.Function):
            func = _Rewrite().visit_expr(func)
        new_mod[gv] = func
    new_mod = new_mod.with_attr("collage.symbols", [s for s, _ in symbols.values()])
    return new_mod
