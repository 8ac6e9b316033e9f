"""collage-tvm: automated integration of deep-learning backends (Collage) on TVM Relax."""
from .build import build, optimize, CollageResult
from .candidate import Candidate, Placement
from .pipeline import pipeline
from .registry import (add_backend_pattern, add_backend_pattern_rule, get_backend, list_backends,
                       load_pattern_file, register_backend)

__version__ = "0.1.0"
__all__ = ["build", "optimize", "pipeline", "CollageResult", "Candidate", "Placement",
           "register_backend", "add_backend_pattern", "add_backend_pattern_rule",
           "load_pattern_file", "get_backend", "list_backends"]
