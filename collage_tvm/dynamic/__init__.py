"""Models with dynamic dimensions: one build serves every shape of a range.

``shapes``: the ranges (``--shapes``, defaults read from the model); ``search``: Collage's
search at the optimum and the choice per shape; ``dispatch``: the build that sends each
call to what serves its shape.
"""
from __future__ import annotations

from .shapes import (ShapeError, ShapeRanges, dynamic_model, is_dynamic, parse_shapes,
                     shape_ranges)

__all__ = ["ShapeError", "ShapeRanges", "dynamic_model", "is_dynamic", "parse_shapes",
           "shape_ranges"]
