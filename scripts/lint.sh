#!/usr/bin/env bash
# Static checks of the package (configs in pyproject.toml): the import layers (import-linter), ruff (lint, format),
# mypy and vulture (dead code at >= 80 % confidence outside scripts/vulture_allowlist.py).
# Run from anywhere: `bash scripts/lint.sh`; exits non-zero on the first failing check.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(flows tasks recipes configs cli tinker_blocks tinker_local prefect_tinker)
echo "lint: import-linter"
lint-imports --no-cache
echo "lint: ruff"
ruff check .  # the whole tree: package, tests, benchmarks, scripts
ruff format --check "${PACKAGES[@]}"
echo "lint: mypy"
mypy
echo "lint: vulture"
# prefect_tinker/{flows,tasks,recipes,configs,cli} are symlinks to the folders above: pass its real folders only
vulture flows tasks recipes cli tinker_blocks tinker_local prefect_tinker/*.py prefect_tinker/capture \
  prefect_tinker/export prefect_tinker/inspect_provider scripts/vulture_allowlist.py --min-confidence 80
echo "lint: ok"
