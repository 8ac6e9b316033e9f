"""Import a model to Relax and put it in the shape the search expects."""
from __future__ import annotations

import logging
import os

import tvm
from tvm import relax

from .fold_shapes import fold_shapes
from .raise_tir import raise_call_tir
from .quantized import fold_dequantized_weights
from .static_slices import static_slices

logger = logging.getLogger("collage_tvm")


class ModelError(ValueError):
    """The model could not be imported; the message says what was wrong. ``proto``: the
    ONNX model (shapes folded) when TVM's ONNX importer refused it, else None."""

    proto = None


def load_model(model, example_inputs=None, input_shapes: dict | None = None) -> tvm.IRModule:
    """Import ``model`` to a Relax IRModule whose ``main`` has its weights bound as constants.

    ``model``: an ONNX file path or ``onnx.ModelProto``; a ``torch.nn.Module`` (needs
    ``example_inputs``, a tuple of tensors); or a ``tvm.IRModule``.
    ``input_shapes``: input name -> static shape, for an ONNX model whose inputs have
    dynamic dimensions (batch, sequence): Collage measures kernels of known shapes
    (``dynamic_input`` says what is still dynamic).
    """
    if isinstance(model, tvm.IRModule):
        mod = model
    elif isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise ModelError(f"{path}: model file not found")
        if not path.endswith(".onnx"):
            raise ModelError(f"{path}: only .onnx files are read from disk")
        import onnx

        try:
            proto = onnx.load(path)
        except Exception as err:
            raise ModelError(f"{path}: not a readable ONNX model ({err})") from err
        mod = _from_onnx(proto, input_shapes, path)
    elif type(model).__name__ == "ModelProto":
        mod = _from_onnx(model, input_shapes, "<ModelProto>")
    elif _is_torch_module(model):
        mod = _from_torch(model, example_inputs)
    else:
        raise ModelError(f"cannot import a {type(model).__name__}: give an ONNX file or "
                         "ModelProto, a torch.nn.Module with example_inputs, or a tvm.IRModule")
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise ModelError("the Relax module has no 'main' function")
    return mod


def parse_input_shapes(specs) -> dict:
    """``["input=1x3x224x224", ...]`` (the CLI's ``--input-shape``) -> {name: (1, 3, 224, 224)}."""
    out = {}
    for spec in specs or []:
        name, _, dims = spec.rpartition("=")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            shape = ()
        if not name or not shape or min(shape) < 0:
            raise ModelError(f"--input-shape {spec!r}: expected NAME=D1xD2x..., "
                             "e.g. input=1x3x224x224")
        out[name] = shape
    return out


def read_example_inputs(path: str, model_path: str) -> list:
    """The arrays of ``--inputs FILE`` for the ONNX model at ``model_path``, in its input
    order (``read_inputs``)."""
    import onnx

    try:
        proto = onnx.load(model_path, load_external_data=False)
    except Exception as err:
        raise ModelError(f"{model_path}: not a readable ONNX model ({err})") from err
    weights = {t.name for t in proto.graph.initializer}
    return read_inputs(path, [i.name for i in proto.graph.input if i.name not in weights])


def read_inputs(path: str, names: list) -> list:
    """The arrays of ``--inputs FILE`` in the order of the input ``names``: an ``.npz`` keyed
    by input name (or ``arr_0``, ``arr_1``, ... as ``numpy.savez`` names positional arrays),
    or one ``.npy`` for a one-input model; a ``ModelError`` naming what does not fit."""
    import numpy as np

    try:
        data = np.load(path)
    except Exception as err:
        raise ModelError(f"--inputs {path}: not a readable .npz or .npy file ({err})") from err
    if isinstance(data, np.ndarray):
        arrays = {names[0]: data} if len(names) == 1 else {}
        if not arrays:
            raise ModelError(f"--inputs {path}: one array for a model with {len(names)} "
                             f"inputs ({', '.join(names)}): give an .npz keyed by input name")
    else:
        arrays = dict(data.items())
        if set(arrays) == {f"arr_{k}" for k in range(len(arrays))}:
            arrays = {n: arrays[f"arr_{k}"] for k, n in enumerate(names) if f"arr_{k}" in arrays}
    missing = [n for n in names if n not in arrays]
    extra = sorted(set(arrays) - set(names))
    if missing or extra:
        raise ModelError(f"--inputs {path}: the model's inputs are {', '.join(names)}; "
                         + (f"missing {', '.join(missing)}" if missing else "")
                         + ("; " if missing and extra else "")
                         + (f"not inputs: {', '.join(extra)}" if extra else ""))
    return [arrays[n] for n in names]


def dynamic_input(main) -> str | None:
    """Why ``main`` cannot be placed as it is: the first input with a dynamic dimension,
    named with the flag that fixes it; None when every input is static."""
    for p in main.params:
        ty = p.ty
        if not isinstance(ty, relax.TensorType):
            continue
        values = getattr(ty.shape, "values", None) if ty.shape is not None else None
        if values is None:
            return (f"input {p.name!r} has an unknown rank: give its shape with "
                    f"--input-shape {p.name}=D1xD2x... (input_shapes=...)")
        for axis, d in enumerate(values):
            if not isinstance(d, (int, tvm.tirx.IntImm)):
                example = "x".join(str(int(v)) if isinstance(v, (int, tvm.tirx.IntImm)) else "1"
                                   for v in values)
                return (f"input {p.name!r} has a dynamic dimension {axis} ({d}): Collage "
                        f"measures kernels of static shapes; give it with --input-shape "
                        f"{p.name}={example} (input_shapes={{{p.name!r}: "
                        f"({example.replace('x', ', ')})}} in Python)")
    return None


def _from_onnx(proto, input_shapes, where: str) -> tvm.IRModule:
    from tvm.relax.frontend.onnx import from_onnx

    names = [i.name for i in proto.graph.input]
    unknown = sorted(set(input_shapes or {}) - set(names))
    if unknown:
        raise ModelError(f"{where}: --input-shape names no input of the model: "
                         f"{', '.join(unknown)}; its inputs: {', '.join(names)}")
    proto, _ = fold_shapes(proto, input_shapes)
    try:
        return from_onnx(proto, shape_dict=input_shapes, keep_params_in_input=False)
    except Exception as err:
        error = ModelError(f"{where}: ONNX import failed{_failing_node(err)}: "
                           f"{type(err).__name__}: {err}")
        error.proto = proto
        raise error from err


def _failing_node(err: BaseException) -> str:
    """" at node NAME (OP)": the ONNX node TVM's importer was converting when ``err`` was
    raised (its node loop's frame in the traceback), or "" when none is found. The
    importer's own messages often omit which operator they are about ("KeyError: 'x'",
    "Only constant axes currently supported")."""
    node, tb = None, err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "_construct_nodes":
            node = tb.tb_frame.f_locals.get("node", node)  # the innermost (a subgraph's) wins
        tb = tb.tb_next
    if node is None or not hasattr(node, "op_type"):
        return ""
    return f" at node {node.name!r} ({node.op_type})" if node.name else f" at a {node.op_type} node"


def _is_torch_module(model) -> bool:
    try:
        import torch
    except ImportError:
        return False
    return isinstance(model, torch.nn.Module)


def _from_torch(model, example_inputs) -> tvm.IRModule:
    import torch
    from tvm.relax.frontend.torch import from_exported_program

    if example_inputs is None:
        raise ModelError("a torch.nn.Module needs example_inputs (a tuple of tensors)")
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    model = model.eval()
    try:
        with torch.no_grad():
            exported = torch.export.export(model, tuple(example_inputs))
    except Exception as err:
        raise ModelError(f"torch.export failed: {type(err).__name__}: "
                         f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}") from err
    try:
        return from_exported_program(exported, keep_params_as_input=False)
    except Exception as err:
        raise ModelError(f"TVM's PyTorch importer failed: {type(err).__name__}: "
                         f"{str(err).strip().splitlines()[0] if str(err).strip() else ''} "
                         "(exporting to ONNX first may work: the ONNX importer covers more)") from err


def normalize_for_collage(mod: tvm.IRModule, raise_tir: bool = True) -> tvm.IRModule:
    """One dataflow block of single-op bindings, constants folded, common subexpressions
    computed once, inference-only ops; slices with bounds computed from constants made
    static (``static_slices``); the importer's ``call_tir``s of ordinary operators raised to
    Relax ops (``raise_call_tir``; ``raise_tir=False`` leaves them, to measure what that
    buys: collage_tvm/tools/call_tir_survey.py)."""
    mod = fold_dequantized_weights(static_slices(mod))
    try:
        out = _normalize(mod, fold=True)
    except Exception as err:  # noqa: BLE001 - TVM cannot fold an op it cannot compile
        # (integer Pow: "power only applies to float"); a library may still run it.
        logger.warning("constant folding failed (%s); the model is searched unfolded",
                       str(err).strip().splitlines()[-1][:200] if str(err).strip() else err)
        out = _normalize(mod, fold=False)
    else:
        if _undefined_globals(out):
            # FoldConstant can leave a call_tir to a PrimFunc it made and then dropped (a
            # dynamic_strided_slice's shape function, seen on ONNX Slice): keep the constants.
            out = _normalize(mod, fold=False)
    # after folding: Clip's bounds are constants only once the importer's NaN guards fold
    return raise_call_tir(out) if raise_tir else out


def _normalize(mod: tvm.IRModule, fold: bool) -> tvm.IRModule:
    seq = tvm.transform.Sequential([
        relax.transform.DecomposeOpsForInference(),
        relax.transform.ConvertToDataflow(min_size=1),
        relax.transform.CanonicalizeBindings(),
        *([relax.transform.FoldConstant()] if fold else []),
        # one binding per distinct computation: torch.export reshapes a linear's input once
        # per linear, and the Q, K and V projections of one input would not be siblings
        relax.transform.EliminateCommonSubexpr(),
        relax.transform.DeadCodeElimination(["main"]),
        relax.transform.Normalize(),
    ])
    mod = seq(mod)
    if len(mod["main"].body.blocks) > 1:
        mod = relax.transform.ConvertToDataflow(min_size=1)(mod)
    return mod


def _undefined_globals(mod: tvm.IRModule) -> list:
    """Names of the GlobalVars ``main`` refers to that ``mod`` does not define."""
    defined = {gv.name_hint for gv in mod.get_global_vars()}
    missing = []

    def visit(e):
        if isinstance(e, relax.GlobalVar) and e.name_hint not in defined:
            missing.append(e.name_hint)

    relax.analysis.post_order_visit(mod["main"].body, visit)
    return missing
