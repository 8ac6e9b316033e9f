"""Schedules of a placed graph: which placed groups run in turn, which at once (issue #80).

``ios``: IOS's dynamic program over the graph's ending sets (Ding et al., MLSys 2021), on any
DAG and any stage cost; ``placed``: a placement's groups as that DAG. Measuring the stages and
the concurrent executable build on them.
"""
from .ios import (MAX_GROUP_OPS, MAX_GROUPS, Schedule, Stage, same_kind_siblings, schedule,
                  sequential, topological_order)
from .placed import group_dag, merge_keys

__all__ = ["MAX_GROUPS", "MAX_GROUP_OPS", "Schedule", "Stage", "same_kind_siblings", "schedule",
           "sequential", "topological_order", "group_dag", "merge_keys"]
