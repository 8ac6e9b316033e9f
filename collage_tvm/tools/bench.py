"""``collage-tvm bench``: Collage beside the builds a user would otherwise ship, in one run.

For each model of the zoo (``collage_tvm.tools.zoo``): export it to ONNX, run the Collage
search (op-level, and two-level with ``--graph-level``) with the never-slower comparison, time
the shipped build interleaved with the frameworks (PyTorch eager, torch.compile, ONNX
Runtime, OpenVINO), and check our glue: the model placed wholly on ONNX Runtime (and on
OpenVINO) through collage-tvm against the plain library on the same ONNX file, timed
interleaved in one process. With ``ablation``, also Collage with the backends added one
at a time (paper Fig. 11). Writes ``results.json``, ``results.md`` and ``results.png`` (paper Fig. 7;
``results_ablation.png`` for the ablation) into the output folder; the plots need matplotlib
(``pip install 'collage-tvm[plot]'``) and are skipped, with a message, without it.
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import time

from collage_tvm.check.contender import records
from collage_tvm.measure.cuda_graph import note
from collage_tvm.options import SearchOptions
from collage_tvm.tools import MissingPlotExtra, need_matplotlib
from collage_tvm.tools import zoo

logger = logging.getLogger("collage_tvm")


GLUE_LIBRARIES = ("onnxruntime", "openvino")  # graph libraries the glue check can run plainly


def glue_overhead(onnx_path: str, library: str = "onnxruntime", target="llvm") -> dict:
    """The model wholly on a graph library (``onnxruntime`` or ``openvino``) through
    collage-tvm (our ONNX export of the Relax graph, called from the Relax VM) against the
    library run directly on ``onnx_path`` as its own documentation says, timed interleaved."""
    import tvm
    from tvm import relax

    from collage_tvm.check import compare_outputs, graph_lib_groups, run_outputs
    from collage_tvm.frontend import load_model, normalize_for_collage
    from collage_tvm.graph import DataflowGraph
    from collage_tvm.graph.subgraph import random_inputs
    from collage_tvm.byoc import compile_placement
    from collage_tvm.measure.timing import interleaved
    from collage_tvm.registry import get_backend
    from collage_tvm.target import make_target, target_device

    if library not in GLUE_LIBRARIES:
        raise ValueError(f"glue check: no plain runner for {library!r} "
                         f"(one of {', '.join(GLUE_LIBRARIES)})")
    target = make_target(target)
    backend = get_backend(library)
    ok, why = backend.available()
    if not ok:
        return {"error": f"{library} unavailable: {why}"}
    graph = DataflowGraph.from_module(normalize_for_collage(load_model(onnx_path)))
    groups = graph_lib_groups(graph, backend)
    if any(g.backend != library for g in groups):
        return {"error": f"{library} cannot run every operator of the model: "
                         + ", ".join(sorted({graph.nodes[i].op_name for g in groups
                                             if g.backend != library for i in g.nodes}))}
    ex, _ = compile_placement(graph, groups, {"tvm": get_backend("tvm"), library: backend},
                              target)
    dev = target_device(target)
    vm = relax.VirtualMachine(ex, dev)
    arrays = random_inputs(graph.func)
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    plain, plain_outputs = _plain_runner(library, backend, onnx_path, arrays)
    match, max_err = compare_outputs(run_outputs(vm, args), plain_outputs)
    ms = interleaved({"plain": plain, "collage": lambda: vm["main"](*args)})
    return {"library": library, "plain_ms": ms["plain"], "collage_ms": ms["collage"],
            "overhead": ms["collage"] / ms["plain"] - 1.0, "max_err": max_err, "match": match}


def _plain_runner(library: str, backend, onnx_path: str, arrays: list) -> tuple:
    """(a call of the library on the original ONNX file, its outputs): the framework
    baseline of ``frameworks`` and the plain side of the glue check. ONNX Runtime with all
    graph optimizations, in a session made as the onnxruntime backend makes them; OpenVINO
    compiled with the openvino backend's config (latency hint, f32, one thread per core)
    and called the documented low-overhead way (no copy of the inputs or the outputs)."""
    lowering = backend.get_lowering()
    if library == "onnxruntime":
        sess = lowering.session(onnx_path)
        feeds = {i.name: a for i, a in zip(sess.get_inputs(), arrays)}
        return (lambda: sess.run(None, feeds)), sess.run(None, feeds)
    compiled = lowering.compile_source(onnx_path)
    req = compiled.create_infer_request()
    outputs = [req.infer(arrays)[o] for o in compiled.outputs]
    return (lambda: req.infer(arrays, share_inputs=True, share_outputs=True)), outputs


def machine() -> dict:
    from collage_tvm.precision import bf16_flags
    from collage_tvm.target import cpu_model, host_cores

    import onnxruntime
    import torch
    import tvm
    import tvm.target.codegen

    # LLVM's name for the CPU (znver3, sapphirerapids): a virtual machine's model name can
    # be as plain as "AMD EPYC" on CPUs of different generations
    info = {"cpu": cpu_model(), "mcpu": tvm.target.codegen.llvm_get_system_cpu(),
            "cores": host_cores(), "python": platform.python_version(),
            "tvm": tvm.__version__, "onnxruntime": onnxruntime.__version__,
            "torch": torch.__version__}
    # its bf16 instructions: AMX makes OpenVINO's default precision several times its f32,
    # AVX512-BF16 alone less, and LLVM's name may not tell (a VM's Xeon read as rocketlake)
    flags = bf16_flags()
    if flags:
        info["bf16"] = ", ".join(flags)
    try:
        import openvino

        info["openvino"] = openvino.__version__.split("-")[0]
    except ImportError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def model_onnx(name: str, size: str, out_dir: str) -> str:
    """Export ``name`` (a zoo model at ``size``, or a fixed-size name such as
    ``resnet_small``) to ONNX in ``out_dir``."""
    if name in zoo.ZOO:
        return zoo.export_onnx(name, size, os.path.join(out_dir, f"{name}_{size}.onnx"))
    if name in zoo.FIXED:
        return zoo.export_onnx(name, os.path.join(out_dir, f"{name}.onnx"))
    raise ValueError(f"unknown model {name!r}; known: {', '.join(known_models())}")


def model_and_input(name: str, size: str):
    """(torch module, example input tensor): the same model and input the ONNX file holds."""
    return zoo.get(name, size)


def frameworks(name: str, size: str, onnx_path: str, collage_executable, accuracy=None,
               collage_f32=None) -> dict:
    """The frameworks a user would pick instead of zoo model ``name`` at ``size``, timed
    interleaved with the shipped Collage build (``torch_frameworks``, every row judged by
    the ``accuracy`` budget: ``precision.Accuracy``, strict f32 by default).

    Besides PyTorch eager, ONNX Runtime and OpenVINO (f32 and default), torch.compile
    (inductor, ``inference_mode``, the default mode: ``max-autotune-no-cudagraphs``
    measured no faster on dcgan small, each mode compiled in a fresh process on 2 cores:
    0.47-0.51 ms against 0.48-0.52 ms, both compiling in 12-16 s; compiled by two warm-up
    calls before the timing, its kernels cached in inductor's default folder under the
    system temp dir) and PyTorch under ``torch.autocast("cpu", torch.bfloat16)``
    ("pytorch (bf16 autocast)", PyTorch's reduced-precision default, issue #17).
    ``collage_f32``: the Collage build of the strict budget, timed beside the others as
    "collage (f32)" when ``collage_executable`` was built under another budget.
    """
    from collage_tvm.precision import parse_accuracy

    accuracy = parse_accuracy(accuracy)
    model, x = model_and_input(name, size)
    return torch_frameworks(model, (x,), onnx_path, collage_executable,
                            lambda out, ref, precision: accuracy.check(out, ref),
                            collage_f32=collage_f32, torch_compile=True, autocast=True,
                            label=name)


# Rounds of ``torch_frameworks``' interleaved timing: each figure is the median of this many
# batches (seven left two runs of one row far apart on a noisy machine).
FRAMEWORK_ROUNDS = 15
# The row's runoff (``_framework_times``): Collage's figure and those within
# ``ROW_RUNOFF_MARGIN`` of it, or of the fastest f32 framework where that one is ahead, are
# timed on, side by side, until each is the median of ``ROW_RUNOFF_ROUNDS`` batches.
# Fifteen batches of a few-ms model still swing by 5-10% on a shared VM (two sessions of one
# ONNX file, timed so, landed 0.94-1.13x apart), and the row's verdict takes the fastest of
# several such figures, which favours whichever drew the lucky stretch; the close ones are
# the ones whose ratio the noise can turn.
ROW_RUNOFF_MARGIN = 0.10
ROW_RUNOFF_ROUNDS = 45
# Each function's batch in those rounds: calls for at least this many ms (``interleaved``).
FRAMEWORK_BATCH_MS = 200.0


def torch_frameworks(model, inputs, onnx_path: str, collage_executable, check, *,
                     collage_f32=None, torch_compile: bool = False,
                     autocast: bool = False, label: str = "the model",
                     controls: dict | None = None, only=None,
                     more_builds: dict | None = None) -> dict:
    """What a user runs instead of Collage, timed interleaved in this process with the
    shipped Collage build (``collage_executable``: an executable, or a saved build loaded
    back, ``artifact.LoadedModule``, as the suites time it, or a ``LoadLater`` of one) on the
    same ``inputs`` (a tuple of torch tensors, in the order of the ONNX file's inputs),
    every library at this process's core count (``torch.set_num_threads(host_cores())``;
    the libraries as the backends make them, one thread per core):

    - "pytorch": ``model`` eager under ``inference_mode``: its outputs are the reference;
    - "onnxruntime": the user's ONNX file ``onnx_path``, all graph optimizations, a session
      made as the onnxruntime backend makes them (on the process-wide thread pool once that
      is set up, as ONNX Runtime then refuses a session with a pool of its own);
    - "openvino": the same file, latency hint, f32 precision;
    - "openvino (default)": latency hint and nothing else, so the CPU plugin's default
      precision (bf16 on CPUs with bf16 instructions: "precision" says which it used);
    - with ``torch_compile``, "torch.compile" (inductor, default mode; "compile_s"); with
      ``autocast``, "pytorch (bf16 autocast)";
    - with ``controls`` (A/A control name -> the framework it repeats: "onnxruntime",
      "openvino" or "openvino (default)"; ``suites.CONTROL``, ``suites.OPENVINO_CONTROLS``),
      the same file on that library again, a second session (or compiled model) timed as
      one more framework. Two runs of one thing: how far apart they land is the timing's
      noise on this row (``suites.versus``: "aa_spread", "openvino_f32_aa_spread",
      "openvino_aa_spread"). The controls are made after the Collage build where that is a
      ``LoadLater``, the frameworks before it.

    ``more_builds``: name -> another Collage executable, timed beside the shipped one under
    that name (``schedule_suite``: the placement built with a concurrent schedule).

    ``only``: the names of the libraries and controls to make (None: all), PyTorch and
    Collage always (``suites.framework_row`` times them a group at a time where all at once
    would not fit in memory).

    ``check(outputs, reference, precision)`` -> {"match", "max_err", "rel_err"} judges each
    row against PyTorch's outputs. A framework that fails to load or compile the model is
    reported with its error instead of a latency. Returns ``_rows``.
    """
    import torch

    from collage_tvm.target import host_cores

    torch.set_num_threads(host_cores())
    inputs = tuple(inputs)
    with torch.inference_mode():
        ref = _numpy_outputs(model(*inputs))
    runs, outs, extra = _torch_runs(model, inputs, ref, torch_compile, autocast, label)
    arrays = [i.numpy() for i in inputs]
    controls = {c: fw for c, fw in (controls or {}).items() if only is None or c in only}
    makers = _library_makers(onnx_path, arrays)
    _library_runs({n: m for n, m in makers.items() if only is None or n in only}, runs, outs,
                  extra)
    if isinstance(collage_executable, LoadLater):
        # made now, between the frameworks and their A/A controls: of two compiled instances
        # of one file, OpenVINO runs the one compiled first a few percent slower (docs/
        # COVERAGE.md), so an instance on either side brackets the build in time
        collage_executable = collage_executable.load()
    _library_runs({c: makers[fw] for c, fw in controls.items()
                   if fw in runs or (only is not None and fw not in only)}, runs, outs, extra)
    builds = {"collage": collage_executable}
    if collage_f32 is not None:
        builds["collage (f32)"] = collage_f32
    builds.update(more_builds or {})
    _collage_runs(builds, arrays, runs, outs, extra)
    print(f"  timing {', '.join(runs)} interleaved", flush=True)
    return _rows(outs, _framework_times(runs, extra, controls), ref, check, extra)


def _torch_runs(model, inputs: tuple, ref, torch_compile: bool, autocast: bool,
                label: str) -> tuple:
    """(runs, outs, extra) of PyTorch: eager (its outputs ``ref`` are the reference), and
    with ``torch_compile`` / ``autocast`` inductor and bf16 autocast (``torch_frameworks``).
    A failed compile is reported in ``outs``, not raised."""
    import torch

    def eager():
        with torch.inference_mode():
            return model(*inputs)

    runs: dict = {"pytorch": eager}
    outs: dict = {"pytorch": ref}
    extra: dict = {}
    if torch_compile:
        print(f"  torch.compile: compiling {label} with inductor (may take minutes)", flush=True)
        try:
            compiled = torch.compile(model)

            def inductor():
                with torch.inference_mode():
                    return compiled(*inputs)

            t0 = time.perf_counter()
            outs["torch.compile"] = _numpy_outputs(inductor())
            inductor()  # a recompile, if any, happens here rather than in the timing
            extra["torch.compile"] = {"compile_s": time.perf_counter() - t0}
            runs["torch.compile"] = inductor
            print(f"  torch.compile: compiled in {extra['torch.compile']['compile_s']:.1f} s",
                  flush=True)
        except Exception as err:  # noqa: BLE001 - a failed compile is reported, not fatal
            outs["torch.compile"] = _why(err)
    if autocast:
        def bf16():
            with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
                return model(*inputs)

        try:
            outs["pytorch (bf16 autocast)"] = _numpy_outputs(_float(bf16()))
            runs["pytorch (bf16 autocast)"] = bf16
            extra["pytorch (bf16 autocast)"] = {"precision": "bf16"}
        except Exception as err:  # noqa: BLE001 - reported, not fatal
            outs["pytorch (bf16 autocast)"] = _why(err)
    return runs, outs, extra


class LoadLater:
    """A Collage build ``torch_frameworks`` makes itself (``load()``: an executable or an
    ``artifact.LoadedModule``), after the frameworks and before their A/A controls."""

    def __init__(self, load):
        self.load = load


def _library_makers(onnx_path: str, arrays: list) -> dict:
    """name -> a maker of the user's ONNX file on a graph library, ``() -> (call, outputs[,
    the precision it chose])``: each graph library at f32, and OpenVINO at its default
    precision (``torch_frameworks``)."""
    from collage_tvm.registry import get_backend

    makers = {lib: (lambda lib=lib: _plain_runner(lib, get_backend(lib), onnx_path, arrays))
              for lib in GLUE_LIBRARIES}
    makers["openvino (default)"] = lambda: _openvino_default(onnx_path, arrays)
    return makers


def _library_runs(makers: dict, runs: dict, outs: dict, extra: dict) -> None:
    """Each of ``makers`` (``_library_makers``; an A/A control under its own name) made and
    added to ``runs`` / ``outs`` / ``extra``; a library that fails to load the file is
    reported with its error."""
    for name, maker in makers.items():
        try:
            made = maker()
        except Exception as err:  # noqa: BLE001 - a missing framework is reported, not fatal
            outs[name] = _why(err)
            continue
        runs[name], outs[name] = made[:2]
        if len(made) > 2:  # OpenVINO's default: the precision it chose
            extra[name] = {"precision": made[2]}


# The figure of the shipped build's VM called on TVM tensors made once (``_collage_runs``),
# timed beside the user's numpy call of a loaded build: what the call's copies cost. Not a
# contender (``suites.versus`` reads "collage"), nor an f32 mark of the runoff.
COLLAGE_ON_TENSORS = "collage (TVM tensors)"


def _collage_runs(builds: dict, arrays: list, runs: dict, outs: dict,
                  extra: dict | None = None) -> None:
    """Each Collage build of ``builds`` (name -> an executable, or a saved build loaded back,
    ``artifact.LoadedModule``, whose VM is made already) as a call on ``arrays``, added to
    ``runs`` / ``outs``. A loaded build is called as a user calls it, numpy arrays in and
    numpy arrays out (``LoadedModule.__call__``: the library's own call where the build is
    one file run whole by one library, ``LoadedModule.calls_library_directly``, else the VM
    with a copy of each input and output), the same arrays the frameworks are called on;
    its VM on TVM tensors made once is timed beside it as ``COLLAGE_ON_TENSORS`` (the
    shipped build's only). ``extra[name]["call"]``: which call ("numpy", "numpy, the
    library's own call", or "TVM tensors")."""
    import numpy as np
    import tvm
    from tvm import relax

    from collage_tvm.artifact import LoadedModule
    from collage_tvm.check import run_outputs

    extra = {} if extra is None else extra
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in arrays]
    for name, executable in builds.items():
        vm = getattr(executable, "vm", None) or relax.VirtualMachine(executable, dev)
        on_tensors = lambda main=vm["main"]: main(*args)  # noqa: E731
        if not isinstance(executable, LoadedModule):
            runs[name] = on_tensors
            outs[name] = run_outputs(vm, args)
            extra.setdefault(name, {})["call"] = "TVM tensors"
            continue
        runs[name] = lambda build=executable: build(*arrays)
        # its first calls race what the search left close (``check.race``), as a server's
        # first calls do: before the timing
        executable.settle(*arrays)
        if executable.decided:
            extra.setdefault(name, {})["decided"] = executable.decided
        got = executable(*arrays)
        outs[name] = [np.asarray(o) for o in (got if isinstance(got, tuple) else (got,))]
        extra.setdefault(name, {})["call"] = (
            "numpy, the library's own call" if executable.calls_library_directly else "numpy")
        if name == "collage":
            runs[COLLAGE_ON_TENSORS] = on_tensors
            outs[COLLAGE_ON_TENSORS] = run_outputs(vm, args)
            extra.setdefault(COLLAGE_ON_TENSORS, {})["call"] = "TVM tensors"


def _framework_times(runs: dict, extra: dict, controls: dict | None = None) -> dict:
    """name -> ms of ``runs`` (name -> a call), timed interleaved ``FRAMEWORK_ROUNDS``
    rounds; then the runoff: Collage's figures ("collage", "collage (f32)") with every figure
    within ``ROW_RUNOFF_MARGIN`` of Collage's (either side) or, where the fastest f32 one is
    ahead of Collage, of that one, timed on together until each has ``ROW_RUNOFF_ROUNDS``
    batches (an A/A control of ``controls`` and the framework it repeats go on together when
    either is close, so it stays a control of the same timing). A figure is f32 unless
    ``extra[name]["precision"]`` says otherwise. ``extra[name]["rounds"]``: the batches
    behind each figure."""
    from collage_tvm.measure.timing import interleaved

    samples: dict = {}
    ms = interleaved(runs, rounds=FRAMEWORK_ROUNDS, min_ms=FRAMEWORK_BATCH_MS, samples=samples)
    mine = [n for n in ("collage", "collage (f32)") if n in ms]
    controls = controls or {}
    f32 = [ms[n] for n in ms if n not in mine and n not in controls
           and n != COLLAGE_ON_TENSORS and extra.get(n, {}).get("precision", "f32") == "f32"]
    marks = [ms[c] for c in mine]
    if f32 and mine and min(f32) < min(ms[c] for c in mine):
        marks.append(min(f32))  # a framework ahead of Collage: is it, or was it luck?
    close = {n for n in ms for m in marks if abs(ms[n] / m - 1.0) <= ROW_RUNOFF_MARGIN}
    close |= set(mine)
    for control, fw in controls.items():
        if control in runs and fw in runs and close & {fw, control}:
            # the pair goes on together: a control timed on alone (ONNX Runtime's first
            # rounds slower, by the noise the control is there to show) would leave the
            # framework's figure on fewer rounds than Collage's (docs/COVERAGE.md: timm's
            # tinynet_e)
            close |= {fw, control}
    if mine and len(close) > len(mine):
        print(f"  runoff: {', '.join(n for n in runs if n in close)} timed on to "
              f"{ROW_RUNOFF_ROUNDS} rounds", flush=True)
        ms.update(interleaved({n: runs[n] for n in runs if n in close},
                              rounds=ROW_RUNOFF_ROUNDS - FRAMEWORK_ROUNDS,
                              min_ms=FRAMEWORK_BATCH_MS, samples={n: samples[n] for n in close}))
    for n in ms:
        # the batches in round order (batch i of two figures: the same round, side by
        # side; ``suites.versus`` pairs them)
        extra.setdefault(n, {}).update(rounds=len(samples[n]),
                                       batches=[round(b, 4) for b in samples[n]])
    return ms


def _rows(outs: dict, ms: dict, ref, check, extra: dict) -> dict:
    """Framework -> {"ms", "match", "max_err", "rel_err", ...} (or {"error"}) of its outputs
    ``outs[fw]`` (an error string when it failed) against ``ref`` by ``check(outputs, ref,
    precision)`` (the row's precision: ``extra[fw]["precision"]``, else f32)."""
    result = {}
    for fw, out in outs.items():
        if isinstance(out, str):
            result[fw] = {"error": out, "ms": math.nan, "match": False}
            continue
        judged = check(out, ref, extra.get(fw, {}).get("precision", "f32"))
        result[fw] = {"ms": ms[fw], "match": judged["match"], "max_err": judged["max_err"],
                      "rel_err": judged["rel_err"], **extra.get(fw, {})}
    return result


def gpu_frameworks(name: str, size: str, collage_executable, accuracy=None) -> dict:
    """The frameworks on the GPU beside the shipped Collage build (issue #19): PyTorch eager
    on CUDA, ``torch.compile`` (inductor, default mode) and ``torch.compile(mode=
    "reduce-overhead")`` (inductor with CUDA graphs), all in f32 (TF32 off, as Collage's
    lowerings run), timed interleaved with the device synchronised before each clock read.
    Rows as ``frameworks``; errors against PyTorch eager on the CPU in f32."""
    from collage_tvm.precision import parse_accuracy

    accuracy = parse_accuracy(accuracy)
    import torch
    import tvm
    from tvm import relax

    from collage_tvm.check import run_outputs
    from collage_tvm.measure.cuda_graph import capture
    from collage_tvm.measure.timing import interleaved

    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    model, x = model_and_input(name, size)
    with torch.inference_mode():
        ref = _numpy_outputs(model(x))
    gpu_model, gx = model.to("cuda"), x.to("cuda")
    runs: dict = {}
    outs: dict = {}
    extra: dict = {}

    def eager():
        with torch.inference_mode():
            return gpu_model(gx)

    runs["pytorch (cuda)"] = eager
    outs["pytorch (cuda)"] = _numpy_outputs(_to_cpu(eager()))
    for label, mode in (("torch.compile", "default"),
                        ("torch.compile (cuda graphs)", "reduce-overhead")):
        print(f"  {label}: compiling {name} with inductor, mode {mode}", flush=True)
        try:
            compiled = torch.compile(gpu_model, mode=mode)

            def inductor(fn=compiled):
                with torch.inference_mode():
                    return fn(gx)

            t0 = time.perf_counter()
            for _ in range(3):  # CUDA graphs are recorded on the third call
                out = inductor()
            outs[label] = _numpy_outputs(_to_cpu(out))
            extra[label] = {"compile_s": time.perf_counter() - t0}
            runs[label] = inductor
        except Exception as err:  # noqa: BLE001 - a failed compile is reported, not fatal
            outs[label] = _why(err)
    dev = tvm.cuda()
    vm = relax.VirtualMachine(collage_executable, dev)
    args = [tvm.runtime.tensor(x.numpy(), dev)]
    outs["collage"] = run_outputs(vm, args)
    main = capture(vm, args, "cuda")  # one CUDA graph where it can be
    runs["collage"] = main.replay
    extra["collage"] = {"cuda_graph": main.state}
    print(f"  timing {', '.join(runs)} interleaved on the GPU", flush=True)
    extra = {fw: {"precision": "f32", **extra.get(fw, {})} for fw in outs}
    return _rows(outs, interleaved(runs, sync=torch.cuda.synchronize), ref,
                 lambda out, r, precision: accuracy.check(out, r), extra)


def _to_cpu(out):
    """A torch output (tensor or tuple of them) on the CPU."""
    if isinstance(out, (tuple, list)):
        return type(out)(_to_cpu(o) for o in out)
    return out.cpu() if hasattr(out, "cpu") else out


def _float(out):
    """A torch output (tensor or tuple of them) in float32."""
    if isinstance(out, (tuple, list)):
        return type(out)(t.float() for t in out)
    return out.float()


def _openvino_default(onnx_path: str, arrays: list) -> tuple:
    """OpenVINO as a user runs it on the ONNX file (its external data beside it): the
    latency hint and nothing else, so the CPU plugin's default inference precision (bf16
    where the CPU has bf16 instructions). (call, outputs, the precision it used)."""
    import openvino as ov

    from collage_tvm.backends._graphlib import threads

    core = ov.Core()
    compiled = core.compile_model(core.read_model(onnx_path), "CPU",
                                  {"PERFORMANCE_HINT": "LATENCY",
                                   "INFERENCE_NUM_THREADS": threads()})
    hint = compiled.get_property("INFERENCE_PRECISION_HINT")  # an ov.Type: bf16, f32, ...
    used = hint.get_type_name() if hasattr(hint, "get_type_name") else str(hint)
    req = compiled.create_infer_request()
    outputs = [req.infer(arrays)[o] for o in compiled.outputs]
    return (lambda: req.infer(arrays, share_inputs=True, share_outputs=True)), outputs, used


def _numpy_outputs(out) -> list:
    """A torch model's output (a tensor or a tuple/list of them) as a list of numpy arrays."""
    return [t.numpy() for t in (out if isinstance(out, (tuple, list)) else [out])]


def _why(err: Exception) -> str:
    """An exception as one line (inductor's and OpenVINO's messages run to pages)."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


ABLATION_ONCE_MS = 2000.0  # an ablation step slower than this per run is timed once


def ablation_steps(onnx_path: str, options: SearchOptions, db) -> list:
    """Paper Fig. 11: Collage with ``options.backends`` added one at a time in their order.

    Step k searches with ``backends[:k]`` (``tvm`` is always among them), the other search
    options as given (see ``variant_steps`` for how the steps are built, timed and checked).
    Returns one ``{"backends", "ms", "match", "max_err", "ops_per_backend", "search_s"}``
    per step (with ``"timed_once": True`` and ``"skipped"`` backends where they apply).
    """
    backends = options.backends
    variants = [(f"Collage with {', '.join(backends[:k])}",
                 SearchOptions.of(options, backends=tuple(backends[:k])))
                for k in range(1, len(backends) + 1)]
    steps = variant_steps(onnx_path, variants, db)
    for k, step in enumerate(steps):
        step["backends"] = list(backends[:k + 1])
    return steps


def rewrite_steps(onnx_path: str, options: SearchOptions, db) -> list:
    """Issue #18: Collage placed-only beside rewritten-then-placed (``rewrite=True``), built,
    timed and checked as ``variant_steps`` does; the second step carries the rewrite search's
    report (``"rewrite"``)."""
    return variant_steps(onnx_path, [
        ("placed", SearchOptions.of(options, rewrite=False)),
        ("rewritten+placed", SearchOptions.of(options, rewrite=True))], db)


def tuning_steps(onnx_path: str, options: SearchOptions, db) -> list:
    """Issue #16: the same search with TVM's kernels untuned (``tuning=False``) beside it
    with the tuning database's records, built, timed interleaved and checked as
    ``variant_steps`` does."""
    return variant_steps(onnx_path, [
        ("untuned TVM", SearchOptions.of(options, tuning=False)),
        ("tuned TVM", SearchOptions.of(options, tuning=True))], db)


def tune_model(onnx_path: str, options: SearchOptions, db, budget: float) -> dict:
    """``collage_tvm.tune`` on the model with the bench's backends: the summary and the
    per-kernel rows (``TuneReport``) for results.json; the table is printed."""
    from collage_tvm.tuning.plan import tune

    rep = tune(onnx_path, "llvm", list(options.backends), db=db, budget=budget,
               progress=options.progress)
    print(rep.markdown() + f"  {rep.summary()}", flush=True)
    return {"summary": rep.summary(), "times": rep.times, "tuning_db": rep.tuning_db,
            "kernels": [{"name": r.name, "status": r.status, "trials": r.trials,
                         "untuned_ms": r.untuned_ms, "tuned_ms": r.tuned_ms,
                         "best_library_ms": r.best_library_ms, "reason": r.reason, **r.info}
                        for r in rep.results]}


def variant_steps(onnx_path: str, variants: list, db) -> list:
    """Collage once per ``(label, SearchOptions)`` of ``variants``, each keeping its own
    placement (``compare=False``, and a placement log of its own: the persistent one holds
    what the never-slower check shipped, possibly a single-library build); every step reads
    and fills the same cost DB. The steps' executables are then timed interleaved in one go,
    except a step whose first run took over ``ABLATION_ONCE_MS``, which is timed once
    (untuned TVM on a paper-size model can take minutes per run, and interleaved timing runs
    each step at least ten times). Each step's output is checked against the first step's.

    Returns one ``{"label", "ms", "match", "max_err", "ops_per_backend", "search_s"}`` per
    step (with ``"timed_once"``, ``"skipped"`` backends and ``"rewrite"`` where they apply).
    """
    import tvm
    from tvm import relax

    from collage_tvm.build import optimize
    from collage_tvm.check import compare_outputs, run_outputs
    from collage_tvm.graph.subgraph import random_inputs
    from collage_tvm.measure.timing import interleaved
    from collage_tvm.placement_log import PlacementLog

    log = PlacementLog(None)
    dev = tvm.cpu()
    steps, runs, outputs = [], [], []
    for k, (label, options) in enumerate(variants):
        print(f"  step {k + 1}/{len(variants)}: {label}", flush=True)
        t0 = time.perf_counter()
        res = optimize(onnx_path, "llvm", db=db, placement_log=log,
                       options=_with_progress(options, compare=False))
        step = {"label": label, "ops_per_backend": res.report.ops_per_backend,
                "search_s": time.perf_counter() - t0}
        if res.report.skipped:
            step["skipped"] = res.report.skipped
        if res.report.rewrite:
            step["rewrite"] = res.report.rewrite
        if res.report.carved:
            step["carved"] = res.report.carved
        vm = relax.VirtualMachine(res.executable, dev)
        args = [tvm.runtime.tensor(a, dev) for a in random_inputs(res.graph.func)]
        outputs.append(run_outputs(vm, args))
        main = vm["main"]
        t0 = time.perf_counter()
        main(*args)
        step["ms"] = (time.perf_counter() - t0) * 1e3
        runs.append(lambda main=main, args=args: main(*args))
        steps.append(step)
    timed = {k: run for k, (run, s) in enumerate(zip(runs, steps))
             if s["ms"] <= ABLATION_ONCE_MS}
    print(f"  timing {len(timed)} steps interleaved"
          + (f" ({len(steps) - len(timed)} timed once: over {ABLATION_ONCE_MS:.0f} ms a run)"
             if len(timed) < len(steps) else ""), flush=True)
    for k, ms in interleaved(timed).items():
        steps[k]["ms"] = ms
    for k, step in enumerate(steps):
        if k not in timed:
            step["timed_once"] = True
        step["match"], step["max_err"] = compare_outputs(outputs[k], outputs[0])
    return steps


def known_models() -> list:
    return sorted(zoo.known())


def _with_progress(options: SearchOptions, **changes) -> SearchOptions:
    """``options`` with ``changes``, printing each generation of a graph-level search
    (unless the options bring their own ``on_generation``)."""
    options = SearchOptions.of(options, **changes)
    if options.graph_level and options.on_generation is None:
        options = SearchOptions.of(options, on_generation=_print_generation)
    return options


def bench_model(name: str, out_dir: str, options: SearchOptions, db, glue: bool = True,
                size: str = "paper", ablation: bool = False, rewrite: bool = False,
                tune: float = 0.0, target="llvm", deploy: bool = False) -> dict:
    """One model: the Collage search with ``options`` (and the never-slower comparison),
    the frameworks, the glue check; with ``ablation``, the ablation steps; with
    ``rewrite``, placed-only beside rewritten+placed (``rewrite_steps``); with ``tune``
    seconds, first ``collage_tvm.tune`` (the search then uses tuned TVM), and at the end
    the search untuned beside tuned (``tuning_steps``). ``target`` "cuda": the search on
    the GPU and the frameworks there (``gpu_frameworks``); the steps above are CPU only.
    ``deploy``: the shipped build saved and loaded in a fresh process (``deploy.deploy_row``)."""
    from collage_tvm.target import make_target

    on_gpu = make_target(target).kind.name == "cuda"
    if on_gpu and (tune > 0 or ablation or rewrite or not options.accuracy.strict):
        raise ValueError("bench on a cuda target: --tune, --ablation, --rewrite and --accuracy "
                         "are CPU only for now")
    path = model_onnx(name, size, out_dir)
    entry: dict = {"model": name, "size": size}
    if tune > 0:
        print(f"\n== {name}: tuning TVM's kernels ({tune:.0f} s)", flush=True)
        entry["tuning"] = tune_model(path, options, db, tune)
    # The two-level run's comparison already holds the op-level placement ("collage-op-level")
    # whenever the graph-level search changed it: one run covers both levels.
    label = "two-level" if options.graph_level else "op-level"
    res, entry[label], f32 = _searched(name, path, label, options, db, target)
    print(f"\n== {name}: frameworks beside the shipped Collage build", flush=True)
    entry["accuracy"] = str(options.accuracy)
    entry["frameworks"] = (gpu_frameworks(name, size, res.executable) if on_gpu else
                           frameworks(name, size, path, res.executable, options.accuracy, f32))
    for fw, r in entry["frameworks"].items():
        print(f"  {fw:<24} {r['ms']:>10.3f} ms  match={r['match']}"
              + (f"  ({r['error']})" if r.get("error") else
                 f"  error {r['rel_err']:.1e} of the scale"), flush=True)
    if deploy:
        from .deploy import deploy_row

        print(f"\n== {name}: saved, loaded in a fresh process", flush=True)
        entry["deploy"] = d = deploy_row(path, res, out_dir, name)
        print(f"  load {d['load_s']:.3f} s (an ONNX Runtime session: "
              f"{d['ort_session_s']:.3f} s), outputs identical: {d['identical']}, "
              f"loaded {d['loaded_ms']:.3f} ms vs in-process {d['in_process_ms']:.3f} ms",
              flush=True)
    _more_steps(entry, name, path, options, db, glue and not on_gpu, ablation, rewrite, tune)
    return entry


def _searched(name: str, path: str, label: str, options: SearchOptions, db, target) -> tuple:
    """(result, the report's entry, the f32 executable or None) of ``bench_model``'s search:
    ``collage_tvm.optimize`` with the comparison, and under a reduced accuracy budget again
    at the strict f32 one (the two-precision table's second build)."""
    from collage_tvm.build import optimize

    budget = "" if options.accuracy.strict else f", accuracy budget {options.accuracy}"
    print(f"\n== {name}: Collage {label} ({', '.join(options.backends)}{budget})", flush=True)
    t0 = time.perf_counter()
    res = optimize(path, target, db=db, options=_with_progress(options, compare=True))
    rep = res.report
    entry = {"comparison": records(rep.comparison), "shipped": rep.shipped,
             "times": rep.times, "wall_s": time.perf_counter() - t0,
             "measured": rep.distinct_measured, "db_hits": rep.db_hits,
             "from_log": rep.placement_from_log,
             "ops_per_backend": rep.ops_per_backend,
             "calibration": rep.calibration,
             "alternative_covers": rep.alternative_covers, "side_by_side": rep.side_by_side,
             "lean": rep.lean, "candidates": rep.candidates,
             "switch_cost": {f"{a}|{b}": v for (a, b), v in rep.switch_cost.items()},
             "graph_level": {k: v for k, v in rep.graph_level.items() if k != "history"}}
    _print_comparison(entry["comparison"], rep.shipped)
    f32 = None
    if not options.accuracy.strict:
        print(f"\n== {name}: Collage {label} at the strict f32 budget, for the "
              "two-precision table", flush=True)
        f32_res = optimize(path, "llvm", db=db,
                           options=_with_progress(options, compare=True, accuracy="f32"))
        entry["f32"] = {"shipped": f32_res.report.shipped,
                        "ops_per_backend": f32_res.report.ops_per_backend}
        f32 = f32_res.executable
    return res, entry, f32


def _more_steps(entry: dict, name: str, path: str, options: SearchOptions, db, glue: bool,
                ablation: bool, rewrite: bool, tune: float) -> None:
    """``bench_model``'s optional steps, each into ``entry``: the glue overhead of each
    graph library (``glue``), the ablation, placed-only beside rewritten+placed, and
    untuned TVM beside tuned (``tune`` seconds)."""
    for lib in [b for b in GLUE_LIBRARIES if b in options.backends] if glue else []:
        print(f"\n== {name}: glue overhead, wholly on {lib} through collage-tvm vs plain {lib}",
              flush=True)
        entry.setdefault("glue", {})[lib] = g = glue_overhead(path, lib)
        print(f"  {lib}: " + (g["error"] if "error" in g else
                              f"plain {g['plain_ms']:.3f} ms, through collage-tvm "
                              f"{g['collage_ms']:.3f} ms ({g['overhead'] * 100:+.1f}%), "
                              f"match={g['match']}"), flush=True)
    if ablation:
        print(f"\n== {name}: ablation, Collage with the backends added one at a time", flush=True)
        entry["ablation"] = ablation_steps(path, options, db)
        for step in entry["ablation"]:
            print(f"  {'+'.join(step['backends']):<40} {step['ms']:>10.3f} ms  "
                  f"match={step['match']}", flush=True)
    if rewrite:
        print(f"\n== {name}: placed-only beside rewritten+placed", flush=True)
        entry["rewrite"] = rewrite_steps(path, options, db)
        for step in entry["rewrite"]:
            print(f"  {step['label']:<40} {step['ms']:>10.3f} ms  match={step['match']}"
                  + (f"  {step['rewrite']}" if "rewrite" in step else ""), flush=True)
    if tune > 0:
        print(f"\n== {name}: the search with untuned TVM beside tuned TVM", flush=True)
        entry["tuned"] = tuning_steps(path, options, db)
        for step in entry["tuned"]:
            print(f"  {step['label']:<40} {step['ms']:>10.3f} ms  match={step['match']}  "
                  f"{step['ops_per_backend']}", flush=True)


def _print_generation(e) -> None:
    print(f"  generation {e['gen']:>3}: best {e['best_ms']:.3f} ms "
          f"({e['evaluated']} placements measured, {e['elapsed_s']:.0f} s)", flush=True)


def _print_comparison(comparison: dict, shipped: str) -> None:
    """The final check's contenders (their records, ``check.contender``), one line each."""
    base = comparison.get("collage", {}).get("ms", math.nan)
    for n, r in comparison.items():
        flag = "  <- shipped" if n == shipped else ""
        print(f"  {n:<18} {r['ms']:>10.3f} ms  x{r['ms'] / base:>6.2f}  "
              f"match={r['match']}{flag}{note(r.get('cuda_graph'))}", flush=True)


def markdown(results: dict) -> str:
    gpu = f", GPU {results['machine']['gpu']}" if results["machine"].get("gpu") else ""
    lines = [f"Machine: {results['machine']['cpu']}, {results['machine']['cores']} cores{gpu}; "
             f"TVM {results['machine']['tvm']}, onnxruntime {results['machine']['onnxruntime']}, "
             f"OpenVINO {results['machine'].get('openvino', '-')}, torch {results['machine']['torch']}",
             ""]
    for m in results["models"]:
        if "error" in m:
            lines += [f"### {m['model']}: FAILED", "", m["error"], ""]
            continue
        for level in ("op-level", "two-level"):
            if level not in m:
                continue
            r = m[level]
            comp = r["comparison"]
            lines += [f"### {m['model']}, Collage {level} (shipped: {r['shipped']})", "",
                      "| build | latency ms | relative to Collage | outputs match the reference |",
                      "|---|---:|---:|---|"]
            base = comp.get("collage", {}).get("ms", math.nan)
            for n, c in comp.items():
                same = f" (same placement as {c['same_as']})" if c.get("same_as") else ""
                same += note(c.get("cuda_graph"))
                same += " (the reference)" if c.get("reference") else ""
                match = "yes" if c["match"] else "not built" if c.get("skipped") else "NO"
                lines.append(f"| {n}{same} | {c['ms']:.3f} | {c['ms'] / base:.2f}x | {match} |")
            t = r["times"]
            lines += ["", "Search: " + ", ".join(f"{k} {v:.1f} s" for k, v in t.items()), ""]
        if "frameworks" in m:
            fw = m["frameworks"]
            base = fw["collage"]["ms"]
            others = [r["ms"] for n, r in fw.items()
                      if not n.startswith("collage") and r["match"]]
            best = min(others, default=math.nan)
            budget = m.get("accuracy", "f32")
            lines += [f"Frameworks (interleaved with the shipped Collage build; speedup = their "
                      f"latency / Collage's; best other within the {budget} budget: "
                      f"{best / base:.2f}x):", "",
                      "| framework | precision | latency ms | Collage speedup | error (of the "
                      f"output scale) | within {budget} of PyTorch f32 |",
                      "|---|---|---:|---:|---:|---|"]
            for n, r in fw.items():
                if r.get("error"):
                    lines.append(f"| {n} | - | - | - | - | failed: {r['error']} |")
                    continue
                rel = f"{r['rel_err']:.1e}" if "rel_err" in r else "-"
                lines.append(f"| {n} | {r.get('precision', _precision_of(n, budget))} | "
                             f"{r['ms']:.3f} | {r['ms'] / base:.2f}x | {rel} | "
                             f"{'yes' if r['match'] else 'NO'} |")
            if "compile_s" in fw.get("torch.compile", {}):
                compile_s = fw["torch.compile"]["compile_s"]
                lines += ["", f"torch.compile compiled in {compile_s:.1f} s."]
            lines.append("")
        for lib, g in m.get("glue", {}).items():
            if "overhead" in g:
                lines += [f"Glue: plain {lib} {g['plain_ms']:.3f} ms, the model wholly on {lib} "
                          f"through collage-tvm {g['collage_ms']:.3f} ms "
                          f"({g['overhead'] * 100:+.1f}%)", ""]
        if "ablation" in m:
            lines += _steps_table(
                m["ablation"], "Ablation (paper Fig. 11): Collage with the backends added one "
                "at a time, timed interleaved; speedup over the first step:",
                ["backends", "matches first step", "ops per backend"],
                lambda step: [", ".join(step["backends"]), _ops(step)])
        if "tuned" in m:
            lines += _steps_table(
                m["tuned"], "Tuned TVM (issue #16): the search with untuned TVM beside the "
                "same search with the tuning database, timed interleaved:",
                ["build", "matches untuned", "ops per backend"],
                lambda step: [step["label"], _ops(step)])
            lines += _carve_lines(m["tuned"])
        if "rewrite" in m:
            lines += _steps_table(
                m["rewrite"], "Graph rewrites (issue #18): placed-only beside "
                "rewritten+placed, timed interleaved:",
                ["build", "matches placed-only", "rewrites applied"],
                lambda step: [step["label"], ", ".join(step.get("rewrite", {}).get(
                    "applied", [])) + (" (affine tails folded)" if step.get(
                        "rewrite", {}).get("folded_affine_tails") else "")])
    return "\n".join(lines)


def _carve_lines(steps: list) -> list:
    """What cutting regions around the winning TVM kernels found, per step (``_carve``)."""
    lines = []
    for step in steps:
        c = step.get("carved")
        if not c:
            continue
        best = c["best_cut"]
        lines.append(f"- {step['label']}: {c['pieces']} region piece(s) measured for "
                     f"{c['cuts']} cut(s) around TVM kernels that beat the library on their "
                     f"operators; estimate {c['estimated_ms'][0]:.3f} -> "
                     f"{c['estimated_ms'][1]:.3f} ms. Best cut (around "
                     f"{', '.join(best['around'][:3])}{' ...' if len(best['around']) > 3 else ''}): "
                     f"{best['cut_ms']:.3f} ms, TVM's kernels {best['tvm_ms']:.3f} ms of it, "
                     f"against {best['region_ms']:.3f} ms for the region whole.")
    return lines + [""] if lines else []


def _precision_of(row: str, budget: str) -> str:
    """The precision of a framework row without one recorded: Collage's is its budget's."""
    if row == "collage":
        return "f32" if budget == "f32" else f"budget {budget}"
    return "f32"


def _ops(step: dict) -> str:
    """A step's operators per backend, as a table cell."""
    return ", ".join(f"{b} {n}" for b, n in step["ops_per_backend"].items())


def _steps_table(steps: list, title: str, heads: list, cells) -> list:
    """Markdown lines: a table of ``variant_steps``' steps; ``heads`` = (first column,
    match column, last column); ``cells(step)`` -> (first cell, last cell)."""
    lines = [title, "", f"| {heads[0]} | latency ms | speedup | {heads[1]} | {heads[2]} |",
             "|---|---:|---:|---|---|"]
    for step in steps:
        first, last = cells(step)
        once = " (timed once)" if step.get("timed_once") else ""
        lines.append(f"| {first} | {step['ms']:.3f}{once} | {steps[0]['ms'] / step['ms']:.2f}x"
                     f" | {'yes' if step['match'] else 'NO'} | {last} |")
    return lines + [""]


FRAMEWORK_LABELS = {"pytorch": "PyTorch eager", "torch.compile": "torch.compile",
                    "onnxruntime": "ONNX Runtime", "openvino": "OpenVINO"}


def speedups(m: dict) -> dict:
    """Label -> (speedup of the shipped Collage build, output matched) for one model's entry.

    Frameworks: their latency / Collage's, both from the interleaved framework run.
    Single-backend builds (tvm-only, ``<lib>+tvm``, ``<lib>`` through collage-tvm): their
    latency / the shipped build's in the never-slower comparison. Failed entries are left out.
    """
    out = {}
    fw = m.get("frameworks", {})
    base = fw.get("collage", {}).get("ms", math.nan)
    for n, r in fw.items():
        if n != "collage" and math.isfinite(r["ms"]):
            out[FRAMEWORK_LABELS.get(n, n)] = (r["ms"] / base, r["match"])
    level = "two-level" if "two-level" in m else "op-level"
    comp = m.get(level, {}).get("comparison", {})
    shipped = comp.get(m.get(level, {}).get("shipped", "collage"), {}).get("ms", math.nan)
    for n, r in comp.items():
        if not n.startswith("collage") and math.isfinite(r.get("ms", math.inf)):
            out[f"{n} build"] = (r["ms"] / shipped, r["match"])
    return out


PLOT_CLIP = 4.0  # speedups above this are drawn cut, with their value printed


def plot(results: dict, path: str) -> str:
    """A PNG like the paper's Fig. 7: per model, the shipped Collage build's speedup over
    each framework and single-backend build (above 1: Collage is faster). Hatched bars:
    that entry's output did not match its reference. Returns ``path``. Needs matplotlib
    (``MissingPlotExtra`` without it)."""
    matplotlib = need_matplotlib("the bench plot (results.png)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per_model = [(m["model"], speedups(m)) for m in results["models"] if "error" not in m]
    labels = list(dict.fromkeys(label for _, sp in per_model for label in sp))
    width = 0.8 / max(len(labels), 1)
    # Linear axis cut at PLOT_CLIP: the question the plot answers is "is Collage at least
    # as fast as each alternative", which a log axis stretched by a 300x untuned tvm-only
    # bar hides. Cut bars carry their value on top.
    top = max((v for _, sp in per_model for v, _ in sp.values()), default=1.0)
    clip = PLOT_CLIP if top > PLOT_CLIP * 1.25 else max(top, 1.0) * 1.15
    fig, ax = plt.subplots(figsize=(min(18.0, max(8.0, 3.0 + len(per_model) * len(labels) * 0.22)),
                                    5.0))
    palette = "tab10" if len(labels) <= 10 else "tab20"  # a colour each, bf16 rows included
    colors = plt.get_cmap(palette)
    for k, label in enumerate(labels):
        xs = [i + (k - (len(labels) - 1) / 2) * width for i, (_, sp) in enumerate(per_model)
              if label in sp]
        vals = [sp[label] for _, sp in per_model if label in sp]
        bars = ax.bar(xs, [min(v, clip) for v, _ in vals], width, label=label,
                      color=colors(k % colors.N), edgecolor="black", linewidth=0.5)
        for bar, (v, match) in zip(bars, vals):
            if not match:
                bar.set_hatch("xx")
            cut = v > clip
            ax.annotate(f"{v:.0f}x" if cut else f"{v:.2f}",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=6, rotation=90,
                        fontweight="bold" if cut else "normal")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_ylim(0, clip * 1.18)  # room for the value labels
    if clip == PLOT_CLIP:
        ax.axhline(clip, color="grey", linewidth=0.6, linestyle="--")
    ax.set_xticks(range(len(per_model)), [name for name, _ in per_model])
    ax.set_ylabel("Collage speedup (their latency / Collage's)")
    mach = results["machine"]
    ax.set_title(f"Shipped Collage build vs frameworks and single-backend builds\n"
                 f"{mach['cpu']}, {mach['cores']} cores (hatched: output did not match; bars above "
                 f"the dashed line are cut, value printed)",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_ablation(results: dict, path: str) -> str:
    """A PNG like the paper's Fig. 11: per model, the speedup of each ablation step over the
    first one's as backends are added; a red 'x' marks a step whose output did not match
    the first step's. Returns ``path``. Needs matplotlib (``MissingPlotExtra`` without it)."""
    matplotlib = need_matplotlib("the ablation plot (results_ablation.png)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.5))
    ablated = [m for m in results["models"] if m.get("ablation")]
    for m in ablated:
        steps = m["ablation"]
        ys = [steps[0]["ms"] / s["ms"] for s in steps]
        ax.plot(range(len(steps)), ys, marker="o", label=m["model"])
        bad = [(k, y) for k, (s, y) in enumerate(zip(steps, ys)) if not s["match"]]
        if bad:
            ax.scatter(*zip(*bad), marker="x", s=80, color="red", zorder=3)
    # Every model of a run ablates the same backend list.
    steps = ablated[0]["ablation"] if ablated else []
    ticks = ["+".join(s["backends"]) if k == 0 else f"+{s['backends'][-1]}"
             for k, s in enumerate(steps)]
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(range(len(ticks)), ticks)
    ax.set_xlabel("backends added one at a time")
    ax.set_ylabel("speedup over the first step")
    ax.set_title("Collage ablation (red x: output did not match the first step's)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run(models, out_dir: str, backends=None, db=None, *, options: SearchOptions | None = None,
        size: str = "paper", ablation: bool = False, rewrite: bool = False,
        tune: float = 0.0, target="llvm", deploy: bool = False, **option_fields) -> dict:
    """Bench ``models``; writes results.json (after each model), results.md, results.png
    and, with ``ablation``, results_ablation.png into ``out_dir``; ``rewrite``: also
    placed-only beside rewritten+placed (``rewrite_steps``); ``tune``: seconds of
    ``collage_tvm.tune`` per model first, and untuned beside tuned (``tuning_steps``).

    The search: ``options`` (a ``SearchOptions``) and/or its fields by name, as
    ``collage_tvm.optimize`` takes them (``backends``, ``graph_level=True``, ``budget=120``,
    ...); every model's search compares with the single-backend builds (``compare``).
    Returns the results, with ``"files"``: the names of the files written into ``out_dir``
    (a plot is left out, with a message, when matplotlib is not installed).
    """
    options = SearchOptions.of(options, backends=backends, **option_fields)
    os.makedirs(out_dir, exist_ok=True)
    results = {"machine": machine(), "backends": list(options.backends), "models": []}
    for name in models:
        try:
            entry = bench_model(name, out_dir, options, db, size=size, ablation=ablation,
                                rewrite=rewrite, tune=tune, target=target, deploy=deploy)
        except Exception as err:  # noqa: BLE001 - one model's failure must not lose the others
            logger.exception("bench: %s failed", name)
            entry = {"model": name, "size": size, "error": _why(err)}
            print(f"\n== {name}: FAILED ({entry['error']}); going on with the next model",
                  flush=True)
        results["models"].append(entry)
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(markdown(results))
    files = ["results.json", "results.md"]
    plots = [(plot, "results.png")]
    plots += [(plot_ablation, "results_ablation.png")] if ablation else []
    for draw, png in plots:
        try:
            draw(results, os.path.join(out_dir, png))
            files.append(png)
        except MissingPlotExtra as err:
            print(f"\n{png} not written: {err}", flush=True)
    results["files"] = files
    return results
