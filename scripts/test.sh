#!/usr/bin/env bash
# Installs everything into ./.venv and runs the test suite (servers are started by the tests' fixtures).
# The end-to-end deployment tests (their own Prefect server, worker and CLI) run in a second pytest
# process, so that their Prefect client state never mixes with the session's test API.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
. scripts/env.sh
python -m pytest -q -m "not deployments" "$@"
python -m pytest -q -m deployments "$@"
