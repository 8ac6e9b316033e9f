"""The model run whole by one library: the user's model file on a graph library (a
*floor* of the final check: what the user would run without Collage), a model TVM cannot
import run whole on the fastest library that can, and the *alternates* of a shipped
whole-file build raced again where the saved build is served.

Entry points: ``floors_for`` (the final check's floors of a search), ``floor_module``
(a floor that won, as the module to ship), ``whole_on_a_library`` (a model TVM cannot
import), ``alternates`` (the close whole-file runs of a verdict) and
``model_file_for_alternates`` (the user's file saved for the race). The lowering of one
file to one external function is ``byoc.whole``; the user's file itself
``frontend.model_file``; the race where the build is served ``check.race``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import tvm
from tvm import relax

from ..frontend import ModelError
from ..precision import parse_accuracy
from ..registry import get_backend, list_backends
from .evaluate import first_line

logger = logging.getLogger("collage_tvm")

# The ``source`` of a contender that runs the user's own model file whole on a library.
MODEL_FILE = "model file"


@dataclass
class Floor:
    """The user's model file run whole by one graph library: what they would run without
    Collage (``check.never_slower``). ``build() -> executable``. ``budget``: the
    accuracy budget (``precision.Accuracy``) it is judged by when the search's own does not
    allow its precision (timed for the report only, never shipped: the report says what
    the flag would give)."""

    backend: str
    build: Callable
    budget: object = None
    # what ``build`` runs (``frontend.ModelFile``) and the input shapes the user gave: a
    # floor judged on an RPC server is built there from them (``check.remote``)
    user_file: object = None
    input_shapes: dict | None = None


def file_label(library: str, source: str = MODEL_FILE) -> str:
    """A contender's name: its library, and its source where it is not the shipped file
    ("onnxruntime (model file)"): the floors of the final check, the decision at load."""
    return f"{library} ({source})" if source else library


def floor(name: str, user_file, backend, input_shapes, main, target, budget=None) -> Floor:
    """The ``Floor`` running ``user_file`` (``frontend.ModelFile``) whole on ``backend``
    (``registry.Backend``), its inputs and outputs those of ``main`` (TVM's import)."""
    from ..byoc import compile_module, release_with
    from ..byoc.whole import whole_model_module

    def build():
        mod = whole_model_module(user_file.load(), backend, input_shapes, like=main,
                                 path=user_file.path)
        executable = compile_module(mod, target)
        release_with(executable, mod)  # its session goes with the executable
        return executable

    return Floor(name, build, None if budget is None else parse_accuracy(budget), user_file,
                 input_shapes)


def floors_for(user_file, backends: dict, target, accuracy, input_shapes, main,
               report) -> dict:
    """name -> ``Floor``: the user's model file run whole by each graph library among
    ``backends`` (its f32 build), and on a CPU with bf16 instructions under the strict f32
    budget, by each library's reduced-precision variant too: timed for the report only, it
    says what ``--accuracy bf16`` would give. ``report.no_floor`` says why there is none."""
    if not user_file:
        report.no_floor = user_file.why
        return {}
    libs = {n: b for n, b in backends.items()
            if b.kind == "graph" and hasattr(b.get_lowering(), "compile")}
    floors = {file_label(n): floor(n, user_file, b, input_shapes, main, target)
              for n, b in libs.items()}
    if parse_accuracy(accuracy).strict:
        for name in list_backends():
            variant = get_backend(name)
            if (variant.variant_of in libs and variant.precision != "f32"
                    and variant.device == libs[variant.variant_of].device
                    and variant.available()[0]):
                floors[file_label(name)] = floor(name, user_file, variant, input_shapes,
                                                 main, target, budget=variant.precision)
    if not floors:
        report.no_floor = "no graph library among the backends runs a model file"
    return floors


def floor_module(lib: str, user_file, input_shapes, graph) -> tvm.IRModule | None:
    """The module running the user's model file whole on ``lib``: the final check's verdict,
    to ship (or reuse from the placement log); None, with a warning, when it cannot be made
    now (no model file, the library gone)."""
    from ..byoc.whole import NotWhole, whole_model_module

    if not user_file:
        logger.warning("the placement log ships the model file whole on %s, but there is no "
                       "model file now (%s): searching again", lib, user_file.why)
        return None
    try:
        backend = get_backend(lib)
        ok, why = backend.available()
        if not ok:
            raise NotWhole(why)
        return whole_model_module(user_file.load(), backend, input_shapes, like=graph.func,
                                  path=user_file.path)
    except Exception as err:  # noqa: BLE001 - searched again, nothing lost
        logger.warning("the model file whole on %s cannot be built now (%s): searching "
                       "again", lib, first_line(err))
        return None


def whole_on_a_library(err, backends: dict, input_shapes, report, target,
                       accuracy) -> tvm.IRModule:
    """The module running the ONNX model TVM's importer refused (``err``) wholly on the
    graph library among ``backends`` that runs it fastest here: each one that loads it,
    timed side by side on random inputs, its outputs checked against the first's within
    ``accuracy`` (``check.fastest.decide``); ``err`` again, with each library's reason
    added, when none loads it. ``report.whole_model`` says which and why."""
    from ..byoc.whole import NotWhole, whole_model_module

    reasons, mods = [], {}
    for name, backend in backends.items():
        if backend.kind != "graph" or not accuracy.allows(backend.precision):
            continue
        try:
            mods[name] = whole_model_module(err.proto, backend, input_shapes)
        except NotWhole as why:
            reasons.append(f"{name}: {why}")
    if not mods:
        if reasons:
            raise ModelError(f"{err}; no graph library runs it whole either "
                             f"({'; '.join(reasons)})") from err
        raise ModelError(f"{err}; a graph library could run the whole model: add onnxruntime "
                         "or openvino to the backends") from err
    name, timed = _fastest_whole(mods, target, accuracy)
    report.whole_model = {"backend": name, "why": first_line(err),
                          **({"timed": timed} if timed else {})}
    logger.warning("TVM cannot import the model (%s); it runs wholly on %s%s",
                   first_line(err), name, f" ({_ms_text(timed)})" if timed else "")
    return mods[name]


def _fastest_whole(mods: dict, target, accuracy) -> tuple:
    """(name, {name: ms}) of the fastest of ``mods`` (modules running one file whole on a
    library each), timed side by side here (nothing timed for one: {})."""
    from ..byoc import compile_module
    from ..byoc.external import release_with
    from ..graph.subgraph import random_inputs
    from .fastest import decide

    if len(mods) == 1:
        return next(iter(mods)), {}
    first = next(iter(mods.values()))
    dev = tvm.cpu() if target.kind.name == "llvm" else tvm.cuda()
    args = [tvm.runtime.tensor(a, dev) for a in random_inputs(first["main"])]
    mains, executables = {}, {}
    for name, mod in mods.items():
        try:
            executables[name] = compile_module(mod, target)
            mains[name] = relax.VirtualMachine(executables[name], dev)["main"]
        except Exception as why:  # noqa: BLE001 - the others still run it
            logger.warning("the model whole on %s does not build: %s", name, first_line(why))
    chose, record = (decide(mains, args, accuracy) if len(mains) > 1
                     else (next(iter(mains or mods)), {}))
    for name, executable in executables.items():
        if name != chose:  # the losers' sessions go with their executables
            release_with(executable, mods[name])
    return chose, record.get("ms", {})


def _ms_text(timed: dict) -> str:
    return ", ".join(f"{n} {ms:.3f} ms" for n, ms in sorted(timed.items(), key=lambda kv: kv[1]))


def same_file_runs(builds: dict, graph_of: dict, floors: dict, backends: dict) -> dict:
    """build name -> (the file it runs whole, its graph library) of the final check's
    builds that run one file whole on a graph library: a floor the user's model file
    ("model file"), a build whose one group covers the whole graph the model exported as
    one region (the graph)."""
    out = {}
    for name, groups in builds.items():
        if name in floors:
            out[name] = (MODEL_FILE, floors[name].backend)
        elif groups is not None and len(groups) == 1 \
                and len(groups[0].nodes) == len(graph_of[name]) \
                and getattr(backends.get(groups[0].backend), "kind", "") == "graph":
            out[name] = (id(graph_of[name]), groups[0].backend)
    return out


def alternates(best: str, ok: dict, runs: dict, share: float) -> list:
    """The at-load alternates of ``best``: [(backend, ms, source)] of the builds that run
    ``best``'s file whole (``runs``: ``same_file_runs``) on another graph library, correct
    and within ``share`` (``FinalCheck.at_load_share``) of it (``ok``: name -> ms of the
    correct results within the budget), fastest first, one per library and file; empty
    where ``best`` runs no one file whole. ``source`` is "" for ``best``'s own file; where
    ``best`` runs the model exported as one region, the user's model file run whole counts
    too (source "model file"), on another library or on ``best``'s own: the same model,
    another file (the transformers suite's vit on the AMX Xeon: TVM's import whole on ONNX
    Runtime shipped at 0.810 ms, the user's file on the same library took 0.796 in the
    row). A build shipping the user's file gets no exported region as an alternate (the
    saved build would have to export one)."""
    if best not in runs:
        return []
    file, lib = runs[best]
    bar = (1 + share) * ok[best]
    out: dict = {}
    for name in sorted((n for n in ok if n in runs), key=lambda n: ok[n]):
        other_file, other = runs[name]
        source = "" if other_file == file else other_file
        if source not in ("", MODEL_FILE) or ok[name] > bar:
            continue
        if (other, source) != (lib, "") and (other, source) not in out:
            out[(other, source)] = ok[name]
    return [(b, ms, source) for (b, source), ms in out.items()]


def model_file_for_alternates(report, user_file, input_shapes):
    """The user's model file as the final check ran it (at the input shapes given), where an
    alternate of ``report`` runs it: the saved build holds it for the decision at load.
    None otherwise, or (the alternate dropped, with a warning) when it cannot be read."""
    if not any(a.get("source") == MODEL_FILE for a in report.alternates):
        return None
    from ..byoc.whole import with_input_shapes

    try:
        return with_input_shapes(user_file.load(), input_shapes)
    except Exception as err:  # noqa: BLE001 - the alternate goes, the build stands
        logger.warning("the user's model file could not be read again (%s): its alternate "
                       "is not saved for the decision at load", first_line(err))
        report.alternates = [a for a in report.alternates if a.get("source") != MODEL_FILE]
        return None
