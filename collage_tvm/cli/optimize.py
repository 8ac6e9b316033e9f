"""``collage-tvm optimize``: the search and build, and what it prints of them (the
search's figures, the conditions it ran under, the final check's table, the operators per
backend, a dynamic model's ranges), the report JSON and the exported build."""
from __future__ import annotations

import json
import math
import time


def _optimize(args) -> int:
    from ..build import optimize
    from ..frontend.load import parse_input_shapes, read_example_inputs
    from ..registry import load_pattern_file

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
    if (res.report.precision or {}).get("int8"):
        _print_int8(res.report.precision["int8"])
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

    from .._files import write_json_atomic
    from ..artifact import _jsonable
    from ..tools.bench import machine

    doc = {"model": args.model, "target": str(args.target), "machine": machine(),
           **dataclasses.asdict(res.report)}
    write_json_atomic(Path(args.report), _jsonable(doc))
    print(f"report written to {args.report}")


def _shapes_text(ranges: dict, which: str) -> str:
    """The inputs' shapes at the ranges' ``which`` ("min", "opt", "max") as NAME=D1xD2."""
    from ..dynamic import ShapeRanges

    r = ShapeRanges.from_json(ranges)
    k = ("min", "opt", "max").index(which)
    point = {s: (a.min, a.opt, a.max)[k] for s, a in r.axes.items()}
    return ", ".join(f"{name}=" + "x".join(map(str, shape))
                     for name, shape in r.shapes(point).items())


def _print_int8(d: dict) -> None:
    """``--accuracy int8``: what was quantized, what stayed in float, the error of each
    build against the f32 model and which shipped."""
    print(f"\nint8 (budget {d['budget']:g} of the output scale; calibrated on "
          f"{d['calibration']}):")
    quantized = d.get("quantized") or {"int8": {
        "quantizer": "ONNX Runtime's quantize_static", "in_float": d["in_float"],
        "quantizable": d["quantizable"], "compute_only": d.get("compute_only"),
        "quantize_s": d["quantize_s"]}}
    for label, f in quantized.items():
        if "quantizable" not in f:
            continue
        print(f"  {label} ({f['quantizer']}, {f.get('quantize_s', 0):.0f} s): "
              f"{f['quantizable'] - len(f['in_float'])} of {f['quantizable']} operators int8"
              + (f"; in float: {', '.join(f['in_float'])}" if f["in_float"] else ""))
        if f.get("unpaid"):
            print(f"    {len(f['unpaid'])} in float because int8 ran them slower on "
                  f"{f.get('timed_on') or 'OpenVINO'}: {', '.join(f['unpaid'])}")
        if f.get("returned"):
            print(f"    {len(f['returned'])} more back in int8 (the costliest first, where the "
                  f"error ranking had left them in float): {', '.join(f['returned'])}")
        if f.get("compute_only"):
            print("    only convolutions and matrix products quantized: with every one of them "
                  "in float, the quantized operations between them still broke the budget")
    if d.get("why_no_int8"):
        print(f"  no int8 build: {d['why_no_int8']}")
    width = max((len(n) for n in d.get("error", {})), default=5)
    for label, err in d.get("error", {}).items():
        ms = d.get("ms", {}).get(label)
        print(f"  {label:<{width}} build: error {err:.2e} of the f32 model's output scale"
              + (f", {ms:.3f} ms" if ms is not None else ""))
    print(f"  shipped: the {d.get('chose', 'float')} build")


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
        print(f"    {point:<28} {p['chose']:<14}" + (
            f" ({figures} ms)" if figures else
            " (untimed: it led clearly at every corner of a box around it)" if p.get("inferred")
            else ""))
        for n, why in p.get("left_out", {}).items():
            print(f"      {n} left out: {why}")
    if d.get("special"):
        print(f"  Collage's placement ({d['static_shipped']}) serves exactly the optimum")
    expected = d.get("expected") or {}
    ms = expected.get("ms") or {}
    if "collage" in ms:
        others = ", ".join(f"{n} {v:.3f} ms ({v / ms['collage']:.2f}x)" for n, v in sorted(
            ms.items(), key=lambda kv: kv[1]) if n != "collage")
        print(f"  expected per call over {expected['over']}: {ms['collage']:.3f} ms"
              + (f"; each library alone: {others}" if others else ""))
    print(f"shipped: {rep.shipped}")


def _export(res, args) -> None:
    """``optimize --export DIR``: the build saved with the ONNX file's input and output
    names (``collage_tvm.save``)."""
    import onnx

    from ..artifact import save

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
    if rep.whole_model:
        timed = rep.whole_model.get("timed") or {}
        print(f"TVM cannot import this model ({rep.whole_model['why']}): it runs wholly on "
              f"{rep.whole_model['backend']}"
              + (" (the fastest here: " + ", ".join(
                  f"{n} {ms:.3f} ms" for n, ms in sorted(timed.items(), key=lambda kv: kv[1]))
                 + ")" if timed else "") + ", no placement to search, write or show")
        return 0
    if rep.no_floor:
        print(f"  the model file was not run whole by a graph library: {rep.no_floor}")
    if res.graph is None and not rep.shipped_floor:
        print("the whole model was compiled by TVM alone: no placement to write or show")
        return 0
    if rep.shipped_floor:
        why = ("the placement log's verdict" if rep.placement_from_log
               else "the fastest correct build")
        print(f"\nshipped: the model file run whole by {rep.shipped_floor} ({why}); no "
              "placement of Collage's beat it"
              + (" (no placement to write to --output)" if args.output else ""))
    elif args.output:
        from ..check.contender import records
        from ..placement import placement_record

        with open(args.output, "w") as f:
            json.dump(placement_record(res.placement, res.graph, args.target,
                                       records(rep.comparison),
                                       rep.shipped, rep.graph_level),
                      f, indent=1)
        print(f"placement written to {args.output}")
    if res.graph is not None:
        _print_ops(res)
    return _print_comparison(rep) if rep.comparison else 0


def _print_search(rep) -> None:
    """The op level's alternative covers and switch costs, the rewrites, the graph level."""
    if rep.alternative_covers:
        print(f"alternative covers of the op-level DP: {rep.alternative_covers} within 75% "
              f"({rep.side_by_side} sets re-timed side by side in this run)")
    if rep.switch_cost:
        print("switch cost between runtimes (ms per change): " + ", ".join(
            f"{a}<->{b} {v:.3f}" for (a, b), v in sorted(rep.switch_cost.items())))
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
    _print_schedule(rep)


def _print_schedule(rep) -> None:
    """The concurrent schedule's plan and whether its build shipped (``--schedule``)."""
    sc = rep.schedule
    if not sc:
        return
    line = f"schedule ({sc['mode']}): "
    if "groups" in sc:
        line += (f"{sc['branches']} of {sc['groups']} groups on branches, "
                 f"{len(sc['concurrent_stages'])} concurrent stage(s); branches in turn "
                 f"{sc['sequential_ms']:.3f} ms, as scheduled {sc['scheduled_ms']:.3f} ms "
                 f"(planned in {sc['seconds']:.1f} s)")
    if sc.get("why_not"):
        line += ("; " if "groups" in sc else "") + f"built in turn: {sc['why_not']}"
    elif "shipped" in sc:
        line += "; the concurrent build " + ("shipped" if sc["shipped"] else
                                             "was timed and did not ship")
    print(line)


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
    for name, why in rep.crashed.items():
        print(f"  {why}: no whole build, graph-level region or model file of {name} is run "
              "in this process")
    if rep.kept_on_tvm:
        print(f"  kept on TVM (nothing else could run or time them): "
              f"{', '.join(sorted(set(rep.kept_on_tvm)))}")


def _print_comparison(rep) -> int:
    """The final check's table and verdict; the exit code (1 when the shipped build's
    outputs do not match the reference)."""
    from ..measure.other_load import BUSY_SHARE

    print(f"\n{'build':<26}{'latency ms':>12}{'vs collage':>12}  matches the reference")
    base = getattr(rep.comparison.get("collage"), "ms", math.nan)
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
        if r.advice:
            print(f"faster at a looser precision: {name}, {r.advice}")
    return 0 if all(r.match for n, r in rep.comparison.items()
                    if n in ("collage", shipped)) else 1


def _print_build(name: str, r, base: float, budget: bool) -> None:
    """One row of the final check's table (``r``: its ``Contender``; ``budget``: a budget
    other than strict f32, so the error relative to the scale is shown)."""
    from ..check.contender import Fate
    from ..measure.cuda_graph import note

    if r.error:
        print(f"{name:<26}{'not built' if r.fate is Fate.NOT_BUILT else 'failed':>12}{'':>12}"
              f"  {r.error}")
        return
    same = f"  (same placement as {r.same_as})" if r.same_as else ""
    same += "  (timed once: >10x slower)" if r.timed_once else ""
    same += note(r.cuda_graph)
    rel = f", {r.rel_err:.1e} of the scale" if r.rel_err is not None and budget else ""
    if math.isnan(r.ms):  # checked for accuracy, not timed (no --compare)
        print(f"{name:<26}{'not timed':>12}{'':>12}  {'yes' if r.match else 'NO'} "
              f"(max err {r.max_err:.2e}{rel})")
        return
    if r.outside_budget:
        same += f"  (outside the budget: {r.outside_budget}, not shipped)"
    if r.fate is Fate.LOST:  # memory was short: freed after losing side by side
        same += f"  (memory short: lost to {r.detail} side by side, freed)"
    if r.fate is Fate.SET_ASIDE:
        same += "  (memory short: set aside, timed before the next builds)"
    if r.ops and name.startswith("collage"):  # what the searched ones place where
        same += "  [" + ", ".join(f"{b} {n} ops" for b, n in sorted(r.ops.items())) + "]"
    print(f"{name:<26}{r.ms:>12.3f}{r.ms / base:>11.2f}x  "
          f"{'yes' if r.match else 'NO'} (max err {r.max_err:.2e}{rel}){same}")


def _options(args, backends):
    """The ``SearchOptions`` of the search flags ``optimize`` and ``bench`` share."""
    from ..options import SearchOptions

    return SearchOptions(backends=tuple(backends), isolate=not args.in_process,
                         compare=not args.no_compare, graph_level=args.graph_level,
                         budget=args.budget, switching=not args.no_switching,
                         calibrate_rounds=args.calibrate, refine_rounds=args.refine,
                         rewrite=args.rewrite, tuning=not args.no_tuning,
                         accuracy=args.accuracy, build_jobs=args.build_jobs,
                         lean=getattr(args, "lean", True),
                         rpc_tracker=getattr(args, "rpc_tracker", "") or "",
                         rpc_key=getattr(args, "rpc_key", "") or "",
                         shapes=tuple(getattr(args, "shapes", None) or ()),
                         shape_weights=getattr(args, "shape_weights", None),
                         calibration_inputs=getattr(args, "calibration", None),
                         schedule=getattr(args, "schedule_mode", "auto"))


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
