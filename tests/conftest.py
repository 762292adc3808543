"""Shared fixtures: paths to the shared data, a Prefect test API, and the embedded local server."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Hermetic: the session runs with a throw-away HOME, set before Prefect (or Ray, or Hugging Face) is
# imported, so that nothing a user or another program left in ~/.prefect (profiles: an API URL or key),
# ~/.ray (auth_token), ~/.prefect-tinker (an embedded server, stores) or ~/.cache is read, and nothing is
# left there. Settings naming those places, a user's Prefect API and credentials are dropped too;
# subprocesses inherit all of it. SmolLM2 comes from its wheel in site-packages and the test data from
# ../shared/data, so nothing the tests need lives under HOME.
if Path("~/.pyenv").expanduser().is_dir():  # a pyenv interpreter's shims find their versions through HOME
    os.environ.setdefault("PYENV_ROOT", str(Path("~/.pyenv").expanduser()))
SESSION_HOME = tempfile.mkdtemp(prefix="prefect-tinker-tests-home-")
atexit.register(shutil.rmtree, SESSION_HOME, True)
os.environ["HOME"] = SESSION_HOME
for _name in ("PREFECT_HOME", "PREFECT_PROFILES_PATH", "PREFECT_PROFILE", "PREFECT_API_URL", "PREFECT_API_KEY",
              "PREFECT_TINKER_HOME", "PREFECT_TINKER_STORE", "PREFECT_TINKER_UI_PORT", "TINKER_API_KEY",
              "TINKER_BASE_URL", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "HF_HOME", "HF_HUB_CACHE",
              "HF_DATASETS_CACHE", "TRANSFORMERS_CACHE", "RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
              "RAY_AUTH_TOKEN_PATH"):
    os.environ.pop(_name, None)
# `prefect-tinker run` without PREFECT_API_URL: the temporary Prefect API that dies with the command, not
# the persistent local Prefect server of a user (flows/prefect_server.py); tests of that server turn it
# on for their own HOME (tests/test_prefect_ui.py) and stop it.
os.environ["PREFECT_TINKER_UI"] = "off"

# Several pytest-xdist workers (scripts/test.sh): each keeps to its own share of the CPUs, and so do the
# servers it starts (affinity is inherited; tinker_local sizes its torch threads to it). Without this, two
# workers' embedded servers each run a torch thread team over every core and stall one another.
_WORKER, _WORKERS = os.environ.get("PYTEST_XDIST_WORKER"), int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKER and _WORKERS > 1 and hasattr(os, "sched_setaffinity"):
    _cpus = sorted(os.sched_getaffinity(0))
    if len(_cpus) >= _WORKERS:
        _share = _cpus[int(_WORKER.removeprefix("gw")) % _WORKERS :: _WORKERS]
        os.sched_setaffinity(0, _share)
        os.environ["OMP_NUM_THREADS"] = str(len(_share))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Prefect's console log handler keeps the sys.stderr it first sees. Import Prefect (which sets up its
# logging) now, under pytest's session-wide capture, and not inside a test whose capsys stream is
# closed when that test ends: later flows in the same process would fail with "I/O operation on
# closed file" (e.g. tests/test_cli.py followed by tests/test_store_s3.py). The whole suite already
# did this by collecting tests/test_blocks_standard.py, which imports Prefect at module level.
import prefect.main  # noqa: E402,F401

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"


def shared_file(relative: str) -> Path:
    """A file of ../shared/data, or skip the test with the reason when that folder is absent."""
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(f"shared data file {path} is absent (tests read ../shared/data in place)")
    return path


@pytest.fixture(scope="session")
def prefect_api():
    """A temporary Prefect API server for the whole session (flows and tasks report to it)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def local_credentials(tmp_path_factory):
    """A ``TinkerCredentials`` block in embedded-local mode with its own server root.

    The block starts the server subprocess on first use; it is stopped at the end of the session.
    """
    from tinker_blocks import TinkerCredentials

    root = tmp_path_factory.mktemp("tinker-local")
    creds = TinkerCredentials(local=True, local_root=str(root))
    yield creds
    creds.stop_local_server()


# A real S3 server (SeaweedFS) for the store tests: fixtures s3_server (session) and s3_root.
from tests.s3_fixtures import s3_root, s3_server  # noqa: E402,F401

# Live tinker_local servers for the protocol tests: fixtures local_servers, hf_model_dir (session).
from tests.local_server import hf_model_dir, local_servers  # noqa: E402,F401


def pytest_collection_modifyitems(config, items):
    """Test files holding a ``slow`` test run first (stable order otherwise), so that with several
    xdist workers (``--dist loadfile``) no worker is left alone with a long file at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)
