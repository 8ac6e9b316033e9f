"""Import a model to Relax and put it in the shape the search expects."""
from __future__ import annotations

import os

import tvm
from tvm import relax


class ModelError(ValueError):
    """The model could not be imported; the message says what was wrong."""


def load_model(model, example_inputs=None, shape_dict: dict | None = None) -> tvm.IRModule:
    """Import ``model`` to a Relax IRModule whose ``main`` has its weights bound as constants.

    ``model``: an ONNX file path or ``onnx.ModelProto``; a ``torch.nn.Module`` (needs
    ``example_inputs``, a tuple of tensors); or a ``tvm.IRModule``.
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
        mod = _from_onnx(proto, shape_dict, path)
    elif type(model).__name__ == "ModelProto":
        mod = _from_onnx(model, shape_dict, "<ModelProto>")
    elif _is_torch_module(model):
        mod = _from_torch(model, example_inputs)
    else:
        raise ModelError(f"cannot import a {type(model).__name__}: give an ONNX file or "
                         "ModelProto, a torch.nn.Module with example_inputs, or a tvm.IRModule")
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        raise ModelError("the Relax module has no 'main' function")
    return mod


def _from_onnx(proto, shape_dict, where: str) -> tvm.IRModule:
    from tvm.relax.frontend.onnx import from_onnx

    try:
        return from_onnx(proto, shape_dict=shape_dict, keep_params_in_input=False)
    except Exception as err:
        raise ModelError(f"{where}: ONNX import failed: {type(err).__name__}: {err}") from err


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
    with torch.no_grad():
        exported = torch.export.export(model, tuple(example_inputs))
    mod = from_exported_program(exported, keep_params_as_input=False)
    return mod


def normalize_for_collage(mod: tvm.IRModule) -> tvm.IRModule:
    """One dataflow block of single-op bindings, constants folded, inference-only ops."""
    out = _normalize(mod, fold=True)
    if _undefined_globals(out):
        # FoldConstant can leave a call_tir to a PrimFunc it made and then dropped (a
        # dynamic_strided_slice's shape function, seen on ONNX Slice): keep the constants.
        out = _normalize(mod, fold=False)
    return out


def _normalize(mod: tvm.IRModule, fold: bool) -> tvm.IRModule:
    seq = tvm.transform.Sequential([
        relax.transform.DecomposeOpsForInference(),
        relax.transform.ConvertToDataflow(min_size=1),
        relax.transform.CanonicalizeBindings(),
        *([relax.transform.FoldConstant()] if fold else []),
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
