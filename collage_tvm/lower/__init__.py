"""Lowering of external groups and the final build."""
from .external import lower_external

__all__ = ["lower_external"]
