"""Collage as a Relax pipeline stage: ``tvm.compile(mod, target, relax_pipeline=pipeline(...))``."""
from __future__ import annotations

import tvm
from tvm import relax


def pipeline(backends=("tvm", "dnnl"), db=None, placement_log=None, progress: bool = True,
             isolate: bool = True):
    """A module pass: Collage partition + external lowering, then TVM's default pipeline."""

    @tvm.transform.module_pass(opt_level=0, name="CollagePipeline")
    def _collage(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        from .build import optimize_module

        target = tvm.target.Target.current()
        if target is None:
            raise ValueError("collage_tvm.pipeline needs a target (tvm.compile passes it)")
        lowered = optimize_module(mod, target, backends, db, placement_log, progress, isolate)
        return relax.get_default_pipeline(target)(lowered)

    return _collage
