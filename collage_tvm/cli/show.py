"""``collage-tvm show``: a placement JSON drawn."""
from __future__ import annotations

import sys


def _show(args) -> int:
    from pathlib import Path

    from ..tools import MissingPlotExtra
    from ..tools.show import load_record, render

    if Path(args.placement).is_dir():  # a saved build: what it holds, from its manifest
        from ..artifact.format import ArtifactError
        from ..tools.show_saved import describe

        try:
            print(describe(args.placement))
        except ArtifactError as err:
            print(f"collage-tvm: error: {err}", file=sys.stderr)
            return 2
        return 0
    out = args.output or str(Path(args.placement).with_suffix(".svg"))
    try:
        print(render(load_record(args.placement), out))
    except (ValueError, OSError, MissingPlotExtra) as err:  # MissingPlotExtra: .png, no plot extra
        print(f"collage-tvm: error: {err}", file=sys.stderr)
        return 2
    return 0
