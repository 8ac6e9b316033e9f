"""``collage-tvm show``: a placement JSON drawn."""
from __future__ import annotations

import sys


def _show(args) -> int:
    from pathlib import Path

    from ..tools import MissingPlotExtra
    from ..tools.show import load_record, render

    out = args.output or str(Path(args.placement).with_suffix(".svg"))
    try:
        print(render(load_record(args.placement), out))
    except (ValueError, OSError, MissingPlotExtra) as err:  # MissingPlotExtra: .png, no plot extra
        print(f"collage-tvm: error: {err}", file=sys.stderr)
        return 2
    return 0
