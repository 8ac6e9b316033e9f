"""Partition: chosen groups become functions (TVM primitives or BYOC composites)."""
from .partition import partition, CODEGEN_PREFIX

__all__ = ["partition", "CODEGEN_PREFIX"]
