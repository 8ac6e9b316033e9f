"""Placers: choose which backend runs each part of the graph (Collage paper §4)."""
