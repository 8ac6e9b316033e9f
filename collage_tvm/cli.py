"""``collage-tvm``: optimize a model, run a saved build, inspect the cost DB."""
from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time


def _optimize(args) -> int:
    from .build import optimize
    from .frontend.load import parse_input_shapes, read_example_inputs
    from .registry import load_pattern_file

    for path in args.patterns or []:
        names = load_pattern_file(path)
        print(f"loaded pattern file {path}: backends {', '.join(names)}")
    backends = [b for b in args.backends.split(",") if b]
    t0 = time.perf_counter()
    on_generation = None
    if args.graph_level:
        print(f"graph-level search: budget {args.budget:.0f} s")

        def on_generation(e):
            print(f"  generation {e['gen']:>3}: best {e['best_ms']:.3f} ms "
                  f"({e['evaluated']} placements measured, {e['elapsed_s']:.0f} s)", flush=True)
    def on_calibration(e):
        extra = ", ".join(f"{b} +{v:.3f}" for b, v in sorted(e["extra_epsilon"].items()))
        print(f"  calibration round {e['round']}: {e['kernels']} kernels, estimate "
              f"{e['estimate_ms']:.3f} ms, measured {e['measured_ms']:.3f} ms; in-context "
              f"ms per call: {extra}", flush=True)

    example = read_example_inputs(args.inputs, args.model) if args.inputs else None
    res = optimize(args.model, args.target, db=args.db, options=_options(args, backends),
                   input_shapes=parse_input_shapes(args.input_shape), example_inputs=example,
                   on_generation=on_generation, on_calibration=on_calibration)
    if res.report.dynamic:
        print(f"\nthe search at the optimum "
              f"({_shapes_text(res.report.dynamic['ranges'], 'opt')}):")
    code = _report(args, res, t0)
    if res.report.dynamic:
        _print_dynamic(res.report)
    if args.report:
        _write_report(res, args)
    if args.export:
        _export(res, args)
    return code


def _write_report(res, args) -> None:
    """``optimize --report FILE.json``: the build's report (``BuildReport``'s fields), the
    target and the machine, as JSON (what ``docs``' "optimize-report" block renders)."""
    import dataclasses
    from pathlib import Path

    from ._files import write_json_atomic
    from .artifact import _jsonable
    from .tools.bench import machine

    doc = {"model": args.model, "target": str(args.target), "machine": machine(),
           **dataclasses.asdict(res.report)}
    write_json_atomic(Path(args.report), _jsonable(doc))
    print(f"report written to {args.report}")


def _shapes_text(ranges: dict, which: str) -> str:
    """The inputs' shapes at the ranges' ``which`` ("min", "opt", "max") as NAME=D1xD2."""
    k = ("min", "opt", "max").index(which)
    return ", ".join(f"{i['name']}=" + "x".join(
        str(d if isinstance(d, int) else ranges["axes"][d][k]) for d in i["dims"])
        for i in ranges["inputs"])


def _print_dynamic(rep) -> None:
    """A dynamic model's ranges and what serves each representative point."""
    d = rep.dynamic
    print(f"\ndynamic shapes: built for {d['described']}")
    print(f"  to change them: {d['flags']} (min:opt:max)")
    for name, why in d.get("skipped", {}).items():
        print(f"  {name} left out: {why}")
    source = "from the placement log: timed nothing" if d.get("from_log") else (
        f"timed side by side in {d['seconds']:.0f} s")
    print(f"  what serves each shape ({source}; a shape goes to the least point at or "
          "above it):")
    for p in d["points"]:
        point = ",".join(f"{s}={v}" for s, v in sorted(p["point"].items()))
        figures = ", ".join(f"{n} {v:.3f}" for n, v in sorted(p["ms"].items(),
                                                              key=lambda kv: kv[1]))
        print(f"    {point:<28} {p['chose']:<14}" + (f" ({figures} ms)" if figures else ""))
        for n, why in p.get("left_out", {}).items():
            print(f"      {n} left out: {why}")
    if d.get("special"):
        print(f"  Collage's placement ({d['static_shipped']}) serves exactly the optimum")
    print(f"shipped: {rep.shipped}")


def _export(res, args) -> None:
    """``optimize --export DIR``: the build saved with the ONNX file's input and output
    names (``collage_tvm.save``)."""
    import onnx

    from .artifact import save

    proto = onnx.load(args.model, load_external_data=False)
    weights = {t.name for t in proto.graph.initializer}
    path = save(res, args.export,
                input_names=[i.name for i in proto.graph.input if i.name not in weights],
                output_names=[o.name for o in proto.graph.output])
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"\nexported to {path} ({size / 2**20:.1f} MiB): run it with `collage-tvm run "
          f"{path} --inputs X.npz`, or collage_tvm.load({str(path)!r}) in Python")


def _report(args, res, t0) -> int:
    """What ``optimize`` prints about its search and build; the exit code."""
    rep = res.report
    _print_search(rep)
    print(f"\ncollage: {rep.summary()}; took {time.perf_counter() - t0:.1f} s "
          f"({', '.join(f'{k} {v:.1f} s' for k, v in rep.times.items())})")
    _print_conditions(rep)
    if rep.whole_model and not rep.whole_model.get("floor"):
        timed = rep.whole_model.get("timed") or {}
        print(f"TVM cannot import this model ({rep.whole_model['why']}): it runs wholly on "
              f"{rep.whole_model['backend']}"
              + (" (the fastest here: " + ", ".join(
                  f"{n} {ms:.3f} ms" for n, ms in sorted(timed.items(), key=lambda kv: kv[1]))
                 + ")" if timed else "") + ", no placement to search, write or show")
        return 0
    if rep.floor:
        print(f"  the model file was not run whole by a graph library: {rep.floor}")
    if res.graph is None and not rep.whole_model:
        print("the whole model was compiled by TVM alone: no placement to write or show")
        return 0
    if rep.whole_model:
        print(f"\nshipped: the model file run whole by {rep.whole_model['backend']} "
              f"({rep.whole_model['why']}); no placement of Collage's beat it"
              + (" (no placement to write to --output)" if args.output else ""))
    elif args.output:
        from .placement import placement_record

        with open(args.output, "w") as f:
            json.dump(placement_record(res.placement, res.graph, args.target, rep.comparison,
                                       rep.shipped, rep.graph_level),
                      f, indent=1)
        print(f"placement written to {args.output}")
    if res.graph is not None:
        _print_ops(res)
    return _print_comparison(rep) if rep.comparison else 0


def _print_search(rep) -> None:
    """The op level's close calls and switching costs, the rewrites, the graph level."""
    if rep.close_calls:
        print(f"close calls of the op-level DP: {rep.close_calls} alternative covers within 75% "
              f"({rep.side_by_side} sets re-timed side by side in this run)")
    if rep.switch:
        print("switching cost between runtimes (ms per change): " + ", ".join(
            f"{a}<->{b} {v:.3f}" for (a, b), v in sorted(rep.switch.items())))
    rw = rep.rewrite
    if rw:
        folded = "affine tails folded into convolutions; " if rw["folded_affine_tails"] else ""
        print(f"rewrite: {folded}{len(rw['applied'])} rewrite(s) applied "
              f"({', '.join(rw['applied']) or 'none paid'}); op-level estimate "
              f"{rw['start_ms']:.3f} -> {rw['best_ms']:.3f} ms; {rw['graphs']} graphs costed"
              + (f" over {len(rw['pieces'])} pieces (largest {max(rw['pieces'])} bindings)"
                 if len(rw.get("pieces", ())) > 1 else "")
              + f", stopped: {rw['stopped']}")
    gl = rep.graph_level
    if gl.get("history"):
        print(f"graph-level: {gl['eligible_groups']} groups could move to "
              f"{'/'.join(gl['libraries'])}; op-level {gl['seed_ms']:.3f} ms -> best "
              f"{gl['best_ms']:.3f} ms; {gl['evaluated']} placements measured "
              f"({gl['invalid']} invalid)"
              + (f", {gl['bounded']} not built (their library calls' overheads alone lose)"
                 if gl.get("bounded") else "") + f"; stopped by {gl['stopped']}")
        for reason in gl.get("invalid_reasons", [])[:3]:
            print(f"  invalid: {reason}")
    elif gl.get("skipped"):
        print(f"graph-level: skipped: {gl['skipped']}")


def _print_conditions(rep) -> None:
    """Tuning records, the accuracy budget, backends skipped, failures, operators kept on
    TVM."""
    if rep.tuning:
        print(f"  TVM's kernels built with {rep.tuning['records']} tuning records from "
              f"{rep.tuning['path']} (--no-tuning builds them untuned)")
    if rep.precision:
        print(f"  accuracy budget {rep.precision['accuracy']}: " + ", ".join(
            why if p == "why" else f"{p} {why}"
            for p, why in rep.precision.items() if p != "accuracy"))
    for name, why in rep.skipped.items():
        print(f"  backend {name} skipped: {why}")
    for backend, label, reason in rep.failures[:10]:
        print(f"  {backend} {label}: {reason}")
    if rep.kept_on_tvm:
        print(f"  kept on TVM (nothing else could run or time them): "
              f"{', '.join(sorted(set(rep.kept_on_tvm)))}")


def _print_comparison(rep) -> int:
    """The final check's table and verdict; the exit code (1 when the shipped build's
    outputs do not match the reference)."""
    from .measure.timing import BUSY_SHARE

    print(f"\n{'build':<26}{'latency ms':>12}{'vs collage':>12}  matches the reference")
    base = rep.comparison.get("collage", {}).get("ms", math.nan)
    for name, r in rep.comparison.items():
        _print_build(name, r, base, bool(rep.precision))
    shipped = rep.dynamic.get("static_shipped") or rep.shipped  # (a dynamic model: at the opt)
    if shipped != "collage":
        print(f"shipped: {shipped} (faster than the collage placement in this run)")
    if rep.other_load > BUSY_SHARE:
        print(f"unsure: other processes took {100 * rep.other_load:.0f}% of the CPU while "
              "these were timed; the next build of this model times them again")
    elif rep.rechecked:
        print("the placement log's earlier verdict (timed beside other work) was checked "
              "again here")
    for name, r in rep.comparison.items():
        if r.get("advice"):
            print(f"faster at a looser precision: {name}, {r['advice']}")
    return 0 if all(r["match"] for n, r in rep.comparison.items()
                    if n in ("collage", shipped)) else 1


def _print_build(name: str, r: dict, base: float, budget: bool) -> None:
    """One row of the final check's table (``budget``: a budget other than strict f32, so
    the error relative to the scale is shown)."""
    from .measure.cuda_graph import note

    if r.get("error"):
        print(f"{name:<26}{'not built' if r.get('skipped') else 'failed':>12}{'':>12}"
              f"  {r['error']}")
        return
    same = f"  (same placement as {r['same_as']})" if r.get("same_as") else ""
    same += "  (timed once: >10x slower)" if r.get("timed_once") else ""
    same += note(r.get("cuda_graph"))
    rel = f", {r['rel_err']:.1e} of the scale" if "rel_err" in r and budget else ""
    if math.isnan(r["ms"]):  # checked for accuracy, not timed (no --compare)
        print(f"{name:<26}{'not timed':>12}{'':>12}  {'yes' if r['match'] else 'NO'} "
              f"(max err {r['max_err']:.2e}{rel})")
        return
    if r.get("outside_budget"):
        same += f"  (outside the budget: {r['outside_budget']}, not shipped)"
    if r.get("lost_to"):  # memory was short: freed after losing side by side, not shippable
        same += f"  (memory short: lost to {r['lost_to']} side by side, freed)"
    if r.get("set_aside"):
        same += "  (memory short: set aside, timed before the next builds)"
    if r.get("ops") and name.startswith("collage"):  # what the searched ones place where
        same += "  [" + ", ".join(f"{b} {n} ops" for b, n in sorted(r["ops"].items())) + "]"
    print(f"{name:<26}{r['ms']:>12.3f}{r['ms'] / base:>11.2f}x  "
          f"{'yes' if r['match'] else 'NO'} (max err {r['max_err']:.2e}{rel}){same}")


def _run(args) -> int:
    """``collage-tvm run DIR``: load a saved build, run it on --inputs (or random inputs of
    its shapes), write --output, and with --bench N print latency percentiles."""
    import numpy as np

    from .artifact import ArtifactError, load

    try:
        module = load(args.artifact, decide=args.decide)
    except ArtifactError as err:
        print(f"collage-tvm: error: {err}", file=sys.stderr)
        return 2
    print(f"loaded {args.artifact} in {module.load_seconds * 1e3:.0f} ms: {module!r}")
    if module.decided:
        print("  " + decided_text(module.decided))
    try:
        arrays = _run_inputs(args.inputs, module)
        outputs = module(*arrays)
    except (ValueError, TypeError, OSError) as err:
        print(f"collage-tvm: error: {err}", file=sys.stderr)
        return 2
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for name, out in zip(module.output_names, outputs):
        print(f"  output {name}: {out.dtype}{list(out.shape)}")
    if args.output:
        np.savez(args.output, **dict(zip(module.output_names, outputs)))
        print(f"outputs written to {args.output}")
    if args.bench and module.dispatch is not None and args.inputs is None:
        for point in module.dispatch.ranges.points():
            arrays = _point_inputs(module, point)
            served = module.dispatch.label_for([a.shape for a in arrays])
            print(f"shape {','.join(f'{s}={v}' for s, v in sorted(point.items()))} "
                  f"(served by {served}): ", end="")
            _time_loaded(module, arrays, args)
        return 0
    if args.bench:
        _time_loaded(module, arrays, args)
    return 0


def _point_inputs(module, point: dict) -> list:
    """Random inputs (seed 0) of a dynamic build at ``point`` (symbol -> size)."""
    from .dynamic.search import point_inputs

    return point_inputs(module.dispatch.ranges, point)


def _time_loaded(module, arrays, args) -> None:
    """``run --bench N``: N timed runs of the loaded build on ``arrays`` after warm-up,
    printed as percentiles."""
    import numpy as np

    tensors = [module.to_device(a, s) for a, s in zip(arrays, module.inputs)]
    sync = module.device.sync if module.manifest.get("device") == "cuda" else None
    warmup = args.warmup if args.warmup is not None else max(3, args.bench // 10)
    for _ in range(warmup):
        module.run_tvm(tensors)
    if sync:
        sync()
    times = []
    for _ in range(args.bench):
        t = time.perf_counter()
        module.run_tvm(tensors)
        if sync:
            sync()
        times.append((time.perf_counter() - t) * 1e3)
    p50, p90, p99 = np.percentile(times, [50, 90, 99])
    print(f"latency over {args.bench} runs after {warmup} warm-up: p50 {p50:.3f} ms, "
          f"p90 {p90:.3f} ms, p99 {p99:.3f} ms (mean {np.mean(times):.3f} ms)")


def decided_text(d: dict) -> str:
    """One line on the close call ``load`` timed (``LoadedModule.decided``)."""
    figures = ", ".join(f"{n} {ms:.3f} ms" for n, ms in d["ms"].items()) or "nothing timed"
    text = (f"close call timed at load ({figures}; {d['rounds']} rounds, {d['seconds']:.1f} s):"
            f" runs on {d['chose']}" + (" (the search's choice)" if d["chose"] == d["shipped"]
                                        else f", not {d['shipped']} as the search had it"))
    if d.get("left_out"):
        text += "; left out: " + "; ".join(f"{n}: {why}" for n, why in d["left_out"].items())
    return text


def _run_inputs(path, module) -> list:
    """The arrays of ``run --inputs FILE`` in the module's input order: an .npz keyed by input
    name (or arr_0, arr_1, ... as numpy.savez names positional arrays), one .npy for a
    one-input model; no file: random inputs of the saved shapes (seed 0)."""
    import numpy as np

    names = module.input_names
    if path is None and module.dispatch is not None:
        print("no --inputs: random inputs at the optimum of the ranges")
        return _point_inputs(module, module.dispatch.ranges.opt())
    if path is None:
        rng = np.random.default_rng(0)
        print("no --inputs: random inputs of the saved shapes")
        arrays = []
        for spec in module.inputs:
            shape = [d if isinstance(d, int) else 1 for d in spec.get("shape") or []]
            dtype = np.dtype(spec.get("dtype", "float32"))
            arrays.append(rng.standard_normal(shape).astype(dtype) if dtype.kind == "f"
                          else np.zeros(shape, dtype))
        return arrays
    from .frontend.load import read_inputs

    return read_inputs(path, names)


LEAN_HELP = ("measure only the candidates the op-level DP can still choose (default): the "
             "single heavy operators on each library first, then what the DP picks on floors "
             "from those and from each backend's best measured rates, until the measured "
             "cover is within 30%% of the floors' bound (placer.lean); --no-lean: measure "
             "every candidate, as the paper does")


def _options(args, backends):
    """The ``SearchOptions`` of the search flags ``optimize`` and ``bench`` share."""
    from .options import SearchOptions

    return SearchOptions(backends=tuple(backends), isolate=not args.in_process,
                         compare=not args.no_compare, graph_level=args.graph_level,
                         budget=args.budget, switching=not args.no_switching,
                         calibrate_rounds=args.calibrate, refine_rounds=args.refine,
                         rewrite=args.rewrite, tuning=not args.no_tuning,
                         accuracy=args.accuracy, build_jobs=args.build_jobs,
                         lean=getattr(args, "lean", True),
                         rpc_tracker=getattr(args, "rpc_tracker", "") or "",
                         rpc_key=getattr(args, "rpc_key", "") or "",
                         shapes=tuple(getattr(args, "shapes", None) or ()))


def _tune(args) -> int:
    from .frontend.load import parse_input_shapes
    from .tuning.plan import tune

    backends = [b for b in args.backends.split(",") if b]

    def on_kernel(r):
        if r.status in ("tuned", "failed"):
            print(f"  {r.name}: {r.status}, untuned {r.untuned_ms:.3f} ms -> tuned "
                  f"{r.tuned_ms:.3f} ms (best library {r.best_library_ms:.3f} ms), "
                  f"{r.trials} trials, {r.seconds:.0f} s{' ' + r.reason if r.reason else ''}",
                  flush=True)

    print(f"tuning {args.model}: budget {args.budget:.0f} s, at most {args.trials} trials a "
          f"kernel; the costs of {', '.join(backends)} decide which kernels", flush=True)
    rep = tune(args.model, args.target, backends, db=args.db, tuning_db=args.tuning_db,
               budget=args.budget, trials=args.trials,
               input_shapes=parse_input_shapes(args.input_shape), progress=True,
               isolate=not args.in_process, on_kernel=on_kernel, rewrite=args.rewrite)
    print("\n" + rep.markdown())
    print(f"collage tune: {rep.summary()}; took {rep.times.get('total', 0):.0f} s ("
          + ", ".join(f"{k} {v:.0f} s" for k, v in rep.times.items() if k != "total") + ")")
    return 0


def _print_ops(res) -> None:
    print("\noperators per backend:")
    counts: dict = {}
    for g in res.placement.groups:
        for i in g.nodes:
            op = res.graph.nodes[i].op_name.replace("relax.", "")
            counts.setdefault(g.backend, {}).setdefault(op, 0)
            counts[g.backend][op] += 1
    width = max((len(b) for b in counts), default=8)
    for backend, ops in sorted(counts.items()):
        kernels = sum(1 for g in res.placement.groups if g.backend == backend)
        detail = ", ".join(f"{op} x{n}" for op, n in sorted(ops.items(), key=lambda x: -x[1]))
        print(f"  {backend:<{width}} {sum(ops.values()):>4} ops in {kernels:>4} kernels: {detail}")


def _tuning_stats(db_path) -> list:
    """Every tuning database next to the cost DB (one per target): workloads, records."""
    import os

    import tvm

    from .tuning import TuningDB, tuning_root

    base = tuning_root(db_path)
    out = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        path = os.path.join(base, name)
        try:
            with open(os.path.join(path, "meta.json")) as f:
                meta = json.load(f)
            db = TuningDB(path, tvm.target.Target(json.loads(meta["target"])))
            out.append({**db.stats(), "device": meta.get("device", "")})
        except (OSError, ValueError, KeyError) as err:
            out.append({"path": path, "error": str(err)})
    return out


def _db(args) -> int:
    from .measure.db import CostDB

    db = CostDB(args.db)
    if args.action == "stats":
        stats = db.stats()
        stats["tuning"] = _tuning_stats(args.db)
        print(json.dumps(stats, indent=1))
    elif args.action == "export":
        print(f"exported {db.export_json(args.file)} records to {args.file}")
    elif args.action == "import":
        print(f"imported {db.import_json(args.file)} records from {args.file}")
    elif args.action == "forget":
        try:
            n = db.forget(args.backend, args.kind, args.label)
        except ValueError as err:
            print(f"collage-tvm: error: db {err}", file=sys.stderr)
            return 2
        print(f"forgot {n} records of {db.path}: the next search measures them again")
    elif args.action == "show":
        for r in sorted(db.rows(), key=lambda r: (r["backend"], r["cost_ms"]))[: args.limit]:
            cost = "inf" if math.isinf(r["cost_ms"]) else f"{r['cost_ms']:.4f}"
            print(f"{r['backend']:<8} {cost:>10} ms  {r['extra'].get('label', '')}  "
                  f"{r['reason'] or ''}")
    return 0


def _bench(args, parser) -> int:
    from .options import SearchOptions
    from .tools import bench, zoo

    if args.suite:
        return _bench_suite(args)
    if args.torch_compile:
        from .tools import torch_compile

        names = args.models or list(torch_compile.MODELS)
        unknown = [m for m in names if m not in torch_compile.MODELS]
        if unknown:
            parser.error(f"--torch-compile: unknown model(s) {', '.join(unknown)}; known: "
                         f"{', '.join(torch_compile.MODELS)}")
        path = torch_compile.run(names, args.out, db=args.db, options={
            "backends": [b for b in args.backends.split(",") if b],
            "graph_level": args.graph_level, "budget": args.budget})
        print(f"\nwritten: {path}")
        return 0
    models = zoo.names() if args.all else args.models
    if not models:
        parser.error("name the models to run, --all, or --suite")
    unknown = [m for m in models if m not in bench.known_models()]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; "
                     f"known: {', '.join(bench.known_models())}")
    options = SearchOptions(backends=args.backends, graph_level=args.graph_level,
                            budget=args.budget, accuracy=args.accuracy,
                            build_jobs=args.build_jobs, lean=args.lean)
    if args.target != "llvm":
        from .target import make_target

        try:
            target = make_target(args.target)
        except ValueError as err:
            parser.error(str(err))
        if target.kind.name == "cuda" and (args.tune or args.ablation or args.rewrite
                                           or args.accuracy != "f32"):
            parser.error("bench --target cuda: --tune, --ablation, --rewrite and --accuracy "
                         "are CPU only for now")
    results = bench.run(models, args.out, db=args.db, options=options, size=args.size,
                        ablation=args.ablation, rewrite=args.rewrite, tune=args.tune,
                        target=args.target, deploy=args.deploy)
    print("\n" + bench.markdown(results))
    print(f"\nwritten: {', '.join(f'{args.out}/{w}' for w in results['files'])}")
    return 0


def _bench_dynamic(args, backends) -> int:
    """``bench --suite NAME --dynamic``: ``tools.dynamic_suite``; suite_<name>_dynamic.json
    {"suite", "dynamic", "machine", "accuracy", "rows", "summary"} and its table (.md)."""
    import json
    import os
    from pathlib import Path

    from ._files import write_json_atomic
    from .build import DEFAULT_DB
    from .tools import dynamic_suite
    from .tools.bench import machine

    if args.suite not in dynamic_suite.DYNAMIC_SUITES:
        print(f"collage-tvm: error: --dynamic takes --suite "
              f"{' or '.join(dynamic_suite.DYNAMIC_SUITES)}, not {args.suite}", file=sys.stderr)
        return 2
    from .options import SearchOptions

    # optimize's defaults, as a user runs it with no flags (the backends and budget as given)
    options = SearchOptions(backends=tuple(backends), graph_level=args.graph_level,
                            budget=args.budget, accuracy=args.accuracy,
                            build_jobs=args.build_jobs, lean=args.lean)
    name = f"suite_{args.suite}_dynamic" + ("" if options.accuracy.strict
                                             else f"_{options.accuracy.name}")
    base = os.path.join(args.out, name)
    os.makedirs(args.out, exist_ok=True)
    here = machine()

    def save(rows):
        write_json_atomic(Path(base + ".json"), {
            "suite": args.suite, "dynamic": True, "machine": here,
            "accuracy": options.accuracy.name, "rows": rows,
            "summary": dynamic_suite.summary(rows)})
        Path(base + ".md").write_text(dynamic_suite.markdown(args.suite, rows, here))

    names = list(args.models or dynamic_suite.DYNAMIC_SUITES[args.suite])
    kept = []
    if args.resume and os.path.exists(base + ".json"):  # as the other suites: --again reruns
        with open(base + ".json") as f:
            kept = [r for r in json.load(f)["rows"]
                    if not (args.again and r.get("model") in names)]
        names = [n for n in names if n not in {r.get("model") for r in kept}]
        print(f"resuming: {len({r['model'] for r in kept})} model(s) of {base}.json kept",
              flush=True)
    rows = kept + dynamic_suite.run(args.suite, names, args.out, options,
                                    args.db or DEFAULT_DB, on_row=lambda r: save(kept + r),
                                    log=lambda line: print(line, flush=True))
    save(rows)
    print(f"\nwrote {base}.json and {base}.md")
    return 0


def _bench_suite(args) -> int:
    """``bench --suite``: models nobody here wrote; a table per suite (docs/COVERAGE.md).
    suite_<name>.json (suite_<name>_<budget>.json under a reduced ``--accuracy``): {"suite",
    "machine", "input_size", "accuracy", "rows"} (the tables are rendered
    from it: ``suites.markdown(suite, rows, machine)``)."""
    import json
    import os
    from pathlib import Path

    from ._files import write_json_atomic
    from .build import DEFAULT_DB
    from .precision import parse_accuracy
    from .tools import suites
    from .tools.bench import machine

    backends = [b for b in args.backends.split(",") if b]
    if getattr(args, "dynamic", False):
        return _bench_dynamic(args, backends)
    try:
        budget = parse_accuracy(args.accuracy)  # a bad budget: before any model runs
    except ValueError as err:
        print(f"collage-tvm: error: {err}", file=sys.stderr)
        return 2
    # A reduced budget's rows go to their own file (suite_timm_bf16.json): never mixed with
    # the f32 rows of the same suite.
    base = os.path.join(args.out, f"suite_{args.suite}"
                        + ("" if budget.strict else f"_{budget.name}"))
    done = None
    if args.resume and os.path.exists(base + ".json"):
        with open(base + ".json") as f:
            done = json.load(f)
        done = done["rows"] if isinstance(done, dict) else done  # a list: before the machine
        # A torch model's row at another input size is run again at this one (a row without
        # one is from before input sizes: the small ones).
        unsized = "small" if args.suite in suites.TORCH_SUITES else args.input_size
        done = [r for r in done if r.get("input_size", unsized) == args.input_size]
        if args.again and args.models:  # the named models run again, the others kept
            done = [r for r in done if r.get("model") not in set(args.models)]
        print(f"resuming: {len(done)} model(s) of {base}.json kept", flush=True)
    here = machine()

    def save(rows):
        write_json_atomic(Path(base + ".json"), {"suite": args.suite, "machine": here,
                                                 "input_size": args.input_size,
                                                 "accuracy": budget.name, "rows": rows})
        with open(base + ".md", "w") as f:
            f.write(suites.markdown(args.suite, rows, here))

    print(f"== suite {args.suite} ({', '.join(backends)})", flush=True)
    rows = suites.run(args.suite, backends, args.db or DEFAULT_DB, args.out, full=args.full,
                      limit=args.limit, log=lambda line: print(line, flush=True),
                      only=args.models or None, done=done, on_row=save,
                      graph_level=args.graph_level, budget=min(args.budget, 120.0),
                      input_size=args.input_size, frameworks=not args.no_frameworks,
                      accuracy=budget.name)
    save(rows)
    table = suites.markdown(args.suite, rows, here)
    print("\n" + table + f"\nwritten: {base}.json, {base}.md")
    return 0


def _show(args) -> int:
    from pathlib import Path

    from .tools import MissingPlotExtra
    from .tools.show import load_record, render

    out = args.output or str(Path(args.placement).with_suffix(".svg"))
    try:
        print(render(load_record(args.placement), out))
    except (ValueError, OSError, MissingPlotExtra) as err:  # MissingPlotExtra: .png, no plot extra
        print(f"collage-tvm: error: {err}", file=sys.stderr)
        return 2
    return 0


ACCURACY_HELP = ("accuracy budget: f32 (default: strict, every candidate f32), bf16 (bf16 "
                 "variants of the named libraries too, e.g. openvino_bf16, where the CPU has "
                 "bf16 instructions; the build's error within 2e-2 of the output scale, checked "
                 "against f32 on random inputs) or a tolerance such as 0.05 (bf16 allowed from "
                 "1e-2)")
BUILD_JOBS_HELP = ("processes that build the TVM candidates before they are timed (default: "
                   "one per core on a GPU target or a CPU of 8 cores and more, else 0: each "
                   "is built where it is timed)")


def _jobs(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number of processes >= 0, got {text!r}")
    return n


def _optimize_parser(sub) -> None:
    """The ``optimize`` verb: search a placement for a model and build it."""
    from .options import DEFAULT_BUDGET

    o = sub.add_parser("optimize", help="search a placement for a model and build it")
    o.add_argument("model", help="an .onnx file")
    o.add_argument("--target", default="llvm",
                   help="llvm (this CPU, default), cuda (this machine's GPU) or cuda:sm_90")
    o.add_argument("--backends", default="",
                   help="comma-separated (default: every backend for the target that loads "
                        "here); built in: tvm, dnnl, mkl, onnxruntime, openvino; on a cuda "
                        "target: tvm, cudnn, cublas, inductor (tensorrt: patterns only, not "
                        "runnable here)")
    o.add_argument("--db", default=None, help="cost DB path (default ~/.cache/collage-tvm/costs.db)")
    o.add_argument("--patterns", action="append", help="extra pattern file (repeatable)")
    o.add_argument("--input-shape", action="append", metavar="NAME=D1xD2x...",
                   help="one static shape of an input with dynamic dimensions (batch, "
                        "sequence), e.g. input=1x3x224x224 (repeatable): the build serves "
                        "that shape alone")
    o.add_argument("--report", metavar="FILE.json",
                   help="also write the build's report as JSON: what ran where, the final "
                        "check's table, the search's figures, the machine")
    o.add_argument("--shapes", action="append", metavar="NAME=MIN:OPT:MAX",
                   help="the range of shapes an input with dynamic dimensions is built for, "
                        "as TensorRT's profiles: e.g. input_ids=1x1:1x128:8x512 (searched at "
                        "OPT, served from MIN to MAX; repeatable). Default: read from the "
                        "model (batch 1..8 around 1; a sequence 1..its positions around 128)")
    o.add_argument("--inputs", metavar="FILE.npz",
                   help="example inputs (an .npz keyed by input name, or one .npy): every "
                        "build is checked and timed on them first; for a model whose inputs "
                        "shape the computation (a slice's bounds, a range's limits)")
    o.add_argument("--output", "-o", help="write the placement JSON here")
    o.add_argument("--export", metavar="DIR",
                   help="save the build as a directory that `collage-tvm run DIR` or "
                        "collage_tvm.load(DIR) runs in another process without searching "
                        "(TVM's kernels, each library's region, a manifest)")
    o.add_argument("--no-compare", action="store_true",
                   help="skip the never-slower check (the placement timed end to end beside "
                        "every single-backend build and the model file run whole by each "
                        "graph library; the fastest correct one ships)")
    o.add_argument("--graph-level", action=argparse.BooleanOptionalAction, default=True,
                   help="after the op-level DP, run the evolutionary graph-level placer over the "
                        "graph libraries among --backends (onnxruntime, openvino); on by "
                        "default, --no-graph-level turns it off")
    o.add_argument("--lean", action=argparse.BooleanOptionalAction, default=True,
                   help=LEAN_HELP)
    o.add_argument("--rewrite", action="store_true",
                   help="before placement, apply the z3-verified graph rewrites "
                        "(collage_tvm.rewrite): a convolution's per-channel affine tail (e.g. "
                        "a batch norm) folded into its weights, then a cost-based search over "
                        "sibling convolution/matmul merges, convolutions split over a concat "
                        "and the generator's proved add/mul/matmul/transpose/relu "
                        "substitutions, each graph costed on --backends")
    o.add_argument("--calibrate", type=int, default=4, metavar="ROUNDS",
                   help="rounds of in-context calibration of the op-level placement: run it, "
                        "re-cost each external group as timed in place, re-run the DP "
                        "(default 4; 0 turns it off)")
    o.add_argument("--refine", type=int, default=2, metavar="ROUNDS",
                   help="rounds of side-by-side re-timing of the op-level placement's close "
                        "calls (alternative covers within 75%% of the chosen one's measured "
                        "cost), each followed by a DP re-run (default 2; 0 turns it off)")
    o.add_argument("--no-switching", action="store_true",
                   help="op-level DP with the paper's additive cost (no measured cost of "
                        "changing runtime between consecutive kernels)")
    o.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help="time budget in seconds of the graph-level search and of the rewrite "
                        f"search, each (default {DEFAULT_BUDGET:.0f})")
    o.add_argument("--in-process", action="store_true",
                   help="measure in this process (faster start, no crash isolation)")
    o.add_argument("--accuracy", default="f32", metavar="BUDGET", help=ACCURACY_HELP)
    o.add_argument("--build-jobs", type=_jobs, default=None, metavar="N", help=BUILD_JOBS_HELP)
    o.add_argument("--rpc-tracker", default="", metavar="HOST:PORT",
                   help="measure the candidates on the TVM RPC servers registered at this "
                        "tracker under --rpc-key (each started with python -m "
                        "collage_tvm.measure.remote --tracker HOST:PORT --key KEY; "
                        "docs/GUIDE.md, \"Measuring on other machines\")")
    o.add_argument("--rpc-key", default="", metavar="KEY",
                   help="the servers' key at --rpc-tracker")
    o.add_argument("--no-tuning", action="store_true",
                   help="build TVM's kernels untuned, even where `collage-tvm tune` has "
                        "records for them")
    o.add_argument("-v", "--verbose", action="store_true")


def _tune_parser(sub) -> None:
    """The ``tune`` verb."""
    t = sub.add_parser("tune", help="tune (MetaSchedule) the TVM kernels a model's placement "
                                    "could use; later builds apply the records")
    t.add_argument("model", help="an .onnx file")
    t.add_argument("--target", default="llvm")
    t.add_argument("--backends", default="tvm,dnnl",
                   help="the backends optimize will use (default tvm,dnnl): their measured "
                        "costs decide which TVM kernels are worth tuning")
    t.add_argument("--budget", type=float, default=600.0,
                   help="seconds of tuning this model gets, earlier tunes of it included "
                        "(default 600: running the same command again tunes nothing; a "
                        "larger budget tunes more; measuring the candidates is not counted)")
    t.add_argument("--trials", type=int, default=64,
                   help="at most this many schedules measured per kernel (default 64)")
    t.add_argument("--db", default=None, help="cost DB path (default ~/.cache/collage-tvm/costs.db)")
    t.add_argument("--tuning-db", default=None,
                   help="tuning database directory (default: next to the cost DB, one per "
                        "target: <db>.tuning/<cpu>-<id>)")
    t.add_argument("--input-shape", action="append", metavar="NAME=D1xD2x...")
    t.add_argument("--in-process", action="store_true")
    t.add_argument("--rewrite", action="store_true",
                   help="tune the graph the verified rewrites give (as optimize --rewrite "
                        "places it)")
    t.add_argument("-v", "--verbose", action="store_true")


def _bench_parser(sub) -> None:
    """The ``bench`` verb."""
    from .options import DEFAULT_BUDGET

    b = sub.add_parser("bench", help="Collage beside the frameworks a user would run instead "
                       "(ONNX Runtime, OpenVINO f32 and default precision, PyTorch) and its "
                       "own single-backend builds, on zoo models or an external --suite")
    b.add_argument("models", nargs="*", help="model names: the zoo (collage_tvm.tools.zoo: bert, "
                   "dcgan, nasnet, resnet3d, resnext50, resnet50, inception_v3, squeezenet) "
                   "or resnet_small, bert_base, bert_small")
    b.add_argument("--all", action="store_true", help="every zoo model")
    _suite_arguments(b)
    b.add_argument("--size", choices=["small", "paper"], default="paper",
                   help="zoo model size (default paper)")
    b.add_argument("--backends", default="tvm,dnnl,mkl,onnxruntime,openvino",
                   help="(on --target cuda: e.g. tvm,cudnn,cublas)")
    b.add_argument("--target", default="llvm",
                   help="llvm (this CPU, default) or cuda (this machine's GPU: the "
                        "frameworks are PyTorch eager, torch.compile and torch.compile with "
                        "CUDA graphs on it; docs/GPU.md)")
    b.add_argument("--graph-level", action=argparse.BooleanOptionalAction, default=True,
                   help="the two-level search, as optimize runs it by default "
                        "(--no-graph-level: the op level alone)")
    b.add_argument("--budget", type=float, default=DEFAULT_BUDGET,
                   help="seconds of graph-level search and of rewrite search, each (default "
                        f"{DEFAULT_BUDGET:.0f}; a suite gives each model at most 120)")
    b.add_argument("--db", default=None)
    b.add_argument("--lean", action=argparse.BooleanOptionalAction, default=True,
                   help=LEAN_HELP)
    b.add_argument("--rewrite", action="store_true",
                   help="also Collage placed-only beside rewritten+placed (the z3-verified "
                        "graph rewrites, collage_tvm.rewrite), timed interleaved, outputs "
                        "checked against placed-only")
    b.add_argument("--accuracy", default="f32", metavar="BUDGET",
                   help=ACCURACY_HELP + "; with a torch --suite, the rows also judge Collage "
                   "against OpenVINO at its default precision and go to suite_<name>_<budget>"
                   ".json")
    b.add_argument("--build-jobs", type=_jobs, default=None, metavar="N", help=BUILD_JOBS_HELP)
    b.add_argument("--deploy", action="store_true",
                   help="also save each shipped build (collage_tvm.save), load it in a fresh "
                        "process beside creating an ONNX Runtime session for the same file, "
                        "check its outputs against the in-process build's, and time both "
                        "interleaved (results.json: \"deploy\")")
    b.add_argument("--torch-compile", action="store_true",
                   help="instead of the zoo: torch.compile(model, backend=\"collage\") in a "
                        "fresh process (searching; a fresh cost DB unless --db), then again in "
                        "a second one (placement from the log), each checked against eager "
                        "and timed beside it; models: resnet18 (torchvision, 224x224), "
                        "bert_break (a 4-layer BERT-base-wide encoder, a graph break); "
                        "writes torch_compile.json")
    b.add_argument("--tune", type=float, default=0.0, metavar="SECONDS",
                   help="first tune each model's TVM kernels for SECONDS (collage-tvm tune; "
                        "a warm tuning DB makes it quick), then also time the search with "
                        "untuned TVM beside tuned TVM, interleaved, outputs checked")
    b.add_argument("--ablation", action="store_true",
                   help="also run Collage with --backends added one at a time in their order "
                        "(tvm; tvm,dnnl; ...: paper Fig. 11), the steps timed interleaved")
    b.add_argument("--out", default="bench-out",
                   help="folder for results.json / results.md / results.png (the plots need "
                        "matplotlib: pip install 'collage-tvm[plot]')")
    b.add_argument("-v", "--verbose", action="store_true")


def _suite_arguments(b) -> None:
    """``bench``'s arguments of an external ``--suite`` run."""
    from .tools.suites import SUITES

    b.add_argument("--suite", choices=SUITES,
                   help="an external model suite instead of zoo models: the onnx wheel's "
                        "backend test models (node tests; pytorch-converted, pytorch-operator "
                        "and simple files), transformers models built from configs, every "
                        "torchvision classification, segmentation or video model, or 57 timm "
                        "architectures; writes suite_<name>.json/.md. A torch suite's model is "
                        "exported to ONNX, searched, and its shipped Collage build timed "
                        "interleaved in one process beside that ONNX file on ONNX Runtime, on "
                        "OpenVINO at f32 and at its default precision (bf16 on CPUs with bf16 "
                        "instructions) and PyTorch eager, all at one thread per core, each "
                        "checked against PyTorch's outputs; the table gives Collage against "
                        "the best correct f32 framework. Model names given: only those of the "
                        "suite")
    b.add_argument("--input-size", choices=["usual", "small"], default="usual",
                   help="with a torch --suite: usual (default: what a user runs, e.g. "
                        "ImageNet classifiers at 224x224 or their weights' own size, timm at "
                        "its default_cfg input size, transformers at 128 tokens; segmentation "
                        "and video keep their small sizes) or small (quick: 64x64 images, 16 "
                        "tokens)")
    b.add_argument("--dynamic", action="store_true",
                   help="with --suite torchvision, timm or transformers: each model exported "
                        "with dynamic axes (batch; transformers: batch and sequence), built by "
                        "optimize with no flags, saved and loaded, and timed at batch 1, 4, 8 "
                        "(x sequence 8, 32, 128, 512) beside the same dynamic file on each "
                        "framework; writes suite_<name>_dynamic.json/.md")
    b.add_argument("--no-frameworks", action="store_true",
                   help="with a torch --suite: leave out the frameworks (coverage only)")
    b.add_argument("--full", action="store_true",
                   help="with an onnx suite: also the whole Collage search over --backends "
                        "on every case TVM alone runs")
    b.add_argument("--resume", action="store_true",
                   help="with --suite: keep the models an earlier run wrote to "
                        "--out/suite_<name>.json (it is rewritten after every model) and run "
                        "the rest")
    b.add_argument("--again", action="store_true",
                   help="with --suite --resume and model names: run the named models again "
                        "(their earlier rows replaced), keep the others' rows")
    b.add_argument("--limit", type=int, default=None,
                   help="with --suite: the first N models (--graph-level: both levels, at most "
                        "min(--budget, 120) s of graph-level search a model)")


def _run_parser(sub) -> None:
    """The ``run`` verb: a saved build loaded and run."""
    r = sub.add_parser("run", help="load a build saved with optimize --export (or "
                                   "collage_tvm.save) and run it, optionally timing it")
    r.add_argument("artifact", metavar="DIR", help="the directory optimize --export wrote")
    r.add_argument("--inputs", metavar="FILE.npz",
                   help="the inputs: an .npz keyed by input name (or arr_0, arr_1, ...), or "
                        "one .npy for a one-input model (default: random inputs of the saved "
                        "shapes)")
    r.add_argument("--output", "-o", metavar="FILE.npz",
                   help="write the outputs here, keyed by output name")
    r.add_argument("--bench", type=int, default=0, metavar="N",
                   help="then time N runs after warm-up and print the p50/p90/p99 latency")
    r.add_argument("--warmup", type=int, default=None, metavar="N",
                   help="warm-up runs before --bench (default max(3, N/10))")
    r.add_argument("--no-decide", dest="decide", action="store_false",
                   help="where the build holds two graph libraries that ran the model whole "
                        "within a few percent of each other, keep the search's choice rather "
                        "than timing both here at load (2-4 s)")


def _db_parser(sub) -> None:
    """The ``db`` verb."""
    d = sub.add_parser("db", help="inspect, export, import or forget records of the cost DB")
    d.add_argument("action", choices=["stats", "show", "export", "import", "forget"])
    d.add_argument("file", nargs="?")
    d.add_argument("--db", default=None)
    d.add_argument("--limit", type=int, default=50)
    d.add_argument("--backend", default=None, help="forget: only this backend's records")
    d.add_argument("--kind", default=None,
                   help="forget: failed, measured, or one kind of failure: timeout, memory, "
                        "crash (the measuring process died), cannot-run")
    d.add_argument("--label", default=None,
                   help="forget: only candidates whose label contains this (an operator)")


def _show_parser(sub) -> None:
    """The ``show`` verb."""
    s = sub.add_parser("show", help="draw a placement JSON: the dataflow graph coloured by "
                                    "backend, fused groups boxed")
    s.add_argument("placement", help="a placement JSON written by `collage-tvm optimize -o`")
    s.add_argument("--output", "-o", help="the picture: .svg, .html (hover for details) or .png "
                                          "(matplotlib: pip install 'collage-tvm[plot]'; "
                                          "default: the JSON's name with .svg)")


def _parser() -> argparse.ArgumentParser:
    """The ``collage-tvm`` command line: one sub-parser per verb."""
    p = argparse.ArgumentParser(prog="collage-tvm", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for add in (_optimize_parser, _tune_parser, _bench_parser, _run_parser, _db_parser,
                _show_parser):
        add(sub)
    return p


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "db":
        from .build import DEFAULT_DB

        args.db = args.db or DEFAULT_DB
        if args.action in ("export", "import") and not args.file:
            p.error(f"db {args.action} needs a FILE")
        return _db(args)
    if args.cmd == "bench":
        return _bench(args, p)
    if args.cmd == "show":
        return _show(args)
    if args.cmd == "run":
        return _run(args)
    from .artifact import ArtifactError

    try:
        return _tune(args) if args.cmd == "tune" else _optimize(args)
    except (ValueError, KeyError, FileNotFoundError, ArtifactError) as err:
        from .dynamic import ShapeError
        from .frontend.load import ModelError
        from .registry import PatternFileError

        if (isinstance(err, (ModelError, PatternFileError, ArtifactError, ShapeError))
                or args.verbose is False):
            print(f"collage-tvm: error: {err}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
