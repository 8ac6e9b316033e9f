"""The built-in backends, one folder each: ``<name>/__init__.py`` is the lowering (imported
as ``collage_tvm.backends.<name>``), ``<name>/patterns.py`` the pattern file that
``collage_tvm.registry`` loads; the ``_*.py`` modules are helpers the lowerings share."""
