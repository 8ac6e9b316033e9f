"""tensorrt backend: not runnable on any machine of this project, and it says why.

TensorRT's libraries are not on the package index: ``tensorrt-cu13-libs`` there is a stub
whose install downloads about 1 GB from NVIDIA's servers, which our machines cannot reach.
No engine builder is written against a library nobody here can run; ``available()`` names
which of the two stops it, and ``lower`` refuses with the same reason.

This module is the backend's lowering; ``patterns.py`` beside it is its pattern file.
"""
from __future__ import annotations

from collage_tvm.lowering import Lowering

_NOT_INSTALLABLE = ("TensorRT is not installed: its package on the index "
                    "(tensorrt-cu13-libs) is a stub that downloads the libraries from "
                    "NVIDIA at install time, which this machine cannot reach")


class TensorRTLowering(Lowering):
    name = "tensorrt"

    def available(self) -> tuple[bool, str]:
        try:
            import tensorrt
        except Exception:  # noqa: BLE001 - any import failure means "not here"
            return False, _NOT_INSTALLABLE
        return False, (f"TensorRT {getattr(tensorrt, '__version__', '?')} is installed, but "
                       "collage-tvm has no TensorRT engine builder yet (patterns only)")

    def version(self) -> str:
        try:
            import tensorrt

            return f"tensorrt-{tensorrt.__version__}"
        except Exception:  # noqa: BLE001
            return "tensorrt-unavailable"

    def lower(self, func):
        raise NotImplementedError(f"tensorrt: {self.available()[1]}")
