"""TVM's BYOC flow, as Collage builds a placement (or one candidate) into one executable:
``partition`` makes each chosen group one function (a TVM primitive, or a ``Codegen``
function for a library), ``external`` lowers each library function through its backend's
:class:`~collage_tvm.lowering.Lowering` to a callable the VM calls, ``whole`` runs a model
TVM cannot import whole on a graph library; ``compile_placement`` does all of it."""
from __future__ import annotations

import functools

import tvm
from tvm import relax

from ..graph import DataflowGraph
from ..graph.subgraph import random_inputs
from ..placement import Candidate
from ..target import target_device
from ..tuning import active_database, use_tuning_db
from .external import forget_lowered, lower_external, release_with
from .partition import partition


def lower_placement(graph, groups, backends: dict, timings: dict | None = None):
    """Partition ``graph`` by ``groups`` and lower the external groups: ready for tvm.compile.
    ``timings``: see ``lower_external``."""
    return lower_external(partition(graph, groups, backends), backends, timings)


def compile_placement(graph, groups, backends: dict, target, timings: dict | None = None,
                      keep: bool = False):
    """(executable, lowered module) of a placement; ``timings``: see ``lower_external``.

    The external callables (and the weights they hold) are freed with the executable unless
    ``keep`` (the build handed to the user, who may make VMs from a jitted module later)."""
    mod = lower_placement(graph, groups, backends, timings)
    executable = compile_module(mod, target)
    if not keep:
        release_with(executable, mod)
    return executable, mod


def compile_module(mod: tvm.IRModule, target):
    """``tvm.compile`` through Collage's TVM pipeline (fused kernels), with the active
    tuning database's records applied (``collage_tvm.tuning``)."""
    from ..tuning import compile_module as compile_with

    db = active_database()
    return compile_with(mod, target, db.database if db is not None else None)


def candidate_vm(func: relax.Function, backend, target, tuning: str | None = None,
                 executable: bool = False):
    """A VM running ``func`` as one group on ``backend``, exactly as the final build would
    run that group (the measurer's ``build_vm``). ``tuning``: the tuning database's path
    (a measuring child process opens it once), else whatever database is active here.
    ``executable``: return the compiled executable instead of a VM on it (what a build
    process exports for the measuring process: ``measure.runner.prebuild``)."""
    graph = DataflowGraph(func)
    group = Candidate(backend.name, frozenset(range(len(graph))), "measure")
    with use_tuning_db(tuning, target):
        built, _ = compile_placement(graph, [group], {backend.name: backend}, target)
    return built if executable else relax.VirtualMachine(built, target_device(target))


def candidate_vm_for(tuning):
    """The measurer's ``build_vm`` for builds applying ``tuning`` (a ``TuningDB`` or None):
    ``candidate_vm`` told the database's path, which a measuring child opens."""
    return candidate_vm if tuning is None else functools.partial(candidate_vm,
                                                                 tuning=tuning.path)


def placement_runner(graph, backends: dict, target, seed: int = 0):
    """``make_run(groups, timings) -> run`` for in-context calibration: ``run()`` runs the
    placement once on fixed random inputs; external calls log their times in ``timings``."""
    dev = target_device(target)
    arrays = random_inputs(graph.func, seed)

    def make_run(groups, timings: dict):
        executable, _ = compile_placement(graph, groups, backends, target, timings)
        vm = relax.VirtualMachine(executable, dev)
        main, args = vm["main"], [tvm.runtime.tensor(a, dev) for a in arrays]
        return lambda vm=vm: main(*args)

    return make_run


__all__ = ["candidate_vm", "candidate_vm_for", "compile_module", "compile_placement",
           "forget_lowered", "lower_external", "lower_placement", "placement_runner", "release_with"]
