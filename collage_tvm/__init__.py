"""collage-tvm: automated integration of deep-learning backends (Collage) on TVM Relax."""
import os as _os

# A placement mixes runtimes that each keep a thread pool: TVM's, torch's OpenMP (dnnl,
# mkl), one per ONNX Runtime session, OpenVINO's TBB arena. On a few cores a pool that
# spins after its kernel starves the next runtime's threads: on 2 cores a dnnl+tvm build
# measured 0.92 ms alone and 145 ms after onnxruntime had run in the same process.
# TVM's workers therefore sleep at once (read when TVM's pool starts, so set it here,
# before any kernel runs); onnxruntime sessions disable spinning in backends/onnxruntime.py.
# docs/BENCHMARKS.md ("Thread pools") has the measurements. A user's own setting wins.
_os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")

from .build import build, optimize, CollageResult
from .candidate import Candidate, Placement
from .pipeline import pipeline
from .registry import (add_backend_pattern, add_backend_pattern_rule, get_backend, list_backends,
                       load_pattern_file, register_backend)

__version__ = "0.1.0"
__all__ = ["build", "optimize", "pipeline", "CollageResult", "Candidate", "Placement",
           "register_backend", "add_backend_pattern", "add_backend_pattern_rule",
           "load_pattern_file", "get_backend", "list_backends"]
