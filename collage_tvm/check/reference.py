"""Which contender of the final check the others' outputs are checked against, and the
order the contenders are built in so that one is built early (``check.never_slower``)."""
from __future__ import annotations


def whole_library_builds(builds: dict) -> list:
    """The builds that run the whole model on one graph library (``baselines``: named
    after the library alone, every group on it)."""
    return [n for n, groups in builds.items() if groups and all(g.backend == n for g in groups)]


def reference(results: dict, builds: dict, floors: dict | None = None,
              quantized: bool = False) -> str:
    """The build whose outputs the others are checked against: tvm-only (or the build it is
    the same placement as: a model Collage places wholly on TVM kernels), or, where TVM
    alone failed to build or run (an operator TVM cannot compile that a library runs) or was
    not built (hopeless), the first whole-model graph-library build that ran, else the
    user's model file on a graph library at f32, else the first other single-backend build
    that ran. ``quantized`` (a model with its own int8 precision): the user's file run by
    ONNX Runtime, where it ran, whose tools wrote the QDQ nodes and whose run of the file
    is the one a quantized model is judged by (``tools.int8_suite``); TVM computes the
    quantized operators in float, and on timm's vit_tiny that landed 14% of the output
    scale from ONNX Runtime's run (OpenVINO 18%), so checked against TVM the placement
    failed and TVM alone, 30x slower, shipped."""
    if quantized:
        for name, floor in (floors or {}).items():
            if floor.backend == "onnxruntime" and floor.budget is None and name in results \
                    and results[name].error is None:
                return results[name].same_as or name
    tvm_only = results["tvm-only"]
    if tvm_only.error is None:
        return tvm_only.same_as or "tvm-only"
    for name in reference_order(builds, floors or {}):
        if name in results and results[name].error is None:
            return results[name].same_as or name
    raise RuntimeError(f"TVM alone cannot build this model ({tvm_only.error}) and no "
                       "other build ran to check the placement against")


def reference_order(builds: dict, floors: dict) -> list:
    """The builds other than tvm-only that can be the reference (``reference``), in the
    order one is taken: the whole-model graph-library builds, the user's model file on a
    graph library at f32, the other single-backend builds."""
    f32_files = [n for n, f in floors.items() if f.budget is None]
    others = [n for n in builds if n != "tvm-only" and not n.startswith("collage")
              and n not in floors]
    whole = whole_library_builds(builds)
    return whole + f32_files + [n for n in others if n not in whole]


def build_order(builds: dict, floors: dict) -> list:
    """The order the contenders are built in: collage (its time sets the cutoff), tvm-only,
    then the builds that can be the reference in the order one is taken
    (``reference_order``), then the rest. Where tvm-only is not built (hopeless) and memory
    is short, the builds held are checked against the reference before all but one are
    freed (``memory.narrow``): it must have been built by then (torchvision's vit_h_14 on
    24 GB: collage and its op-level placement held, the next build short of memory, and no
    reference built yet)."""
    first = ["collage", "tvm-only"] + reference_order(builds, floors)
    return first + [n for n in builds if n not in first]
