"""Frontends: ONNX, PyTorch and Relax models to one Relax ``main`` with weights bound."""
from .load import ModelError, dynamic_input, load_model, normalize_for_collage

__all__ = ["ModelError", "load_model", "normalize_for_collage"]
