"""``python -m tinker_local serve ...`` (see tinker_local.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
