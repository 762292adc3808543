#!/usr/bin/env bash
# Static checks of the package (configs in pyproject.toml): the import layers (import-linter), ruff (lint, format),
# mypy and vulture (dead code at >= 80 % confidence outside scripts/vulture_allowlist.py).
# Run from anywhere: `bash scripts/lint.sh`; exits non-zero on the first failing check.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(flows tasks recipes configs cli tinker_blocks tinker_local prefect_tinker)
# import-linter and mypy find modules by walking folders: they run in build/import-tree, the checkout's folders
# linked under their import names (scripts/import_tree.py, from pyproject.toml's package-dir)
TREE=$(python scripts/import_tree.py)
echo "lint: import-linter"
(cd "$TREE" && lint-imports --no-cache "$OLDPWD/pyproject.toml")
echo "lint: ruff"
ruff check .  # the whole tree: package, tests, benchmarks, scripts
ruff format --check "${PACKAGES[@]}"
echo "lint: mypy"
(cd "$TREE" && mypy --config-file "$OLDPWD/pyproject.toml" --cache-dir "$OLDPWD/.mypy_cache")
echo "lint: vulture"
vulture "${PACKAGES[@]}" scripts/vulture_allowlist.py --min-confidence 80
echo "lint: ok"
