#!/usr/bin/env bash
# Static checks of the package (configs in pyproject.toml): the import layers (import-linter), ruff (lint, format),
# mypy and vulture (dead code at >= 80 % confidence outside scripts/vulture_allowlist.py).
# Run from anywhere: `bash scripts/lint.sh`; exits non-zero on the first failing check. Each tool runs plainly at
# the repository root (plain layout: a module's import name is its path), as a contributor would type it.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(prefect_tinker tinker_blocks tinker_local)
echo "lint: import-linter"
lint-imports --no-cache
echo "lint: ruff"
ruff check .  # the whole tree: package, tests, benchmarks, scripts
ruff format --check "${PACKAGES[@]}"
echo "lint: mypy"
mypy
echo "lint: vulture"
vulture "${PACKAGES[@]}" scripts/vulture_allowlist.py --min-confidence 80
echo "lint: ok"
