"""``save``: a build written to a directory (``collage_tvm.artifact`` describes its files),
beside the destination and renamed into place whole. Each region is written as its library
loads it, TVM's kernels as a shared library, and the manifest last."""
from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from ..check.contender import records
from .format import (ALTERNATE_FILE, BF16_FEATURES, FORMAT, FORMAT_VERSION, KERNELS, MANIFEST,
                     PLACEMENT, REGIONS, STATIC, ArtifactError, _jsonable, _kernel_features)

logger = logging.getLogger("collage_tvm")

# ---------------------------------------------------------------------------- save

def _tensor_specs(types, names) -> list:
    """[{"name", "shape", "dtype"}] of Relax tensor types (a symbolic dimension: its name)."""
    import tvm
    from tvm import relax

    out = []
    for k, ty in enumerate(types):
        name = names[k] if names and k < len(names) else f"output_{k}"
        if not isinstance(ty, relax.TensorType):
            out.append({"name": name, "type": str(ty)})
            continue
        shape = None
        if ty.shape is not None and hasattr(ty.shape, "values"):
            shape = [int(d.value) if isinstance(d, tvm.tirx.IntImm) else str(d)
                     for d in ty.shape.values]
        out.append({"name": name, "shape": shape, "dtype": str(ty.dtype)})
    return out


def _signature(main, input_names=None, output_names=None) -> tuple:
    """(inputs, outputs, outputs form a tuple) of the executable's ``main``."""
    from tvm import relax

    params = [p.ty for p in main.params]
    in_names = list(input_names) if input_names and len(input_names) == len(params) else [
        p.name for p in main.params]
    ret = main.ret_ty
    is_tuple = isinstance(ret, relax.TupleType)
    outs = list(ret.fields) if is_tuple else [ret]
    out_names = list(output_names) if output_names and len(output_names) == len(outs) else None
    return _tensor_specs(params, in_names), _tensor_specs(outs, out_names), is_tuple


def _graph_library_exports(lowering) -> bool:
    """Whether ``lowering`` lowers a function by exporting it to ONNX and compiling that
    (``GraphLibraryLowering.lower`` as it is): then its region is saved as the ONNX file and
    loaded by ``compile``, the step the library itself takes."""
    try:
        from collage_tvm.backends._graphlib import GraphLibraryLowering
    except ImportError:  # pragma: no cover - the built-in lowerings are part of the package
        return False
    return (isinstance(lowering, GraphLibraryLowering)
            and getattr(type(lowering), "lower", None) is GraphLibraryLowering.lower)


def _save_native(lowering, path: Path) -> None:
    """The library's own form of the ONNX file at ``path`` beside it, where the library
    keeps one (``save_native``: OpenVINO's IR, read faster at load); nothing where it
    cannot (the ONNX file still serves)."""
    save_native = getattr(lowering, "save_native", None)
    if save_native is None:
        return
    try:
        save_native(path)
    except Exception as err:  # noqa: BLE001 - the ONNX file still loads
        logger.info("%s: no native form of %s (%s)", lowering.name, path.name, err)


def _write_onnx(model, path: Path) -> None:
    """``model`` to ``path``; past protobuf's 2 GiB its weights go beside it (and come back
    into ``model`` afterwards: it may be saved again)."""
    import onnx

    from ..export.onnx import serialized

    data = serialized(model)
    if data is not None:
        path.write_bytes(data)
        return
    onnx.save_model(model, str(path), save_as_external_data=True,
                    all_tensors_to_one_file=True, location=f"{path.name}.weights")
    onnx.load_external_data_for_model(model, str(path.parent))


def _save_regions(module, folder: Path, alternates=(), model_file=None) -> tuple:
    """Each external callable the executable calls, written to ``folder`` as its library
    loads it. ``alternates``: the graph libraries (``{"backend", "ms"}`` each) that ran
    the shipped build's one file whole (the user's model file, or the model exported as
    one region) within a few percent of it in the final check; that file's entry lists
    them, and the loaded build's first calls race them (``check.race``). One with "source": "model
    file" ran the user's model file beside an exported region (on another library or the
    region's own): ``model_file`` (its ONNX
    ModelProto) is written as ``ALTERNATE_FILE`` and the alternate names it (left out
    without it). Returns (region entries, backend -> region count)."""
    import tvm

    from ..backends._graphlib import output_specs
    from ..byoc.external import live, recipe, registered_symbols
    from ..registry import get_backend
    from ..schedule.concurrent import is_stage

    entries, count = [], {}
    for k, symbol in enumerate(registered_symbols(module)):
        made = recipe(symbol)
        if made is None:
            raise ArtifactError(f"the build's call {symbol} cannot be saved: its callable was "
                                "released (save the result collage_tvm.optimize returned)")
        kind, name = made[0], made[1]
        if kind == "relax" and is_stage(name):  # a concurrent stage: its parts, each a build of its own
            entry = _save_stage(symbol, live(symbol), folder, k)
            entries.append(entry)
            for lib in entry["libraries"]:
                count[lib] = count.get(lib, 0) + entry["counts"][lib]
            continue
        if kind == "dynamic":  # a dynamic model's dispatch (``collage_tvm.dynamic``)
            entry = _save_dynamic(symbol, made, folder)
            entries.append(entry)
            for lib in set(entry["libraries"]) | set((entry.get("exact") or {}).values()):
                count[lib] = count.get(lib, 0) + 1
            continue
        backend = get_backend(name)
        lowering = backend.get_lowering()
        entry = {"symbol": symbol, "backend": name, "label": "the model file, whole"}
        if kind == "relax" and made[2].attrs is not None:
            entry["label"] = str(made[2].attrs.get("collage.label", ""))
        if kind == "onnx":  # a model file run whole by a library
            _, _, proto, specs = made
            entry.update(format="onnx", file=f"{REGIONS}/r{k}.onnx", sole=True, model_file=True,
                         outputs=[[list(s), d] for s, d in specs],
                         inputs=[i.name for i in proto.graph.input])
            _write_onnx(proto, folder / f"r{k}.onnx")
            _save_native(lowering, folder / f"r{k}.onnx")
        elif _graph_library_exports(lowering):
            func = made[2]
            specs = output_specs(func)
            sole = bool(func.attrs is not None and func.attrs.get("collage.sole_group", False))
            model = lowering.export(func)
            entry.update(format="onnx", file=f"{REGIONS}/r{k}.onnx", sole=sole,
                         outputs=[[list(s), d] for s, d in specs],
                         inputs=[i.name for i in model.graph.input])
            if sole and _passes_through(module["main"], symbol, len(specs)):
                entry["passes_through"] = True  # ``_direct_call``
            _write_onnx(model, folder / f"r{k}.onnx")
            _save_native(lowering, folder / f"r{k}.onnx")
        else:
            func = made[2]
            (folder / f"r{k}.json").write_text(tvm.ir.save_json(func))
            entry.update(format="relax", file=f"{REGIONS}/r{k}.json")
        if entry.get("sole") and alternates:  # one file, the whole model: others may run it
            entry["alternates"] = _alternates(alternates, folder, model_file)
            if not entry["alternates"]:
                del entry["alternates"]
        entries.append(entry)
        count[name] = count.get(name, 0) + 1
    return entries, count


def _save_dynamic(symbol: str, made: tuple, folder: Path) -> dict:
    """The region entry of a dynamic model's dispatch: the user's file (written as
    ``ALTERNATE_FILE``), the ranges, the library chosen at each point, and the static build
    that serves the optimum (saved as an artifact of its own in ``STATIC``), if any."""
    from ..dynamic.dispatch import close_labels, output_types

    from ..registry import get_backend

    _, ranges, proto, chosen, static = made
    _write_onnx(proto, folder / ALTERNATE_FILE)
    libraries = sorted(set(chosen["table"].values()))
    exact = dict(chosen.get("exact") or {})
    for name in sorted(set(libraries) | set(exact.values())):
        _save_native(get_backend(name).get_lowering(), folder / ALTERNATE_FILE)
    entry = {"symbol": symbol, "format": "dynamic", "backend": libraries[0],
             "libraries": libraries, "label": "the model file per shape",
             "file": f"{REGIONS}/{ALTERNATE_FILE}",
             "inputs": [n for n, _, _ in ranges.inputs],
             "outputs": [list(t) for t in output_types(proto)],
             "ranges": ranges.to_json(), "table": chosen["table"],
             "close": close_labels(chosen["points"]),
             "special": chosen["special"] if static is not None else None,
             # point key -> the library that serves its exact shapes with the file compiled
             # for them (made in a thread at load; the table's choice serves meanwhile)
             **({"exact": exact} if exact else {})}
    if static is not None:
        save(static, folder.parent / STATIC, input_names=entry["inputs"],
             output_names=[o.name for o in proto.graph.output])
        entry["static"] = STATIC
    return entry


def _save_stage(symbol: str, fn, folder: Path, k: int) -> dict:
    """The region entry of a concurrent stage (``schedule.concurrent``): each of its parts
    saved as an artifact of its own (``STAGE_DIR``/s<k>/p<j>), with the thread share it was
    built for, which of the stage's inputs it reads and where each of the stage's outputs
    comes from."""
    from types import SimpleNamespace

    parts = getattr(fn, "parts", None)
    if not parts or any(p.executable is None for p in parts):
        raise ArtifactError(f"the build's concurrent stage {symbol} cannot be saved: its parts "
                            "were not kept (save the result collage_tvm.optimize returned)")
    entry = {"symbol": symbol, "format": "stage", "backend": "stage",
             "label": "a concurrent stage", "parts": [], "gather": [list(g) for g in fn.gather]}
    counts: dict = {}
    for j, (part, pick) in enumerate(zip(parts, fn.picks)):
        rel = f"{REGIONS}/s{k}/p{j}"
        report = SimpleNamespace(alternates=[], comparison={}, shipped="collage",
                                 graph_level={}, precision={}, ops_per_backend={},
                                 estimated_ms=float("nan"), placement_from_log=False,
                                 whole_model={}, shipped_floor="")
        result = SimpleNamespace(executable=part.executable, module=part.lowered, graph=None,
                                 placement=None, target=None, report=report)
        save(result, folder / f"s{k}" / f"p{j}")
        manifest = json.loads((folder / f"s{k}" / f"p{j}" / MANIFEST).read_text())
        for name, info in manifest["backends"].items():
            counts[name] = counts.get(name, 0) + info["regions"]
        entry["parts"].append({"dir": rel, "share": part.share, "inputs": list(pick)})
    entry["libraries"], entry["counts"] = sorted(counts), counts
    return entry


def _passes_through(main, symbol: str, n_outputs: int) -> bool:
    """Whether Relax function ``main`` does nothing but call the packed function ``symbol``
    (``call_pure_packed``, as ``byoc.external.lower_external`` writes it) on its parameters,
    all of them in order, and return what that returns: the call itself, or its
    ``n_outputs`` fields in order. Then the region's own call on the model's inputs is the
    model (``_direct_call``)."""
    import tvm
    from tvm import relax

    body = main.body
    if not isinstance(body, relax.SeqExpr):
        return False
    params = list(main.params)
    made = {}  # var -> "call", or the field of the call it is
    for block in body.blocks:
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                return False
            value = binding.value
            if isinstance(value, relax.Call) and not made:
                args = list(value.args)
                if not (isinstance(value.op, tvm.ir.Op)
                        and value.op.name == "relax.call_pure_packed" and args
                        and isinstance(args[0], relax.ExternFunc)
                        and str(args[0].global_symbol) == symbol
                        and len(args) == len(params) + 1
                        and all(a.same_as(p) for a, p in zip(args[1:], params))):
                    return False
                made[binding.var] = "call"
            elif isinstance(value, relax.TupleGetItem) and made.get(value.tuple_value) == "call":
                made[binding.var] = int(value.index)
            elif isinstance(value, relax.Var) and value in made:
                made[binding.var] = made[value]  # an alias (a dataflow block's output)
            elif isinstance(value, relax.Tuple) and _all_fields(value, made, n_outputs):
                made[binding.var] = "call"  # the call's fields, all in order
            else:
                return False
    out = body.body
    if isinstance(out, relax.Tuple):
        return _all_fields(out, made, n_outputs)
    return isinstance(out, relax.Var) and made.get(out) == "call"


def _all_fields(value, made: dict, n_outputs: int) -> bool:
    """Whether Relax tuple ``value`` is fields 0..n-1 of the call, in order
    (``_passes_through``)."""
    from tvm import relax

    return (len(value.fields) == n_outputs > 1
            and all(isinstance(f, relax.Var) and made.get(f) == j
                    for j, f in enumerate(value.fields)))


def _alternates(alternates, folder: Path, model_file) -> list:
    """The region entry's alternates (``_save_regions``): one that runs the user's model
    file names the file written for it and its inputs."""
    from ..check import MODEL_FILE

    out = []
    for alt in alternates:
        alt = dict(alt)
        if alt.get("source") == MODEL_FILE:
            if model_file is None:
                logger.info("the alternate %s on the user's model file is not saved: "
                            "the result does not hold the file", alt["backend"])
                continue
            if not (folder / ALTERNATE_FILE).exists():
                _write_onnx(model_file, folder / ALTERNATE_FILE)
            alt.update(file=f"{REGIONS}/{ALTERNATE_FILE}",
                       inputs=[i.name for i in model_file.graph.input])
        out.append(alt)
    return out


def _whole_model_names(module) -> tuple:
    """(input names, output names) of the ONNX model a whole-model build runs, else (None,
    None)."""
    from ..byoc.external import recipe, registered_symbols

    for symbol in registered_symbols(module):
        made = recipe(symbol)
        if made is not None and made[0] in ("onnx", "dynamic"):
            graph = made[2].graph
            weights = {t.name for t in graph.initializer}
            return ([i.name for i in graph.input if i.name not in weights],
                    [o.name for o in graph.output])
    return None, None


def _placement_summary(result) -> dict:
    report = result.report
    out = {"shipped": report.shipped, "ops_per_backend": dict(report.ops_per_backend),
           "estimated_ms": report.estimated_ms, "from_log": report.placement_from_log}
    if report.whole_model:  # TVM cannot import it: the model runs whole on a library
        out["whole_model"] = dict(report.whole_model)
    elif report.shipped_floor:  # the user's file run whole by a library won the check
        out["whole_model"] = {"backend": report.shipped_floor, "floor": True,
                              "why": "the model file run whole by it was the fastest "
                                     "correct build"}
    if result.graph is not None:
        out["groups"] = [{"backend": g.backend, "label": g.label, "ops": len(g.nodes)}
                         for g in result.placement.groups]
        if result.placement.stages:  # run concurrently (``collage_tvm.schedule``)
            out["concurrent_stages"] = [[len(chain) for chain in stage]
                                        for stage in result.placement.stages]
    return out


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    _fsync_dir(root)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - a platform without directory descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def save(result, path, *, input_names=None, output_names=None) -> Path:
    """Write ``result`` (``collage_tvm.optimize``'s ``CollageResult``) to the directory
    ``path``, for ``load`` to run in another process without searching.

    ``input_names`` / ``output_names``: the model's names for its inputs and outputs (the
    CLI passes the ONNX file's); default: the Relax parameters' names and ``output_K``.
    The directory is written beside ``path`` and renamed into place: a crash leaves the old
    one or none, never half of one. An existing ``path`` is replaced only if it is an
    artifact (or empty). Returns ``path``.
    """
    from ..target import make_target

    path = Path(path).expanduser()
    if path.exists() and not (path.is_dir() and ((path / MANIFEST).is_file()
                                                 or not any(path.iterdir()))):
        raise ArtifactError(f"{path} exists and is not a collage-tvm artifact: not replaced "
                            "(choose another directory or remove it)")
    if result.executable is None:
        raise ArtifactError("the result has no executable to save")
    target = result.target if result.target is not None else make_target("llvm")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        manifest = _write_contents(result, tmp, target)
        whole_in, whole_out = _whole_model_names(result.module)
        manifest.update(zip(("inputs", "outputs", "outputs_tuple"), _signature(
            result.module["main"], input_names or whole_in, output_names or whole_out)))
        manifest["files"] = {p.relative_to(tmp).as_posix(): p.stat().st_size
                             for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps(_jsonable(manifest), indent=1) + "\n")
        _fsync_tree(tmp)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)  # mkdtemp made it private; an artifact is a plain folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _move_into_place(tmp, path)
    return path


def _write_contents(result, tmp: Path, target) -> dict:
    """The regions' files, TVM's kernels and the placement, written into ``tmp``; returns
    the manifest describing them (its input/output signature and file list still to add)."""
    from .._errors import first_line

    (tmp / REGIONS).mkdir()
    regions, count = _save_regions(result.module, tmp / REGIONS, result.report.alternates,
                                   getattr(result, "model_file", None))
    try:
        result.executable.export_library(str(tmp / KERNELS))
    except Exception as err:
        raise ArtifactError(f"TVM could not write its kernels as a shared library "
                            f"({first_line(err, 300)}): export_library needs a C "
                            "compiler (gcc or clang) on this machine") from err
    if result.graph is not None:
        from ..placement import placement_record

        (tmp / PLACEMENT).write_text(json.dumps(_jsonable(placement_record(
            result.placement, result.graph, target, records(result.report.comparison),
            result.report.shipped, result.report.graph_level)), indent=1))
    return _manifest(result, target, regions, count)


def _manifest(result, target, regions: list, count: dict) -> dict:
    """What built the artifact, what it needs to run, and what it holds."""
    import tvm

    from .._version import __version__
    from ..registry import get_backend
    from ..target import cpu_model, device_kind

    def info(name: str) -> dict:
        b = get_backend(name)
        return {"version": b.version(), "precision": b.precision, "kind": b.kind,
                "device": b.device}

    backends = {name: {**info(name), "regions": count[name]}
                for name in sorted({n for e in regions
                                    for n in [*e.get("libraries", [e["backend"]]),
                                              *(e.get("exact") or {}).values()]})}
    # what the calls may choose instead (``load``: ``check.race``): not needed to load it
    alternate = {name: info(name) for name in sorted(
        {a["backend"] for e in regions for a in e.get("alternates", ())}
        | {n for e in regions for close in (e.get("close") or {}).values() for n in close
           if n not in e.get("libraries", ()) and n != "collage"})}
    report = result.report
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": {"collage_tvm": __version__, "tvm": tvm.__version__,
                     "python": platform.python_version()},
        "target": str(target), "device": device_kind(target),
        "machine": {"arch": platform.machine(), "cpu": cpu_model(), "system": sys.platform},
        "cuda_arch": str(target.attrs.get("arch", "")) if target.kind.name == "cuda" else "",
        "cpu_needs": _cpu_needs(target, backends),
        "backends": backends,
        "alternate_backends": alternate,
        "accuracy": report.precision.get("accuracy", "f32") if report.precision else "f32",
        "placement": _placement_summary(result),
        "latency_ms": {n: r.ms for n, r in report.comparison.items()},
        "comparison": records(report.comparison),
        "kernels": KERNELS,
        "regions": regions,
    }


def _cpu_needs(target, backends: dict) -> list:
    """The CPU features the kernels were compiled for and the bf16 regions need."""
    from ..target import cpu_model

    needs = []
    kernel_features = _kernel_features(target)
    if kernel_features:
        mcpu = target.attrs.get("mcpu", "") or "a generic CPU"
        needs.append({"features": kernel_features,
                      "for": f"TVM's kernels (compiled for {mcpu} on {cpu_model()})"})
    bf16 = sorted(n for n, b in backends.items() if b["precision"] == "bf16"
                  and b["device"] == "cpu")
    if bf16:
        needs.append({"any_of": list(BF16_FEATURES),
                      "for": f"the bf16 regions on {', '.join(bf16)}"})
    return needs


def _move_into_place(tmp: Path, path: Path) -> None:
    """Rename the finished ``tmp`` to ``path``; an artifact already there is moved aside
    first and put back if the rename fails."""
    old = None
    try:
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.rename(path, old / "a")
        os.rename(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not path.exists() and (old / "a").exists():
            os.rename(old / "a", path)  # the old artifact back where it was
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
