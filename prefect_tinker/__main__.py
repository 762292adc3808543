"""``python -m prefect_tinker``: the ``prefect-tinker`` command line (:func:`prefect_tinker.cli.main.main`,
the console script of ``[project.scripts]``), for an environment whose scripts folder is not on ``PATH``."""

import sys

from prefect_tinker.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
