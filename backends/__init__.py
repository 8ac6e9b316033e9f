"""Lowerings of the built-in backends; setup.py installs this folder as collage_tvm.backends."""
