"""``collage-tvm``: optimize a model, run a saved build, inspect the cost DB.

One module per verb: ``optimize`` (the search, the build and what it prints), ``run`` (a
saved build), ``tune``, ``db``, ``bench``, ``show``; ``parser`` builds the command line;
``main`` (here) reads it and hands each verb to its module. ``python -m collage_tvm.cli``
runs ``main`` (``__main__``)."""
from __future__ import annotations

import logging
import sys

from .bench import _bench
from .db import _db
from .optimize import _optimize
from .parser import _parser
from .run import _run, decided_text  # noqa: F401 (decided_text: collage_tvm.cli's, as before)
from .show import _show
from .tune import _tune


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    if args.cmd == "db":
        from ..build import DEFAULT_DB

        args.db = args.db or DEFAULT_DB
        if args.action in ("export", "import") and not args.file:
            p.error(f"db {args.action} needs a FILE")
        return _db(args)
    if args.cmd == "bench":
        return _bench(args, p)
    if args.cmd == "show":
        return _show(args)
    if args.cmd == "run":
        return _run(args)
    from ..artifact import ArtifactError

    try:
        return _tune(args) if args.cmd == "tune" else _optimize(args)
    except (ValueError, KeyError, FileNotFoundError, ArtifactError) as err:
        from ..dynamic import ShapeError
        from ..frontend.load import ModelError
        from ..registry import PatternFileError

        if (isinstance(err, (ModelError, PatternFileError, ArtifactError, ShapeError))
                or args.verbose is False):
            print(f"collage-tvm: error: {err}", file=sys.stderr)
            return 2
        raise
