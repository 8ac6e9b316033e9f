"""Dataflow-graph view of a Relax function (the nodes the placers assign)."""
from .dataflow import DataflowGraph, Node

__all__ = ["DataflowGraph", "Node"]
