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
import math
import os
import time

from ._memory import release_memory
from .byoc import compile_module, compile_placement, forget_lowered, lower_placement
from .schedule.concurrent import compile_staged, staged_groups
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
    if options.accuracy.quantizes:
        return _int8(model, target, options, db, placement_log, tuning_db, input_shapes)
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


def _int8(model, target, options, db, placement_log, tuning_db, input_shapes) -> CollageResult:
    """``optimize`` under ``--accuracy int8`` (``collage_tvm.quantize``): the model quantized
    within the budget, searched as an int8 model, beside the f32 model searched under the
    same tolerance (bf16 regions allowed); each judged against the f32 model on the
    validation inputs, the faster one that is within the budget shipped, the figures in
    ``report.precision["int8"]``."""
    from . import quantize as q
    from .check.fastest import decide
    from .precision import parse_accuracy, quantized_ops

    budget = options.accuracy
    proto = _onnx_proto(model)
    if proto is None:
        raise q.QuantizeError("--accuracy int8 quantizes an ONNX file (a path or a "
                              "ModelProto): export the model to ONNX first")
    if quantized_ops(proto):
        raise q.QuantizeError("the model is quantized already: build it without --accuracy "
                              "int8 (it is judged by its own precision)")
    shapes = dict(input_shapes or {})
    found = _ranges(proto, options, input_shapes)
    if found is not None:  # calibrated and judged at the optimum of the ranges
        shapes.update(found[2].opt_shapes())
    specs = q.input_specs(proto, shapes)
    feeds, source = q.calibration_feeds(specs, options.calibration_inputs)
    validation = feeds[:q.CALIBRATION_SAMPLES] + q.random_feeds(specs, q.VALIDATION_SEEDS)
    t0 = time.perf_counter()

    def progress(excluded, err):
        if options.progress:
            print(f"  int8 with {excluded} operator(s) in float: error {err:.2e} of the "
                  f"output scale (aimed at {budget.tolerance * q.CONTROL_SHARE:.2g} of the "
                  f"{budget.tolerance:g} budget)", flush=True)

    found = {}
    for method, (ok, why) in q.quantizers().items():
        label = INT8_LABELS[method]
        if not ok:
            logger.warning("%s is not quantized with %s: %s", label, method, why)
            continue
        if options.progress:
            print(f"  quantizing with {QUANTIZER_NAMES[method]}:", flush=True)
        t1 = time.perf_counter()
        found[label] = q.controlled(proto, feeds, validation,
                                    budget.tolerance * q.CONTROL_SHARE, progress, method,
                                    hint=None if budget.allows("bf16") else "f32")
        found[label]["quantize_s"] = round(time.perf_counter() - t1, 1)
        found[label]["quantizer"] = QUANTIZER_NAMES[method]
    quantize_s = time.perf_counter() - t0
    common = dict(target=target, db=db, placement_log=placement_log, tuning_db=tuning_db,
                  input_shapes=input_shapes)
    floating = optimize(model, options=dataclasses.replace(
        options, accuracy=parse_accuracy(budget.tolerance)), **common)
    info = {"budget": budget.tolerance, "calibration": source, "quantize_s": round(quantize_s, 1),
            "quantized": {label: {"quantizer": f["quantizer"], "in_float": f["excluded"],
                                  "returned": f.get("returned", []),
                                  "unpaid": f.get("unpaid", []), "timed_on": f.get("timed_on"),
                                  "quantizable": f["quantizable"], "error_file": f["error"],
                                  "compute_only": f.get("compute_only", False),
                                  "tries": f["tries"], "quantize_s": f["quantize_s"]}
                          for label, f in found.items()}}
    contenders = {"float": floating}
    for label, quantized in list(found.items()):
        # The control aims the file at ``CONTROL_SHARE`` of the budget (a library rounds
        # inside each int8 layer its own way); the file with every operator int8, where its
        # error is within the whole budget, competes too, its build judged like the others
        # (timm's regnety_002: NNCF's whole file 4.0e-2 on the validation inputs, 53 of 64
        # operators left in float to reach 3e-2, and OpenVINO ran the whole file 1.3x
        # faster than Collage's build)
        whole_err = quantized.get("whole_error", math.inf)
        if quantized["excluded"] and quantized.get("whole_model") is not None \
                and whole_err <= budget.tolerance:
            found[f"{label}-whole"] = {**quantized, "model": quantized["whole_model"],
                                       "excluded": [], "error": whole_err,
                                       "compute_only": False}
            info["quantized"][f"{label}-whole"] = {
                **info["quantized"][label], "in_float": [], "returned": [], "unpaid": [],
                "error_file": whole_err, "compute_only": False}
    for label, quantized in found.items():
        if quantized["model"] is not None and \
                len(quantized["excluded"]) < quantized["quantizable"]:
            # (its float parts in bf16 where the budget allows, as the float build's: a
            # region left in float by the control, or one the quantizer does not touch,
            # runs as fast as it does there, and the int8 regions add their gain to that)
            contenders[label] = optimize(quantized["model"], options=dataclasses.replace(
                options, accuracy=int8_contender_budget(budget)), **common)
        else:
            info["quantized"][label]["why_not"] = (
                "no operator stays int8 within the budget"
                if quantized["model"] is None or quantized["quantizable"] else
                "the model has no operator to quantize")
    chose = _judge_int8(contenders, proto, validation, budget, info, decide)
    # (the fields of one quantized file at the top, as before: the shipped one's, else
    # ONNX Runtime's)
    top = info["quantized"].get(chose) or info["quantized"].get("int8") or next(
        iter(info["quantized"].values()), {})
    info.update(in_float=top.get("in_float", []), unpaid=top.get("unpaid", []),
                quantizable=top.get("quantizable", 0),
                tries=top.get("tries", []), error_quantized_file=top.get("error_file"),
                compute_only=top.get("compute_only", False))
    whys = [f"{label}: {q_['why_not']}" for label, q_ in info["quantized"].items()
            if q_.get("why_not")]
    if whys and chose == "float":
        info["why_no_int8"] = "; ".join(whys)
    result = contenders[chose]
    result.report.precision = {**result.report.precision, "int8": info}
    logger.warning("--accuracy int8: shipped the %s build (%s)", chose, ", ".join(
        f"{n} {ms:.3f} ms" for n, ms in info.get("ms", {}).items()) or "nothing timed")
    return result


# The int8 contender of each quantizer (``quantize.quantizers``), and its name in the output
INT8_LABELS = {"ort": "int8", "nncf": "int8-nncf"}
QUANTIZER_NAMES = {"ort": "ONNX Runtime's quantize_static", "nncf": "NNCF"}


def int8_contender_budget(budget):
    """The budget the model Collage quantized under ``budget`` (``--accuracy int8``) is
    searched by: its own int8 precision (``precision.INT8_MODEL``), its float parts in bf16
    where ``budget`` allows bf16 (the whole build is then judged against the f32 model
    within ``budget``, ``_judge_int8``)."""
    from .precision import int8_model_budget

    out = int8_model_budget(reduced=budget.allows("bf16"))
    return dataclasses.replace(out, why=(
        "the model Collage quantized: judged within its int8 precision"
        + (", its float parts may run in bf16" if out.reduced else "")))


def _ranges(model, options, input_shapes):
    """``dynamic.dynamic_model``'s (proto, path, ranges) of ``model``, the ranges moved to
    the observed shapes the options give (``weights.weighted_ranges``); None for a model
    with no dynamic dimension left."""
    from .dynamic import dynamic_model
    from .dynamic.weights import weighted_ranges

    found = dynamic_model(model, options.shapes, input_shapes)
    if found is None or options.shape_weights is None:
        return found
    proto, path, ranges = found
    return proto, path, weighted_ranges(ranges, options.shape_weights)


def _onnx_proto(model):
    """The ModelProto of an ONNX path or ModelProto (weights included); None otherwise."""
    if isinstance(model, (str, os.PathLike)) and os.fspath(model).endswith(".onnx"):
        import onnx

        return onnx.load(os.fspath(model))
    return model if type(model).__name__ == "ModelProto" else None


def _judge_int8(contenders: dict, proto, validation: list, budget, info: dict, decide) -> str:
    """Which of ``contenders`` ("float", "int8": results) ships: each one's error against the
    f32 model (ONNX Runtime) on ``validation`` (``info["error"]``); those within ``budget``
    timed side by side (``check.fastest.decide``, the float build first); the faster."""
    import tvm
    from tvm import relax

    from . import quantize as q
    from .precision import parse_accuracy

    reference = q.outputs_on(proto, validation)
    names = [n for n, _, _ in q.input_specs(proto)]
    runs, errors = {}, {}
    for label, res in contenders.items():
        main = relax.VirtualMachine(res.executable, tvm.cpu())["main"]
        got = []
        for feed in validation:
            out = main(*[tvm.runtime.tensor(feed[n]) for n in names])
            got.append([o.numpy() for o in (out if isinstance(out, (list, tuple)) or not
                                             isinstance(out, tvm.runtime.Tensor) else [out])])
        errors[label] = q.error(got, reference)
        if errors[label] <= budget.tolerance or label == "float":
            runs[label] = main
        else:
            why = (f"the {label} build's error ({errors[label]:.2e} of the output scale) is "
                   f"outside the {budget.tolerance:g} budget")
            info.setdefault("quantized", {}).setdefault(label, {})["why_not"] = why
    info["error"] = {k: float(f"{v:.3g}") for k, v in errors.items()}
    args = [tvm.runtime.tensor(validation[0][n]) for n in names]
    # (each judged against the f32 model above; the timing compares, not judges)
    chose, record = decide(runs, args, parse_accuracy(0.99))
    info["ms"] = record.get("ms", {})
    info["chose"] = chose
    return chose


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
    from .dynamic.search import optimize_dynamic

    found = _ranges(model, options, input_shapes)
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
            executable, lowered = compile_staged(found.graph, found.placement.groups,
                                                 found.placement.stages, found.backends,
                                                 found.target, keep=True)
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
    groups, backends = found.placement.groups, found.backends
    if found.placement.stages:
        groups, backends = staged_groups(found.graph, groups, found.placement.stages, backends,
                                         found.target, keep=True)
    lowered = lower_placement(found.graph, groups, backends)
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
