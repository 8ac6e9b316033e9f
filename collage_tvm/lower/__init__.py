"""Lowering of external groups and the final build."""
from ..partition import partition
from .external import lower_external


def lower_placement(graph, groups, backends: dict):
    """Partition ``graph`` by ``groups`` and lower the external groups: ready for tvm.compile."""
    return lower_external(partition(graph, groups, backends), backends)


__all__ = ["lower_external", "lower_placement"]
