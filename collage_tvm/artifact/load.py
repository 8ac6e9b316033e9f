"""``load``: a saved directory read back and checked against this machine, each region
handed to its library (the alternates raced by the first calls: ``check.race``), and the
Relax VM made over the kernels: a ``LoadedModule`` (``artifact.loaded``) to call."""
from __future__ import annotations

import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from .format import (FORMAT, FORMAT_VERSION, KERNELS, MANIFEST, ArtifactError,
                     host_cpu_features)
from .loaded import LoadedModule

logger = logging.getLogger("collage_tvm")

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
    from .._version import __version__

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
    from ..registry import get_backend, list_backends

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


def _lower_regions(manifest: dict, path: Path, backends: dict, decide: bool) -> dict:
    """symbol -> the callable of each region, made by its library from the saved file."""
    return {entry["symbol"]: _lower_dynamic(manifest, entry, path, backends, decide)
            if entry.get("format") == "dynamic" else _lower_stage(entry, path)
            if entry.get("format") == "stage" else
            _lower_region(entry, path, backends[entry["backend"]])
            for entry in manifest.get("regions", [])}


def _lower_stage(entry: dict, path: Path):
    """A concurrent stage (``schedule.concurrent.run_stage``): each part loaded from its own
    artifact, its libraries made for the share of the cores it was built for."""
    from ..schedule.concurrent import run_stage
    from ..target import thread_share

    loaded, runs = [], []
    for part in entry["parts"]:
        with thread_share(int(part["share"])):
            one = load(path / part["dir"], decide=False)
        loaded.append(one)
        main = one.vm["main"]
        runs.append(_listed(main, bool(one.manifest.get("outputs_tuple"))))
    fn = run_stage(runs, [int(p["share"]) for p in entry["parts"]],
                   [list(p["inputs"]) for p in entry["parts"]],
                   [tuple(g) for g in entry["gather"]])
    fn.loaded = loaded  # the parts' VMs and callables live with the stage
    return fn


def _listed(main, is_tuple: bool):
    """``main`` returning a list of its outputs."""
    if not is_tuple:
        return lambda *args: [main(*args)]
    return lambda *args: list(main(*args))


def _lower_dynamic(manifest: dict, entry: dict, path: Path, backends: dict, decide: bool):
    """A dynamic model's dispatch (``dynamic.Dispatch``): the user's file on each library
    of its table, and the static build at the optimum loaded from ``STATIC``; with
    ``decide``, the libraries that ran a point close to the chosen one race it at the
    shapes it is called with (those that only race made in a thread)."""
    from .._errors import first_line
    from ..check.race import Making
    from ..dynamic.dispatch import STATIC, Dispatch, StaticBuild, library_call
    from ..dynamic.shapes import ShapeRanges, key_point

    file = path / entry["file"]
    outs = [tuple(t) for t in entry["outputs"]]

    def call(backend, shapes=None):
        proto = None
        if not getattr(backend.get_lowering(), "reads_files", False):
            import onnx

            proto = onnx.load(str(file))
        return library_call(backend, proto, str(file), entry["inputs"], outs, shapes)

    fns = {}
    for name in entry["libraries"]:
        try:
            fns[name] = call(backends[name])
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
    close = entry.get("close") if decide else None
    making = {}
    for name in sorted({n for labels in (close or {}).values() for n in labels}
                       - set(fns) - {STATIC}):
        try:
            backend = _alternate_backend(manifest, name)
        except RuntimeError as err:  # the search's choice still serves
            logger.info("%s does not race here: %s", name, err)
            continue
        making[name] = Making(lambda b=backend: call(b))
    ranges = ShapeRanges.from_json(entry["ranges"])
    # each point served by the file compiled for its exact shapes: compiled in a thread
    # (one after another), so that load returns at once; ``Loaded.settle`` waits for it
    exact = {}
    for key, name in (entry.get("exact") or {}).items():
        point = key_point(key)
        exact[key] = (name, Making(lambda b=backends[name], p=point, before=list(exact.values()):
                                   _after(before, lambda: call(b, ranges.shapes(p)))))
    return Dispatch(ranges, entry["table"], fns, special, close,
                    manifest.get("accuracy", "f32"), making, exact)


def _after(before: list, make):
    """``make()`` once each of ``before`` ((library, ``Making``)) is done: the compiles of a
    dynamic model's fixed contenders, one at a time."""
    for _, made in before:
        made.wait()
    return make()


def _alternate_backend(manifest: dict, name: str):
    """The backend ``name`` that only races (``alternate_backends``), where it runs here at
    the version the build was made with; ``RuntimeError`` saying why not."""
    from ..registry import get_backend

    try:
        backend = get_backend(name)
    except KeyError:
        raise RuntimeError(f"no backend {name!r} is registered here") from None
    ok, why = backend.available()
    if not ok:
        raise RuntimeError(why)
    version = (manifest.get("alternate_backends") or {}).get(name, {}).get("version")
    if version is not None and backend.version() != version:
        raise RuntimeError(f"it is {backend.version()} here, {version} when built")
    return backend


def _lower_region(entry: dict, path: Path, backend):
    """The callable of region ``entry``, made by ``backend``'s library from the saved file
    (raises ``ArtifactError`` naming the file when the library refuses it)."""
    import tvm

    from .._errors import first_line

    file = path / entry["file"]
    lowering = backend.get_lowering()
    try:
        if entry["format"] == "onnx":
            if getattr(lowering, "reads_files", False) and "inputs" in entry:
                from ..export.onnx import OnnxFile

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
    from ..check import file_label

    return file_label(alt["backend"], alt.get("source") or "")


def _race_alternates(manifest: dict, path: Path, fns: dict) -> "Race | None":
    """The region that lists alternates (the model's one file, and the other libraries that
    ran it within a few percent in the final check, or the user's file beside an exported
    region, on any library): a ``check.race.Race`` in its symbol's place in ``fns``, the
    shipped callable first, each alternate made by its library in a thread (``Making``), so
    that loading does not wait for it. The first calls decide which serves (labels:
    ``alternate_label``). None where there is nothing to decide. An alternate that cannot
    run here is left out with the reason; nothing fails the load."""
    from .._errors import first_line
    from ..check.race import Making, Race

    entry = next((e for e in manifest.get("regions", []) if e.get("alternates")), None)
    if entry is None or manifest.get("device") == "cuda":  # (the floors run on the CPU)
        return None
    making, left_out = {}, {}
    for alt in entry["alternates"]:
        label = alternate_label(alt)
        try:
            backend = _alternate_backend(manifest, alt["backend"])
            own = {k: alt[k] for k in ("file", "inputs") if k in alt}  # the user's file
            region = {**entry, "backend": alt["backend"], **own}
            making[label] = Making(lambda r=region, b=backend: _lower_region(r, path, b))
        except Exception as err:  # noqa: BLE001 - the shipped one still runs
            left_out[label] = first_line(err, 200)
    race = Race({entry["backend"]: fns[entry["symbol"]]}, manifest.get("accuracy", "f32"),
                making)
    race.left_out.update(left_out)
    fns[entry["symbol"]] = race
    return race


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
    build holds both, and where a dynamic model's libraries ran a shape within a few
    percent, the same: the first calls of the model decide between them in the process
    that runs it (``check.race``; the alternate's library loads it in a thread, so loading
    does not wait; ``LoadedModule.decided`` and ``races`` say how it went, ``settle`` calls
    until decided). ``decide=False`` keeps the search's choices.

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
    fns = _lower_regions(manifest, path, backends, decide)
    race = _race_alternates(manifest, path, fns) if decide else None
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
    return LoadedModule(path, manifest, vm, lib, dev, fns, time.perf_counter() - t0, race)
