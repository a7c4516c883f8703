"""``python -m omni_accel``: the same command line as ``omni-accel`` (see omni_accel/cli.py)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
