"""Collage as a Relax pipeline stage: ``tvm.compile(mod, target, relax_pipeline=pipeline(...))``."""
from __future__ import annotations

import tvm

from .build import optimize_module
from .options import SearchOptions
from .tuning import pipeline as tuning_pipeline


def pipeline(backends=None, db=None, placement_log=None, *, options: SearchOptions | None = None,
             **option_fields):
    """A module pass: Collage partition + external lowering, then TVM's default pipeline
    (on CPU with the tuning database's records applied, as ``optimize`` builds). Arguments
    as ``collage_tvm.optimize``."""
    options = SearchOptions.of(options, backends=backends, **option_fields)

    @tvm.transform.module_pass(opt_level=0, name="CollagePipeline")
    def _collage(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        target = tvm.target.Target.current()
        if target is None:
            raise ValueError("collage_tvm.pipeline needs a target (tvm.compile passes it)")
        lowered, tuned = optimize_module(mod, target, options, db, placement_log)
        return tuning_pipeline(target, tuned.database if tuned is not None else None)(lowered)

    return _collage
