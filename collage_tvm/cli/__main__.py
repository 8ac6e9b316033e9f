"""``python -m collage_tvm.cli ...``: the ``collage-tvm`` command."""
import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
