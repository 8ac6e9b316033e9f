"""Tools on top of the engine: the model zoo (``zoo``), ``collage-tvm bench`` (``bench``) and
the placement picture of ``collage-tvm show`` (``show``).

They import the engine; the engine never imports them (``tests/test_layers.py`` checks).
Plotting needs matplotlib, an extra: ``pip install 'collage-tvm[plot]'``.
"""
from __future__ import annotations

PLOT_EXTRA = "pip install 'collage-tvm[plot]'"


class MissingPlotExtra(ImportError):
    """matplotlib is not installed: a PNG cannot be drawn (the message says how to get it)."""


def need_matplotlib(what: str):
    """The ``matplotlib`` module, or ``MissingPlotExtra`` naming ``what`` needed it."""
    try:
        import matplotlib
    except ImportError as err:
        raise MissingPlotExtra(f"{what} needs matplotlib, which is not installed: "
                               f"{PLOT_EXTRA}") from err
    return matplotlib
