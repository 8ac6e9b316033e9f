"""Candidate generation: explicit patterns and the pattern-rule generator (paper §3, Fig. 4)."""
from .generate import CheckContext, carved_regions, generate_candidates

__all__ = ["CheckContext", "carved_regions", "generate_candidates"]
