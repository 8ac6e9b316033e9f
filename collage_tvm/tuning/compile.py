"""TVM's kernels of a Relax function, and the compile pipeline that may apply tuned schedules.

Every TVM build Collage makes (a candidate being measured, a single-backend build, the final
placement) goes through :func:`compile_module`: TVM's CPU pipeline (legalize, then fuse
operators into kernels, then lower), plus, when a tuning database is given, its records
applied to the kernels after fusion (``MetaScheduleApplyDatabase``). :func:`kernels` runs
the same legalize-and-fuse steps, so a kernel found there is the kernel the build compiles:
what the tuner tunes and what a candidate's tuning signature names.

``tvm.compile``'s own default pipeline for CPU does not fuse: each operator is its own
kernel, and the ``tvm`` backend's fused candidates ran as separate loops. Using the CPU
pipeline is what makes a fused TVM candidate one kernel.
"""
from __future__ import annotations

import tvm
from tvm import relax
from tvm_ffi.structural import structural_hash


def _cpu_passes(target):
    from tvm.relax.backend.cpu_generic import pipeline as cpu_generic

    return cpu_generic, cpu_generic.library_dispatch_passes(target) + \
        cpu_generic.legalize_passes(target)


def fuse(mod: tvm.IRModule, target) -> tvm.IRModule:
    """``mod`` legalized and fused into TIR kernels, as :func:`compile_module` does it."""
    with target:
        return tvm.transform.Sequential(_cpu_passes(target)[1])(mod)


def pipeline(target, database=None):
    """TVM's CPU pipeline, with ``database``'s tuning records applied after fusion; for
    another target (CUDA), TVM's default pipeline for it."""
    if target.kind.name != "llvm":
        return relax.get_default_pipeline(target)
    cpu_generic, front = _cpu_passes(target)

    @tvm.transform.module_pass(opt_level=0, name="CollageTVMPipeline")
    def _pipeline(mod, _ctx):
        with target:
            mod = tvm.transform.Sequential(front)(mod)
            if database is not None:
                with database:
                    mod = relax.transform.MetaScheduleApplyDatabase(enable_warning=False)(mod)
            return tvm.transform.Sequential(cpu_generic.dataflow_lower_passes(target)
                                            + cpu_generic.finalize_passes(target))(mod)

    return _pipeline


def compile_module(mod: tvm.IRModule, target, database=None):
    """``tvm.compile`` of ``mod`` through :func:`pipeline`, runnable without a C compiler
    when it has no kernel of its own (:func:`skip_empty_link`); on a CUDA target with CUDA
    graphs where that is safe (:func:`cuda_graph_safe`)."""
    config = {}
    if target.kind.name == "cuda" and cuda_graph_safe(mod):
        config[CUDA_GRAPH] = True
    cur = tvm.transform.PassContext.current()
    with tvm.transform.PassContext(opt_level=cur.opt_level, config={**dict(cur.config), **config},
                                   required_pass=list(cur.required_pass),
                                   disabled_pass=list(cur.disabled_pass)):
        return skip_empty_link(tvm.compile(mod, target,
                                           relax_pipeline=pipeline(target, database)))


#: TVM's switch for ``RewriteCUDAGraph`` (in its default CUDA pipeline): static regions of
#: the VM's calls captured once as a CUDA graph and replayed, one launch instead of many.
CUDA_GRAPH = "relax.backend.use_cuda_graph"


def cuda_graph_safe(mod: tvm.IRModule) -> bool:
    """Whether ``mod`` may run as CUDA graphs: it calls no external backend. TVM's pass
    would capture an external call too (``R.call_pure_packed`` into a cuDNN or cuBLAS call
    through torch), and torch's caching allocator hands out and reuses memory that a
    replayed graph would still write to; a placement with external calls runs its kernels
    one launch each, and the search charges each call its measured overhead (epsilon)."""
    attrs = mod.attrs
    return attrs is None or "collage.symbols" not in attrs or not list(attrs["collage.symbols"])


def _empty_source(m) -> bool:
    """Whether runtime module ``m`` is C source with no code (what the VM link makes when
    there is no TIR kernel: ``;``)."""
    try:
        return m.kind == "c" and not m.inspect_source().strip(" \n;")
    except Exception:  # noqa: BLE001 - unknown module: not known to be empty
        return False


def skip_empty_link(executable):
    """``executable`` made runnable as it is when the only modules it holds that need a C
    compiler are empty: a module whose every group runs on an external backend has no TIR
    kernel, and the VM link then imports an empty C source module. ``Executable.jit`` would
    compile and link that with the system's C compiler (about 35 ms, once per candidate
    measured); the VM never calls into it."""
    mod = executable.mod
    pending = [mod]
    while pending:
        m = pending.pop()
        if m.kind in ("c", "static_library") and not _empty_source(m):
            return executable
        pending.extend(m.imports)
    executable._jitted_mod = mod  # what jit() returns for a tree with nothing to link
    return executable


def kernels(func: relax.Function, target) -> list:
    """``[(name, kernel), ...]``: the TIR kernels (fused PrimFuncs) TVM compiles ``func``
    into, in a stable order; ``kernel_key`` identifies one across models."""
    if "global_symbol" not in (func.attrs or {}):
        func = func.with_attr("global_symbol", "main")  # else fusion drops it as dead code
    fused = fuse(tvm.IRModule({"main": func}), target)
    out = [(gv.name_hint, f) for gv, f in fused.functions.items()
           if isinstance(f, tvm.tirx.PrimFunc)]
    return sorted(out, key=lambda nf: nf[0])


def kernel_key(kernel) -> str:
    """A kernel's structural hash (names of the function and its buffers aside), as hex."""
    return f"{structural_hash(kernel) & (2 ** 64 - 1):016x}"


def workload(kernel) -> tvm.IRModule:
    """The kernel as MetaSchedule keys its workloads: one function named ``main``."""
    from tvm.s_tir.meta_schedule.tune_context import _normalize_mod

    return _normalize_mod(kernel)
