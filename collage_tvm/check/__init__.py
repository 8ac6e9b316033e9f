"""The final check: single-backend builds, end-to-end evaluation, output comparison."""
from .baselines import byoc_groups, graph_lib_groups, single_backend_builds
from .contender import Contender, Fate, from_records, records
from .evaluate import (compare_outputs, evaluate, first_line, latency_evaluator, outputs_on,
                       run_outputs, tvm_reference)
from .floors import MODEL_FILE, Floor, file_label, floor
from .never_slower import Verdict, never_slower, ops_per_backend

__all__ = ["byoc_groups", "graph_lib_groups", "single_backend_builds", "compare_outputs",
           "evaluate", "first_line", "latency_evaluator", "outputs_on", "run_outputs",
           "tvm_reference", "Contender", "Fate", "records", "from_records", "MODEL_FILE",
           "Floor", "file_label", "Verdict", "floor", "never_slower", "ops_per_backend"]
