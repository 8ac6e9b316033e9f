"""``collage-tvm run``: a saved build loaded, run on its inputs and timed."""
from __future__ import annotations

import sys
import time


def _run(args) -> int:
    """``collage-tvm run DIR``: load a saved build, run it on --inputs (or random inputs of
    its shapes), write --output, and with --bench N print latency percentiles."""
    import numpy as np

    from ..artifact import ArtifactError, load

    try:
        module = load(args.artifact, decide=args.decide)
    except ArtifactError as err:
        print(f"collage-tvm: error: {err}", file=sys.stderr)
        return 2
    print(f"loaded {args.artifact} in {module.load_seconds * 1e3:.0f} ms: {module!r}")
    try:
        arrays = _run_inputs(args.inputs, module)
        outputs = module(*arrays)
        if args.bench and module.race is not None:  # (its first calls decide: before timing)
            module.settle(*arrays)
    except (ValueError, TypeError, OSError) as err:
        print(f"collage-tvm: error: {err}", file=sys.stderr)
        return 2
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    for name, out in zip(module.output_names, outputs):
        print(f"  output {name}: {out.dtype}{list(out.shape)}")
    if args.output:
        np.savez(args.output, **dict(zip(module.output_names, outputs)))
        print(f"outputs written to {args.output}")
    if module.decided and module.decided["chose"]:
        print("  " + decided_text(module.decided))
    if args.bench and module.dispatch is not None and args.inputs is None:
        for point in module.dispatch.ranges.points():
            arrays = _point_inputs(module, point)
            module.settle(*arrays)
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
    from ..dynamic.search import point_inputs

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
    """One line on the race the first calls decided (``LoadedModule.decided``)."""
    figures = ", ".join(f"{n} {ms:.3f} ms" for n, ms in d["ms"].items()) or "nothing timed"
    text = (f"decided by the first {d['calls']} calls ({figures}; {d['rounds']} rounds, "
            f"{d['seconds']:.1f} s):"
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
    from ..frontend.load import read_inputs

    return read_inputs(path, names)
