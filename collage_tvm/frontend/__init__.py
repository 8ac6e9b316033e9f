"""Frontends: ONNX, PyTorch and Relax models to one Relax ``main`` with weights bound."""
from .load import dynamic_input, load_model, normalize_for_collage

__all__ = ["load_model", "normalize_for_collage"]
