"""``collage-tvm bench``: Collage beside the frameworks, on zoo models, an external
``--suite`` (static or ``--dynamic``) or ``torch.compile``."""
from __future__ import annotations

import sys


def _bench(args, parser) -> int:
    from ..options import SearchOptions
    from ..tools import bench, zoo

    if args.suite:
        return _bench_suite(args)
    if args.torch_compile:
        from ..tools import torch_compile

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
        from ..target import make_target

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


def _bench_kind(args, backends, kind: str) -> int:
    """``bench --suite NAME --dynamic`` (``tools.dynamic_suite``), ``--int8``
    (``tools.int8_suite``) or ``--schedule`` (``tools.schedule_suite``):
    suite_<name>_<kind>.json {"suite", kind: True, "machine", "accuracy", "rows",
    "summary"} and its table (.md)."""
    import json
    import os
    from pathlib import Path

    from .._files import write_json_atomic
    from ..build import DEFAULT_DB
    from ..tools import dynamic_suite, int8_suite, schedule_suite
    from ..tools.bench import machine

    module, suites_of = {"dynamic": (dynamic_suite, dynamic_suite.DYNAMIC_SUITES),
                         "int8": (int8_suite, int8_suite.INT8_SUITES),
                         "schedule": (schedule_suite, schedule_suite.SCHEDULE_SUITES)}[kind]
    if args.suite not in suites_of:
        print(f"collage-tvm: error: --{kind} takes --suite "
              f"{' or '.join(suites_of)}, not {args.suite}", file=sys.stderr)
        return 2
    from ..options import SearchOptions

    # optimize's defaults, as a user runs it with no flags (the backends and budget as given)
    options = SearchOptions(backends=tuple(backends), graph_level=args.graph_level,
                            budget=args.budget, accuracy=args.accuracy,
                            build_jobs=args.build_jobs, lean=args.lean)
    name = f"suite_{args.suite}_{kind}" + ("" if options.accuracy.strict
                                          else f"_{options.accuracy.name.replace(':', '_')}")
    base = os.path.join(args.out, name)
    os.makedirs(args.out, exist_ok=True)
    here = machine()

    def save(rows):
        write_json_atomic(Path(base + ".json"), {
            "suite": args.suite, kind: True, "machine": here,
            "accuracy": options.accuracy.name, "rows": rows,
            "summary": module.summary(rows)})
        Path(base + ".md").write_text(module.markdown(args.suite, rows, here))

    names = list(args.models or suites_of[args.suite])
    kept = []
    if args.resume and os.path.exists(base + ".json"):  # as the other suites: --again reruns
        with open(base + ".json") as f:
            kept = [r for r in json.load(f)["rows"]
                    if not (args.again and r.get("model") in names)]
        names = [n for n in names if n not in {r.get("model") for r in kept}]
        print(f"resuming: {len({r['model'] for r in kept})} model(s) of {base}.json kept",
              flush=True)
    # (a dynamic suite searches each model from an empty DB of its own unless --db is given)
    db = args.db if kind == "dynamic" else args.db or DEFAULT_DB
    rows = kept + module.run(args.suite, names, args.out, options, db,
                             on_row=lambda r: save(kept + r),
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

    from .._files import write_json_atomic
    from ..build import DEFAULT_DB
    from ..precision import parse_accuracy
    from ..tools import suites
    from ..tools.bench import machine

    backends = [b for b in args.backends.split(",") if b]
    for kind in ("dynamic", "int8", "schedule"):
        if getattr(args, kind, False):
            return _bench_kind(args, backends, kind)
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
