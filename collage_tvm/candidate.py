"""Candidate and placement: the nouns of the Collage search (paper §3-4)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Candidate:
    """A group of dataflow-graph nodes that one backend could run as one kernel.

    ``nodes`` are indices into ``DataflowGraph.nodes`` (topological order).
    ``label`` names the pattern that produced it (``"dnnl.conv2d_bias_relu"``,
    ``"tvm.fused"``); it is informational and not part of the identity used for costs.
    """

    backend: str
    nodes: frozenset
    label: str = field(default="", compare=False)

    def __repr__(self) -> str:
        return f"Candidate({self.backend}, {sorted(self.nodes)}, {self.label!r})"


@dataclass
class Placement:
    """The search's answer: candidates that cover every node exactly once."""

    groups: list  # list[Candidate], in an order where producers come first
    cost: float   # estimated cost (ms) under the additive model, Eq. 2-4
    chosen_by: dict = field(default_factory=dict)  # Candidate -> "op-level" | "graph-level"
    exact: bool = True  # False: the op-level DP fell back to its restricted search (too wide)
    exact: bool = True  # False: the op-level DP placed windows of the graph (too wide)
