"""Dataflow-graph view of a Relax function (the nodes the placers assign)."""
from .dataflow import GLOBALS_ATTR, DataflowGraph, Node, NotDataflow

__all__ = ["DataflowGraph", "GLOBALS_ATTR", "Node", "NotDataflow"]
