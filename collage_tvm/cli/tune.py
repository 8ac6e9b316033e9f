"""``collage-tvm tune``: TVM's kernels tuned (MetaSchedule) for later builds."""
from __future__ import annotations


def _tune(args) -> int:
    from ..frontend.load import parse_input_shapes
    from ..tuning.plan import tune

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
