#!/usr/bin/env bash
# Installs everything into ./.venv and runs the test suite (servers are started by the tests' fixtures).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
. scripts/env.sh
python -m pytest -q "$@"
