"""A build taken away: ``save`` writes a directory, ``load`` runs it in another process.

``collage_tvm.save(result, DIR)`` (``collage-tvm optimize ... --export DIR``) writes::

    DIR/manifest.json      format version, versions (collage-tvm, TVM, each library), the
                           target and the CPU features it needs, inputs and outputs, the
                           placement, the accuracy budget, the measured latencies, and the
                           size of every file below
    DIR/kernels.so         TVM's kernels and the Relax VM's code (``export_library``)
    DIR/regions/rK.onnx    a graph library's region as the file the library loads (weights
                           inside; past protobuf's 2 GiB beside it, rK.onnx.weights)
    DIR/regions/rK.json    any other library's region: its Relax function with its
                           weights (``tvm.ir.save_json``), lowered again by the library
    DIR/placement.json     the placement record ``collage-tvm show`` draws (if any)

``collage_tvm.load(DIR)`` checks the manifest against this machine (format version, TVM
and library versions, CPU features, every file whole) and refuses with one
``ArtifactError`` naming the cause and what to install or rebuild; then each region is
handed to its library (an ONNX Runtime session, an OpenVINO compiled model, a oneDNN
kernel), registered under the symbol the executable calls, and the Relax VM is made over
``kernels.so``. Nothing is searched or compiled by TVM. The one thing timed: a close call
the final check left between two graph libraries running one file whole, or the model
exported as one region and the user's own file (the region's "alternates"), decided in the
loading process (``check.at_load``; ``load(...,
decide=False)`` skips it).

The VM binds the packed functions it calls when it is created, so the regions' callables
are registered only for that moment: a build of the same model in this process, or a
second load, keeps its own.
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

logger = logging.getLogger("collage_tvm")

FORMAT = "collage-tvm-artifact"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
KERNELS = "kernels.so"
REGIONS = "regions"
# The user's model file, where a close call at load may run it (``_save_regions``)
ALTERNATE_FILE = "model_file.onnx"
# A dynamic model's static build at the optimum, an artifact of its own inside this one
STATIC = "static"
PLACEMENT = "placement.json"

# LLVM features whose instructions TVM's kernels may hold: a CPU without one of them cannot
# run kernels compiled with it (SIGILL). The others LLVM lists for a CPU model (movdiri,
# wbnoinvd, ...) are not emitted for tensor code.
_ISA_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "bmi", "lzcnt", "popcnt", "neon",
                 "sve", "fp16", "bf16", "dotprod", "i8mm")
BF16_FEATURES = ("avx512bf16", "amx-bf16")  # precision.cpu_precisions: either one


class ArtifactError(Exception):
    """A saved build that cannot be written or loaded here; the message says why and what
    to install or rebuild."""


# ---------------------------------------------------------------------------- machine

def host_cpu_features() -> set | None:
    """The features of this machine's CPU as LLVM names them (``avx512f``, ``amx-bf16``);
    None when they cannot be read."""
    import tvm

    get = tvm.get_global_func("tvm.codegen.llvm.GetHostCPUFeatures", allow_missing=True)
    if get is None:
        return None
    try:
        return {str(k) for k, v in get().items() if bool(v)}
    except Exception:  # noqa: BLE001 - unknown: not checked
        return None


def _kernel_features(target) -> list:
    """The instruction-set features TVM's kernels for ``target`` may use: those LLVM
    enables for its CPU model that are vector or bit-manipulation extensions; for this
    machine's own CPU model, only those this CPU has (LLVM lists a few for the model that
    a given part lacks, and the kernels ran here)."""
    import tvm

    if target.kind.name != "llvm":
        return []
    try:
        features = {str(f) for f in tvm.target.codegen.llvm_get_cpu_features(target)}
    except Exception:  # noqa: BLE001 - an LLVM without the query: nothing to require
        return []
    mcpu = str(target.attrs.get("mcpu", "") or "")
    if mcpu and mcpu == str(tvm.target.codegen.llvm_get_system_cpu()):
        host = host_cpu_features()
        if host:
            features &= host
    return sorted(f for f in features if f.startswith(_ISA_PREFIXES))


# ---------------------------------------------------------------------------- save

def _jsonable(value):
    """``value`` with NaN/inf as None and tuples, numpy scalars and TVM strings plain."""
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, tuple) else "<->".join(map(str, k)): _jsonable(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return None if not math.isfinite(float(value)) else float(value)
    if value is None or isinstance(value, str):
        return value
    return str(value)


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


def _write_onnx(model, path: Path) -> None:
    """``model`` to ``path``; past protobuf's 2 GiB its weights go beside it (and come back
    into ``model`` afterwards: it may be saved again)."""
    import onnx

    from .export.onnx import serialized

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
    them, and ``load`` decides between them (``check.at_load``). One with "source": "model
    file" ran the user's model file beside an exported region (on another library or the
    region's own): ``model_file`` (its ONNX
    ModelProto) is written as ``ALTERNATE_FILE`` and the alternate names it (left out
    without it). Returns (region entries, backend -> region count)."""
    import tvm

    from .backends._graphlib import output_specs
    from .byoc.external import recipe, registered_symbols
    from .registry import get_backend

    entries, count = [], {}
    for k, symbol in enumerate(registered_symbols(module)):
        made = recipe(symbol)
        if made is None:
            raise ArtifactError(f"the build's call {symbol} cannot be saved: its callable was "
                                "released (save the result collage_tvm.optimize returned)")
        kind, name = made[0], made[1]
        if kind == "dynamic":  # a dynamic model's dispatch (``collage_tvm.dynamic``)
            entry = _save_dynamic(symbol, made, folder)
            entries.append(entry)
            for lib in entry["libraries"]:
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
    from .dynamic.dispatch import output_types

    _, ranges, proto, chosen, static = made
    _write_onnx(proto, folder / ALTERNATE_FILE)
    libraries = sorted(set(chosen["table"].values()))
    entry = {"symbol": symbol, "format": "dynamic", "backend": libraries[0],
             "libraries": libraries, "label": "the model file per shape",
             "file": f"{REGIONS}/{ALTERNATE_FILE}",
             "inputs": [n for n, _, _ in ranges.inputs],
             "outputs": [list(t) for t in output_types(proto)],
             "ranges": ranges.to_json(), "table": chosen["table"],
             "special": chosen["special"] if static is not None else None}
    if static is not None:
        save(static, folder.parent / STATIC, input_names=entry["inputs"],
             output_names=[o.name for o in proto.graph.output])
        entry["static"] = STATIC
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
    from .check.never_slower import MODEL_FILE

    out = []
    for alt in alternates:
        alt = dict(alt)
        if alt.get("source") == MODEL_FILE:
            if model_file is None:
                logger.info("the close call with %s on the user's model file is not saved: "
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
    from .byoc.external import recipe, registered_symbols

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
    if report.whole_model:
        out["whole_model"] = dict(report.whole_model)
    if result.graph is not None:
        out["groups"] = [{"backend": g.backend, "label": g.label, "ops": len(g.nodes)}
                         for g in result.placement.groups]
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
    from .target import make_target

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
    from ._errors import first_line

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
        from .placement import placement_record

        (tmp / PLACEMENT).write_text(json.dumps(_jsonable(placement_record(
            result.placement, result.graph, target, result.report.comparison,
            result.report.shipped, result.report.graph_level)), indent=1))
    return _manifest(result, target, regions, count)


def _manifest(result, target, regions: list, count: dict) -> dict:
    """What built the artifact, what it needs to run, and what it holds."""
    import tvm

    from ._version import __version__
    from .registry import get_backend
    from .target import cpu_model, device_kind

    def info(name: str) -> dict:
        b = get_backend(name)
        return {"version": b.version(), "precision": b.precision, "kind": b.kind,
                "device": b.device}

    backends = {name: {**info(name), "regions": count[name]}
                for name in sorted({n for e in regions
                                    for n in e.get("libraries", [e["backend"]])})}
    # what the close call at load may choose instead (``load``): not needed to load it
    alternate = {name: info(name) for name in sorted({a["backend"] for e in regions
                                                     for a in e.get("alternates", ())})}
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
        "latency_ms": {n: r.get("ms") for n, r in report.comparison.items()},
        "comparison": report.comparison,
        "kernels": KERNELS,
        "regions": regions,
    }


def _cpu_needs(target, backends: dict) -> list:
    """The CPU features the kernels were compiled for and the bf16 regions need."""
    from .target import cpu_model

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


# ---------------------------------------------------------------------------- load

def _read_manifest(path: Path) -> dict:
    file = path / MANIFEST
    if not path.is_dir():
        raise ArtifactError(f"{path}: no such directory (write one with collage_tvm.save or "
                            "collage-tvm optimize MODEL --export DIR)")
    if not file.is_file():
        raise ArtifactError(f"{path} is not a collage-tvm artifact: it has no {MANIFEST} (a "
                            "directory being written is renamed into place only when whole; "
                            "export the model again)")
    try:
        manifest = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ArtifactError(f"{file} is damaged or truncated ({err}): copy the directory again "
                            "or export the model again") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{file} is not a collage-tvm artifact's manifest")
    return manifest


def _check_format(manifest: dict, path: Path) -> None:
    from ._version import __version__

    version = manifest.get("format_version")
    writer = manifest.get("versions", {}).get("collage_tvm", "?")
    if version == FORMAT_VERSION:
        return
    if isinstance(version, int) and version > FORMAT_VERSION:
        raise ArtifactError(f"{path}: artifact format version {version} is newer than this "
                            f"collage-tvm ({__version__}) reads (version {FORMAT_VERSION}): "
                            f"install the collage-tvm that wrote it ({writer}) or newer")
    raise ArtifactError(f"{path}: artifact format version {version!r} is not one this "
                        f"collage-tvm ({__version__}) reads (version {FORMAT_VERSION}): export "
                        f"the model again with this collage-tvm")


def _check_files(manifest: dict, path: Path) -> None:
    files = manifest.get("files")
    if not isinstance(files, dict) or KERNELS not in files:
        raise ArtifactError(f"{path / MANIFEST} lists no files: the manifest is damaged; "
                            "export the model again")
    for rel, size in files.items():
        file = path / rel
        if not file.is_file():
            raise ArtifactError(f"{path} is incomplete: {rel} is missing (copy the whole "
                                "directory again, or export the model again)")
        have = file.stat().st_size
        if have != size:
            raise ArtifactError(f"{path} is damaged: {rel} has {have} bytes, the manifest says "
                                f"{size} (truncated? copy the whole directory again, or export "
                                "the model again)")


def _check_machine(manifest: dict, path: Path, device) -> None:
    import tvm

    built = manifest["versions"].get("tvm")
    if built != tvm.__version__:
        raise ArtifactError(f"{path} was built with TVM {built}; this is TVM {tvm.__version__}: "
                            f"its kernels ({KERNELS}) load only into the TVM that compiled them "
                            f"(install TVM {built}, or export the model again with this one)")
    arch = manifest.get("machine", {}).get("arch")
    if arch and arch != platform.machine():
        raise ArtifactError(f"{path} was built for {arch} CPUs; this machine is "
                            f"{platform.machine()}: export the model again on (or for) it")
    if manifest.get("device") == "cuda":
        dev = tvm.cuda(0)
        if not dev.exist:
            raise ArtifactError(f"{path} runs on a CUDA GPU ({manifest.get('cuda_arch')}); "
                                "none is visible here")
        here = "sm_" + str(dev.compute_version).replace(".", "")
        if manifest.get("cuda_arch") and manifest["cuda_arch"] != here:
            raise ArtifactError(f"{path} was compiled for {manifest['cuda_arch']}; this GPU is "
                                f"{here}: export the model again for it")
    needs = manifest.get("cpu_needs") or []
    if not needs:
        return
    host = host_cpu_features()
    if host is None:
        logger.warning("%s: this CPU's features cannot be read; not checked", path)
        return
    built_on = manifest.get("machine", {}).get("cpu", "another CPU")
    for need in needs:
        what = need.get("for", "the build")
        missing = [f for f in need.get("features", []) if f not in host]
        if missing:
            raise ArtifactError(
                f"{path}: this CPU lacks {', '.join(missing)}, which {what} use (built on "
                f"{built_on}): load it on a CPU that has them, or export the model again on "
                "this machine")
        any_of = need.get("any_of") or []
        if any_of and not any(f in host for f in any_of):
            raise ArtifactError(
                f"{path}: this CPU has none of {' / '.join(any_of)}, which {what} need (built "
                f"on {built_on}): load it on a CPU with bf16 instructions, or export the model "
                "again here with the f32 accuracy budget")


def _check_backends(manifest: dict, path: Path) -> dict:
    """name -> Backend of every library the regions run on, each present, loadable here
    and of the version the artifact was built with."""
    from .registry import get_backend, list_backends

    out = {}
    for name, info in (manifest.get("backends") or {}).items():
        built = info.get("version", "?")
        n = info.get("regions", "?")
        try:
            backend = get_backend(name)
        except KeyError:
            raise ArtifactError(
                f"{path} runs {n} region(s) on the backend {name!r} ({built}), which this "
                f"collage-tvm does not know (known: {', '.join(list_backends())}): load the "
                "pattern file that registers it before loading, or export the model without "
                "it") from None
        ok, why = backend.available()
        if not ok:
            raise ArtifactError(f"{path} runs {n} region(s) on {name}, which cannot run here "
                                f"({why}): install {built}, the library it was built with")
        here = backend.version()
        if here != built:
            raise ArtifactError(f"{path} was built with {built} for its {name} region(s); this "
                                f"machine has {here}: install {built}, or export the model "
                                "again with this one")
        out[name] = backend
    return out


def _lower_regions(manifest: dict, path: Path, backends: dict) -> dict:
    """symbol -> the callable of each region, made by its library from the saved file."""
    return {entry["symbol"]: _lower_dynamic(entry, path, backends)
            if entry.get("format") == "dynamic" else
            _lower_region(entry, path, backends[entry["backend"]])
            for entry in manifest.get("regions", [])}


def _lower_dynamic(entry: dict, path: Path, backends: dict):
    """A dynamic model's dispatch (``dynamic.Dispatch``): the user's file on each library
    of its table, and the static build at the optimum loaded from ``STATIC``."""
    from ._errors import first_line
    from .dynamic.dispatch import Dispatch, StaticBuild, library_call
    from .dynamic.shapes import ShapeRanges

    file = path / entry["file"]
    outs = [tuple(t) for t in entry["outputs"]]
    fns = {}
    for name in entry["libraries"]:
        try:
            proto = None
            if not getattr(backends[name].get_lowering(), "reads_files", False):
                import onnx

                proto = onnx.load(str(file))
            fns[name] = library_call(backends[name], proto, str(file), entry["inputs"], outs)
        except Exception as err:  # noqa: BLE001 - the library's refusal names the cause
            raise ArtifactError(f"{path}: {name} could not load the model file "
                                f"{entry['file']} ({first_line(err, 300)}); export the "
                                "model again") from err
    special = None
    if entry.get("static") and entry.get("special"):
        import tvm

        loaded = load(path / entry["static"], decide=False)
        build = StaticBuild(loaded.vm["main"], tvm.cpu(0))
        build.loaded = loaded  # kept alive with the dispatch
        special = ({s: int(v) for s, v in entry["special"].items()}, build)
    return Dispatch(ShapeRanges.from_json(entry["ranges"]), entry["table"], fns, special)


def _lower_region(entry: dict, path: Path, backend):
    """The callable of region ``entry``, made by ``backend``'s library from the saved file
    (raises ``ArtifactError`` naming the file when the library refuses it)."""
    import tvm

    from ._errors import first_line

    file = path / entry["file"]
    lowering = backend.get_lowering()
    try:
        if entry["format"] == "onnx":
            if getattr(lowering, "reads_files", False) and "inputs" in entry:
                from .export.onnx import OnnxFile

                model = OnnxFile(str(file), tuple(entry["inputs"]))  # the library reads it
            else:
                import onnx

                model = onnx.load(str(file))
            specs = [(tuple(int(d) for d in shape), dtype) for shape, dtype in entry["outputs"]]
            return lowering.compile(model, specs, bool(entry.get("sole", False)))
        if entry["format"] == "relax":
            return lowering.lower(tvm.ir.load_json(file.read_text()))
        raise ArtifactError(f"{path}: region {entry['file']} has the unknown format "
                            f"{entry['format']!r}: export the model again")
    except ArtifactError:
        raise
    except Exception as err:  # noqa: BLE001 - the library's refusal names the cause
        raise ArtifactError(f"{path}: {backend.name} could not load its region {entry['file']} "
                            f"({first_line(err, 300)}); export the model again") from err


def alternate_label(alt: dict) -> str:
    """An alternate's name in the decision at load: its library, and "(model file)" where it
    runs the user's file (the library may be the shipped one's, on the exported region)."""
    from .check.never_slower import file_label

    return file_label(alt["backend"], alt.get("source") or "")


def _decide_close_call(manifest: dict, path: Path, fns: dict, device) -> dict | None:
    """The region that lists alternates (the model's one file, and the other libraries that
    ran it within a few percent in the final check, or the user's file beside an exported
    region, on any library): each one that loads here, timed beside the shipped one in this
    process (``check.at_load.decide``, by ``alternate_label``); the faster's callable takes
    the symbol in ``fns``. Returns the decision's record (None: nothing to decide). An
    alternate that cannot run here is left out with the reason; nothing fails the load."""
    from ._errors import first_line
    from .check.at_load import decide, example_inputs
    from .registry import get_backend

    entry = next((e for e in manifest.get("regions", []) if e.get("alternates")), None)
    if entry is None or manifest.get("device") == "cuda":  # (the floors run on the CPU)
        return None
    built = manifest.get("alternate_backends") or {}
    contenders, left_out = {entry["backend"]: fns[entry["symbol"]]}, {}
    for alt in entry["alternates"]:
        name = alt["backend"]
        label = alternate_label(alt)
        try:
            backend = get_backend(name)
            ok, why = backend.available()
            if not ok:
                raise RuntimeError(why)
            version = built.get(name, {}).get("version")
            if version is not None and backend.version() != version:
                raise RuntimeError(f"it is {backend.version()} here, {version} when built")
            own = {k: alt[k] for k in ("file", "inputs") if k in alt}  # the user's file
            contenders[label] = _lower_region({**entry, "backend": name, **own}, path, backend)
        except Exception as err:  # noqa: BLE001 - the shipped one still runs
            left_out[label] = first_line(err, 200)
    record = {"chose": entry["backend"], "ms": {}, "rounds": 0, "seconds": 0.0}
    if len(contenders) > 1:
        try:
            args = example_inputs(manifest["inputs"], device)
            chose, record = decide(contenders, args, manifest.get("accuracy", "f32"))
        except Exception as err:  # noqa: BLE001 - the final check's verdict stands
            left_out["(timing)"] = first_line(err, 200)
            chose = entry["backend"]
        fns[entry["symbol"]] = contenders[chose]
    record["shipped"] = entry["backend"]
    record["left_out"] = {**left_out, **record.get("left_out", {})}
    if record["chose"] != entry["backend"]:
        logger.info("%s: the model runs whole on %s (%s), not %s as the final check had "
                    "it: a close call, decided here", path, record["chose"],
                    ", ".join(f"{n} {ms:.3f} ms" for n, ms in record["ms"].items()),
                    entry["backend"])
    return record


def _load_library(file: str):
    """``tvm.runtime.load_module(file)`` without the line TVM 0.27's runtime writes to
    stderr for every constant it loads (``executable.cc:340: Warning: Scope Loaded:``);
    anything else it writes is passed on."""
    import tvm

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no stderr to keep clean
        return tvm.runtime.load_module(file)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            return tvm.runtime.load_module(file)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            rest = [line for line in sink.read().decode(errors="replace").splitlines(True)
                    if "Warning: Scope Loaded:" not in line]
            if rest:
                sys.stderr.write("".join(rest))


def _make_vm(lib, dev, fns: dict):
    """The Relax VM over ``lib`` with ``fns`` registered under their symbols while it is
    made (it binds them then); what those symbols named before is put back."""
    import tvm
    import tvm_ffi
    from tvm import relax

    before = {s: tvm.get_global_func(s, allow_missing=True) for s in fns}
    try:
        for symbol, fn in fns.items():
            tvm.register_global_func(symbol, fn, override=True)
        return relax.VirtualMachine(lib, dev)
    finally:
        for symbol, prev in before.items():
            if prev is not None:
                tvm.register_global_func(symbol, prev, override=True)
            else:
                try:
                    tvm_ffi.remove_global_func(symbol)
                except Exception:  # noqa: BLE001 - not there: nothing to remove
                    pass


def load(path, decide: bool = True) -> "LoadedModule":
    """The build saved in directory ``path`` (``save``), ready to run: a ``LoadedModule``.

    ``decide``: where the final check found one file run whole by two graph libraries
    within a few percent of each other (the model file, or the model as one region), the
    build holds both; they are timed side by side
    here, in the process that will run the model, and the faster is kept (about 2-4 s;
    ``LoadedModule.decided`` says how it went). ``decide=False`` keeps the final check's.

    Refuses with an ``ArtifactError`` naming the cause and the fix: not an artifact, an
    unknown format version, a missing or truncated file, another TVM, another machine
    architecture, a CPU without the features its kernels or bf16 regions use, a library
    that is missing, cannot load, or has another version."""
    import tvm

    t0 = time.perf_counter()
    path = Path(path).expanduser()
    manifest = _read_manifest(path)
    _check_format(manifest, path)
    _check_files(manifest, path)
    dev = tvm.cuda(0) if manifest.get("device") == "cuda" else tvm.cpu(0)
    _check_machine(manifest, path, dev)
    backends = _check_backends(manifest, path)
    fns = _lower_regions(manifest, path, backends)
    decided = _decide_close_call(manifest, path, fns, dev) if decide else None
    try:
        lib = _load_library(str(path / manifest.get("kernels", KERNELS)))
    except Exception as err:  # noqa: BLE001 - a damaged library: say which file
        raise ArtifactError(f"{path}: {KERNELS} does not load ({type(err).__name__}: "
                            f"{str(err).strip()[:300]}); export the model again") from err
    try:
        vm = _make_vm(lib, dev, fns)
    except Exception as err:  # noqa: BLE001
        raise ArtifactError(f"{path}: the Relax VM could not be made over {KERNELS} "
                            f"({type(err).__name__}: {str(err).strip()[:300]}); export the "
                            "model again") from err
    return LoadedModule(path, manifest, vm, lib, dev, fns, time.perf_counter() - t0, decided)


class LoadedModule:
    """A saved build, loaded: call it with numpy arrays or DLPack tensors (torch) in the
    model's input order (or by input name); it returns the same kind, one output or a
    tuple. ``vm``: the Relax VM (``vm["main"](*tvm_tensors)``); ``manifest``: what the
    artifact says about itself; ``load_seconds``: how long ``load`` took; ``decided``: the
    close call timed at load (``{"shipped", "chose", "ms", "rounds", "seconds",
    "left_out"}``), None where there was none."""

    def __init__(self, path, manifest, vm, executable, device, callables, load_seconds,
                 decided=None):
        self.path = Path(path)
        self.decided = decided
        self.manifest = manifest
        self.vm = vm
        self.executable = executable  # the runtime module of kernels.so
        self.device = device
        self.load_seconds = load_seconds
        self._callables = callables   # the regions' callables (the VM holds them too)
        self._main = vm["main"]
        self.inputs = manifest["inputs"]
        self.outputs = manifest["outputs"]
        self._direct = _direct_call(manifest, callables)
        # a dynamic model's dispatch: a call's shapes are checked against its ranges
        self.dispatch = next((callables[e["symbol"]] for e in manifest.get("regions", [])
                              if e.get("format") == "dynamic"), None)
        # (dtype, shape) of each input where every dimension is a number: a call with
        # exactly these skips the full check
        self._direct_specs = [(np.dtype(i["dtype"]) if i.get("dtype") else None,
                               tuple(i["shape"]) if all(
            isinstance(d, int) for d in i.get("shape") or [None]) else None)
            for i in self.inputs]

    @property
    def calls_library_directly(self) -> bool:
        """True where a call with numpy arrays goes to the one graph library's own call of
        the whole model (``_direct_call``), False where it goes through the Relax VM (each
        input copied into a TVM tensor and each output back)."""
        return self._direct is not None

    @property
    def input_names(self) -> list:
        return [i["name"] for i in self.inputs]

    @property
    def output_names(self) -> list:
        return [o["name"] for o in self.outputs]

    def __repr__(self) -> str:
        per = dict(self.manifest.get("placement", {}).get("ops_per_backend", {}))
        if self.decided and self.decided["chose"] != self.decided["shipped"]:
            per[self.decided["chose"]] = per.pop(self.decided["shipped"], 0)
        ops = ", ".join(f"{b} {n}" for b, n in sorted(per.items()))
        return (f"LoadedModule({str(self.path)!r}, inputs={self.input_names}, "
                f"outputs={self.output_names}, ops: {ops or 'tvm'})")

    def _arguments(self, args, kwargs) -> list:
        if kwargs:
            unknown = sorted(set(kwargs) - set(self.input_names))
            if unknown:
                raise TypeError(f"unknown input(s) {', '.join(unknown)}; the model's inputs "
                                f"are {', '.join(self.input_names)}")
            args = list(args) + [kwargs[n] for n in self.input_names[len(args):] if n in kwargs]
        if len(args) != len(self.inputs):
            raise TypeError(f"the model takes {len(self.inputs)} input(s) "
                            f"({', '.join(self.input_names)}), got {len(args)}")
        return list(args)

    def to_device(self, value, spec: dict):
        """``value`` (numpy, DLPack tensor or TVM tensor) as a TVM tensor on the device,
        checked against the input's shape and dtype."""
        import tvm

        if isinstance(value, tvm.runtime.Tensor):
            tensor = value
        elif isinstance(value, np.ndarray) or not hasattr(value, "__dlpack__"):
            tensor = tvm.runtime.tensor(np.ascontiguousarray(value), self.device)
        else:
            if hasattr(value, "detach"):  # torch
                value = value.detach().contiguous()
            try:
                tensor = tvm.runtime.from_dlpack(value)
            except Exception:  # noqa: BLE001 - e.g. not aligned as TVM needs: copy it
                tensor = tvm.runtime.tensor(np.from_dlpack(value).copy(), self.device)
        _check_input(spec, str(tensor.dtype), tuple(int(d) for d in tensor.shape))
        return tensor

    def run_tvm(self, tensors: list):
        """The VM's ``main`` on TVM tensors (no checks): TVM tensors out, as a list."""
        import tvm

        out = self._main(*tensors)
        return [out] if isinstance(out, tvm.runtime.Tensor) else list(out)

    def __call__(self, *args, **kwargs):
        args = self._arguments(args, kwargs)
        if self._direct is not None and all(type(a) is np.ndarray for a in args):
            outs = self._call_direct(args)
        else:
            outs = self._call_vm(args)
        if len(outs) == 1 and not self.manifest.get("outputs_tuple"):
            return outs[0]
        return tuple(outs)

    def _call_vm(self, args: list) -> list:
        """The outputs of the VM's ``main`` on ``args``, each as the kind of the first."""
        tensors = [self.to_device(a, s) for a, s in zip(args, self.inputs)]
        if self.dispatch is not None:  # outside its ranges: the error names them
            self.dispatch.ranges.point_of([tuple(int(d) for d in t.shape) for t in tensors])
        return [_like(o, args[0] if args else None) for o in self.run_tvm(tensors)]

    def _call_direct(self, arrays: list) -> list:
        """numpy in, numpy out, where the build is one file run whole by one graph library
        and the VM's ``main`` only calls it (``_direct_call``): the arrays go to the
        library's call as they are (the Relax VM would first copy each into a TVM tensor)
        and the library's fresh numpy outputs come back as they are."""
        feed = []
        ranged = self.dispatch is not None  # (its dispatch checks the shapes: ``point_of``)
        for a, (dtype, shape), spec in zip(arrays, self._direct_specs, self.inputs):
            # (dtypes compared as objects: ``dtype.name`` takes microseconds a call)
            if a.dtype != dtype or (a.shape != shape and not (ranged and shape is None)):
                _check_input(spec, a.dtype.name, a.shape)  # raises, naming the input
            flags = a.flags
            feed.append(a if flags.c_contiguous and flags.writeable else np.array(a))
        return self._direct(*feed)


def _direct_call(manifest: dict, callables: dict):
    """Where the build is one file run whole by a graph library on the CPU, and the VM's
    ``main`` does nothing but call it with the model's inputs in order (the user's model
    file: ``byoc.whole``; TVM's import exported as one region: "passes_through", checked at
    save by ``_passes_through``; either one with the user's file put in its place by the
    close call at load), the library's own call of it on numpy arrays, returning fresh
    numpy outputs (the region callable's ``numpy_call``), which ``LoadedModule`` calls
    itself. None otherwise (artifacts saved before "model_file" was written included)."""
    regions = manifest.get("regions") or []
    if manifest.get("device") == "cuda" or len(regions) != 1 or not (
            regions[0].get("model_file") or regions[0].get("passes_through")
            or regions[0].get("format") == "dynamic"):
        return None
    return getattr(callables.get(regions[0]["symbol"]), "numpy_call", None)


def _check_input(spec: dict, dtype: str, got: tuple) -> None:
    """``ValueError`` naming the input unless ``dtype`` and shape ``got`` are the ones
    ``spec`` (a manifest input) gives (a dimension that is not a number takes any size)."""
    shape, want = spec.get("shape"), spec.get("dtype")
    if (want and dtype != want) or (shape is not None and (
            len(got) != len(shape)
            or any(isinstance(d, int) and d != g for d, g in zip(shape, got)))):
        raise ValueError(f"input {spec['name']}: expected {want}{list(shape or [])}, got "
                         f"{dtype}{list(got)}")


def _like(tensor, example):
    """TVM tensor ``tensor`` as the kind of ``example``: numpy (a copy), a torch tensor or
    another DLPack framework's (zero-copy), or the TVM tensor itself."""
    import tvm

    if example is None or isinstance(example, np.ndarray) or not hasattr(example, "__dlpack__"):
        return tensor.numpy()
    if isinstance(example, tvm.runtime.Tensor):
        return tensor
    root = type(example).__module__.split(".", 1)[0]
    from_dlpack = getattr(sys.modules.get(root), "from_dlpack", None)
    if from_dlpack is None:
        return tensor.numpy()
    return from_dlpack(tensor)


__all__ = ["ArtifactError", "LoadedModule", "load", "save"]
