"""collage-tvm: automated integration of deep-learning backends (Collage) on TVM Relax."""
import os as _os

# A placement mixes runtimes that each keep a thread pool: TVM's, torch's OpenMP (dnnl,
# mkl), one per ONNX Runtime session, OpenVINO's TBB arena. On a few cores a pool that
# spins after its kernel starves the next runtime's threads (the measurements: `git show
# 31eb8cd:docs/BENCHMARKS.md`, "Thread pools"). TVM's workers therefore sleep at once (read
# when TVM's pool starts, so set it here, before any kernel runs); onnxruntime sessions disable
# spinning in collage_tvm/backends/onnxruntime. A user's own setting wins.
_os.environ.setdefault("TVM_THREAD_POOL_SPIN_COUNT", "0")

# TVM's runtime sizes its pool at half the logical CPUs on x86 (it assumes two hyperthreads
# per core): on a 2-vCPU machine with one thread per core every TVM kernel ran on one thread
# while onnxruntime, OpenVINO and torch used both (a parallel matmul: 296 ms vs 146 ms with
# two). The pool takes every core this process may run on, as the other runtimes do
# (read when TVM's pool starts, like the spin count). A user's own setting wins.
if "TVM_NUM_THREADS" not in _os.environ and "OMP_NUM_THREADS" not in _os.environ:
    from .target import host_cores as _host_cores

    _os.environ["TVM_NUM_THREADS"] = str(_host_cores())

from .build import CollageResult, build, optimize  # noqa: E402
from .artifact import ArtifactError, LoadedModule, load, save  # noqa: E402
from .options import SearchOptions  # noqa: E402
from .pipeline import pipeline  # noqa: E402
from .tuning.plan import TuneReport, tune  # noqa: E402
from .placement import Candidate, Placement  # noqa: E402
from .lowering import Lowering  # noqa: E402
from .measure.cuda_graph import capture as capture_cuda_graph  # noqa: E402
from .registry import (add_backend_pattern, add_backend_pattern_rule,  # noqa: E402
                       add_backend_patterns_from_tvm, get_backend, list_backends,
                       load_pattern_file, register_backend)

from ._version import __version__  # noqa: E402
__all__ = ["build", "optimize", "save", "load", "LoadedModule", "ArtifactError", "pipeline",
           "tune", "TuneReport", "SearchOptions", "CollageResult", "Candidate",
           "Placement", "Lowering", "register_backend", "add_backend_pattern",
           "add_backend_pattern_rule", "add_backend_patterns_from_tvm", "load_pattern_file",
           "get_backend", "list_backends", "capture_cuda_graph"]
