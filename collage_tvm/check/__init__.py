"""The final check: single-backend builds, end-to-end evaluation, output comparison."""
from .baselines import byoc_groups, graph_lib_groups, single_backend_builds
from .evaluate import (compare_outputs, evaluate, first_line, latency_evaluator, outputs_on,
                       run_outputs, tvm_reference)
from .never_slower import (MODEL_FILE, SLOW_BUILD_FACTOR, Floor, Verdict, file_label, floor,
                           never_slower, ops_per_backend)

__all__ = ["byoc_groups", "graph_lib_groups", "single_backend_builds", "compare_outputs",
           "evaluate", "first_line", "latency_evaluator", "outputs_on", "run_outputs", "tvm_reference", "MODEL_FILE", "SLOW_BUILD_FACTOR", "Floor",
           "file_label", "Verdict", "floor",
           "never_slower", "ops_per_backend"]
