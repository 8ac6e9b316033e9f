"""The package version: a foundation module (the manifest of a saved build names it)."""
__version__ = "0.1.0"
