"""TVM's own kernels, tuned: MetaSchedule in process, a tuning database per target, and the
compile pipeline every TVM build of Collage goes through (issue #16).

``compile``: what TVM compiles a function into (``kernels``), and the pipeline applying
tuned records (``compile_module``).
``database``: the records on disk (``TuningDB``), per target and TVM version.
``inprocess``: MetaSchedule's builder and runner in this process.
``tuner``: tuning a list of kernels within a time budget. Which kernels to tune is
Collage's decision: ``plan`` (``collage_tvm.tune``; it imports the search, so this
package does not import it).
"""
from .database import (TuningDB, active_database, default_dir, open_tuning_db, target_id,
                       tuning_root, use_tuning_db)
from .compile import compile_module, fuse, kernel_key, kernels, pipeline, workload
from .tuner import KernelResult, KernelToTune, tune_kernels

__all__ = ["KernelResult", "KernelToTune", "TuningDB", "active_database", "compile_module",
           "default_dir", "fuse", "kernel_key", "kernels", "open_tuning_db", "pipeline",
           "target_id", "tune_kernels", "tuning_root", "use_tuning_db", "workload"]
