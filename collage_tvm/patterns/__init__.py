"""Candidate generation: explicit patterns and the pattern-rule generator (paper §3, Fig. 4)."""
from .generate import CheckContext, carved_regions, generate_candidates, kernel_cost

__all__ = ["CheckContext", "carved_regions", "generate_candidates", "kernel_cost"]
