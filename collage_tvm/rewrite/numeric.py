"""The numeric check of a substitution: source and target compiled with TVM and run on the
same random inputs, for every attribute case (TASO checks its axioms the same way)."""
from __future__ import annotations

import numpy as np


def run(func, inputs: list) -> list:
    """Compile the Relax function ``func`` for llvm and run it; its outputs as numpy."""
    import tvm
    from tvm import relax

    mod = tvm.IRModule({"main": func})
    vm = relax.VirtualMachine(tvm.compile(mod, "llvm"), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(i) for i in inputs])
    outs = list(out) if not hasattr(out, "numpy") else [out]
    return [o.numpy() for o in outs]


def check(sub, rtol: float = 1e-4, atol: float = 1e-5, seed: int = 0) -> list:
    """The cases of ``sub`` whose source and target differ: [(case, max abs error)]."""
    failures = []
    rng = np.random.default_rng(seed)
    for case in sub.cases:
        source, target = sub.relax(case)
        inputs = [rng.standard_normal([int(d) for d in p.ty.shape.values]).astype(str(p.ty.dtype))
                  for p in source.params]
        want, got = run(source, inputs), run(target, inputs)
        err = max(float(np.max(np.abs(a - b))) if a.shape == b.shape else float("inf")
                  for a, b in zip(want, got))
        if len(want) != len(got) or not all(
                a.shape == b.shape and np.allclose(a, b, rtol=rtol, atol=atol)
                for a, b in zip(want, got)):
            failures.append((case, err))
    return failures
