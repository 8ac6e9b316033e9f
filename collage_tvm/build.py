"""``collage_tvm.optimize`` / ``build`` / ``search``: the public entry points of one build.

import -> candidates -> measure -> op-level placement (refined, calibrated) -> graph-level
placement -> final check -> partition and lower -> ``tvm.compile``. The search's stages are
``stages`` (the list at its top); a new placement's steps ``placing``; what a build found
``report``; where it keeps what it learned ``stores``. Each stage lives in its own package
and knows nothing of the later ones.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time

from ._memory import release_memory
from .byoc import compile_module, compile_placement, forget_lowered, lower_placement
from .check import first_line
from .options import SearchOptions
from .report import BuildReport, CollageResult, SearchResult, UnsupportedOperator, unsupported
from .stages import search
from .stores import DEFAULT_DB, open_db, open_placement_log, placement_key
from .tuning import use_tuning_db

logger = logging.getLogger("collage_tvm")

__all__ = ["optimize", "build", "search", "optimize_module", "CollageResult", "SearchResult",
           "BuildReport", "UnsupportedOperator", "DEFAULT_DB", "open_db", "placement_key"]


def optimize(model, target="llvm", backends=None, db=None, *, options: SearchOptions | None = None,
             placement_log=None, example_inputs=None, input_shapes=None, tuning_db=None,
             **option_fields) -> CollageResult:
    """Search a placement for ``model`` and build it.

    ``model``: ONNX path/ModelProto, torch.nn.Module (with ``example_inputs``) or IRModule.
    ``db``: cost DB path (default ``~/.cache/collage-tvm/costs.db``) or a ``CostDB``.
    ``placement_log``: path or ``PlacementLog`` (default: next to the DB).
    ``input_shapes``: input name -> static shape, for an ONNX model with dynamic inputs.
    ``tuning_db``: the tuning database TVM's kernels use (default: the one next to the cost
    DB, see ``collage_tvm.tune``).
    Search options (``SearchOptions``): ``options=`` and/or its fields by name
    (``backends``, ``graph_level=True``, ``budget=120``, ``compare=True``, ...).
    """
    options = SearchOptions.of(options, backends=backends, **option_fields)
    options = _own_precision(model, options)
    dynamic = _dynamic(model, target, options, db, placement_log, tuning_db, input_shapes,
                       example_inputs)
    if dynamic is not None:
        return dynamic
    found = search(model, target, options, db, placement_log, example_inputs, input_shapes,
                   tuning_db)
    with use_tuning_db(found.tuning):
        executable, lowered = _compile(found)
    _let_go()
    return CollageResult(executable, lowered, found.placement, found.graph, found.report,
                         found.target, found.model_file)


def _own_precision(model, options: SearchOptions) -> SearchOptions:
    """``options`` with the budget a quantized ONNX model is judged by
    (``precision.model_budget``: its own int8 precision, not f32 rounding) where the
    user left the strict default."""
    from .precision import model_budget

    if not options.accuracy.strict:
        return options
    header = None
    if isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".onnx"):
        import onnx

        try:
            header = onnx.load(os.fspath(model), load_external_data=False)
        except Exception:  # noqa: BLE001 - load_model names what is wrong
            return options
    elif type(model).__name__ == "ModelProto":
        header = model
    budget, why = model_budget(options.accuracy, header)
    if not why:
        return options
    logger.warning("%s", why)
    return dataclasses.replace(options, accuracy=budget)


def _dynamic(model, target, options, db, placement_log, tuning_db, input_shapes,
             example_inputs):
    """The build of an ONNX model with dynamic dimensions that ``input_shapes`` leaves
    dynamic (``collage_tvm.dynamic``): it serves every shape of its ranges; None for a
    static model, one the given shapes fix, or one no graph library among the backends runs
    (TVM's build over symbolic shapes then, as before)."""
    from .dynamic import dynamic_model
    from .dynamic.search import optimize_dynamic

    found = dynamic_model(model, options.shapes, input_shapes, options.shape_weights)
    if found is None:
        return None
    proto, path, ranges = found

    def static(shapes):  # Collage's build at the optimum's shapes
        return optimize(model, target, options=options, db=db, placement_log=placement_log,
                        input_shapes=shapes, tuning_db=tuning_db, example_inputs=example_inputs)

    result = optimize_dynamic(proto, path, ranges, target, options, static,
                              open_placement_log(placement_log, open_db(db)),
                              lambda backends: BuildReport(backends=backends))
    if result is not None:
        result = CollageResult(*result)
    if result is None:
        logger.warning("no graph library among the backends runs the model file: TVM builds "
                       "it over symbolic shapes (add onnxruntime or openvino to serve the "
                       "range with their kernels)")
    return result


def _compile(found: SearchResult) -> tuple:
    """(executable, lowered module) of the search's placement; TVM alone if it fails."""
    t0 = time.perf_counter()
    executable = lowered = None
    if found.graph is not None:
        try:
            executable, lowered = compile_placement(found.graph, found.placement.groups,
                                                    found.backends, found.target, keep=True)
        except Exception as err:  # noqa: BLE001 - nothing is lost: TVM alone still builds it
            why = first_line(err)
            logger.warning("the placement failed to compile (%s); building with TVM alone", why)
            found.report.kept_on_tvm.append(f"the whole model: the placement failed to compile: {why}")
            found.report.shipped = "tvm-only"
    if executable is None:
        try:
            executable, lowered = compile_module(found.module, found.target), found.module
        except Exception as err:
            raise unsupported(found.report, err) or err
    found.report.times["compile"] = time.perf_counter() - t0
    return executable, lowered


def optimize_module(mod, target, options: SearchOptions, db=None, placement_log=None):
    """(the partitioned module with external groups lowered, the tuning database whose
    records its TVM kernels use or None), for ``collage_tvm.pipeline``."""
    found = search(mod, target, options, db, placement_log)
    if found.graph is None:
        return found.module, found.tuning
    lowered = lower_placement(found.graph, found.placement.groups, found.backends)
    _let_go()
    return lowered, found.tuning


def _let_go() -> None:
    """Once the shipped build is made: the contenders that lost hold their libraries' copies
    of the weights in the lowering cache, gigabytes for a large model, kept for nothing (the
    shipped build's own callables live on with it)."""
    forget_lowered()
    release_memory()


def build(model, target="llvm", backends=None, db=None, **kwargs):
    """Build ``model`` with Collage: the returned executable runs in ``relax.VirtualMachine``.
    Arguments as ``optimize``."""
    return optimize(model, target, backends, db, **kwargs).executable
