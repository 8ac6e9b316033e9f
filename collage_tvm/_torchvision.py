"""``torchvision`` imported against the pinned CPU build of torch (the test suites' models;
onnx2torch, which the inductor backend uses, imports it too)."""
from __future__ import annotations

import glob
import os


def import_torchvision():
    """``torchvision``, imported against the pinned CPU build of torch.

    The PyPI wheel's C++ ops (``_C.so``: nms, roi_align, deformable convolution -- detection
    operators) link ``libtorch_cuda``, which a CPU torch lacks; torchvision then skips them,
    but registers fake kernels for ``nms`` and ``qnms`` without checking, and the import fails
    with ``operator torchvision::nms does not exist``. Declaring those two schemas first lets
    the pure-Python rest (every classification model) import; calling nms would still fail,
    as it does in that install anyway. Nothing is declared when the ops load."""
    import importlib.util
    import sys

    import torch

    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    spec = importlib.util.find_spec("torchvision")
    if spec is None:
        raise ImportError("torchvision is not installed (the test extra: pip install -e '.[test]')")
    so = glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so"))
    try:
        if so:
            torch.ops.load_library(so[0])
        ok = hasattr(torch.ops.torchvision, "nms")
    except (OSError, RuntimeError):
        ok = False
    if not ok:
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for op in ("nms", "qnms"):
            lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        _KEEP.append(lib)  # a Library object un-registers its definitions when collected
    import torchvision

    return torchvision


_KEEP: list = []
