"""Lowering of external groups and the final build."""
from ..partition import partition
from .external import lower_external, release_with


def lower_placement(graph, groups, backends: dict, timings: dict | None = None):
    """Partition ``graph`` by ``groups`` and lower the external groups: ready for tvm.compile.
    ``timings``: see ``lower_external``."""
    return lower_external(partition(graph, groups, backends), backends, timings)


__all__ = ["lower_external", "lower_placement", "release_with"]
