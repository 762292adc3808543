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
# subprocesses inherit all of it. SmolLM2 comes from its wheel in site-packages. The test data
# (tests/data_files.py) is looked up in $PREFECT_TINKER_TEST_DATA, ../shared/data, then the cache that
# scripts/fetch_test_data.py fills: that one folder of the user's (~/.cache/prefect-tinker/test-data, or
# $PREFECT_TINKER_DATA_CACHE) is pinned here, before HOME changes, and only read (each file checked
# against SHA256SUMS when it was fetched).
from prefect_tinker.recipes.example_data import CACHE_ENV, cache_dir  # noqa: E402  (standard library only)

os.environ[CACHE_ENV] = str(cache_dir())
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
# the persistent local Prefect server of a user (prefect_tinker/cli/prefect_server.py); tests of that server turn it
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

# Live tinker_local servers for the protocol tests: fixtures local_servers, hf_model_dir (session); clean (the
# clean server) and service (an SDK ServiceClient on it), per module.
from tests.local_server import clean, hf_model_dir, local_servers, service  # noqa: E402,F401


# ---- SDK clients that outlive their server ------------------------------------------------------------
# The tinker SDK heartbeats each session every 10 s from its event-loop thread and, two minutes after its
# server went away, logs a warning every 10 s for the rest of the process (into whatever stream a finished
# test's capture closed: "--- Logging error --- ... I/O operation on closed file"). A test closes every
# ServiceClient it makes (client.close(), or `with`); this check fails the test in whose teardown a
# heartbeat is found beating against a server that no longer accepts connections, names the test that
# made the client, and closes it.
_HEARTBEAT_MADE_IN: dict[int, str] = {}  # id(heartbeat task) -> the test during which it was first seen


def _server_gone(base_url: str) -> bool:
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(base_url)
    if parts.hostname not in ("127.0.0.1", "localhost", "::1"):
        return False  # only local servers are judged here
    try:
        with socket.create_connection((parts.hostname, parts.port or 80), timeout=2):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # busy or slow is not gone


def _heartbeats() -> list[tuple[object, object]]:
    """``[(task, client holder)]`` of the SDK's live session heartbeats in this process."""
    import asyncio
    import sys

    module = sys.modules.get("tinker.lib.internal_client_holder")
    loop = module._internal_client_holder_thread_singleton.loop_if_started() if module else None
    if loop is None or loop.is_closed() or not loop.is_running():
        return []

    async def listing():
        return [t for t in asyncio.all_tasks() if getattr(t.get_coro(), "__name__", "") == "_session_heartbeat"]

    tasks = asyncio.run_coroutine_threadsafe(listing(), loop).result(timeout=10)
    return [(t, t.get_coro().cr_frame.f_locals.get("self")) for t in tasks if t.get_coro().cr_frame is not None]


@pytest.fixture(autouse=True)
def _no_heartbeat_outlives_its_server(request):
    yield
    orphans = []
    for task, holder in _heartbeats():
        made_in = _HEARTBEAT_MADE_IN.setdefault(id(task), request.node.nodeid)
        url = getattr(holder, "_base_url", "")
        if holder is not None and url and _server_gone(url):
            orphans.append(f"{url} (client made during {made_in})")
            holder.close()  # its heartbeat stops here
    if orphans:
        pytest.fail("SDK session heartbeats outlive their server; close the ServiceClient (client.close() or "
                    f"`with`): {'; '.join(orphans)}", pytrace=False)


def pytest_collection_modifyitems(config, items):
    """Test files holding a ``slow`` test run first (stable order otherwise), so that with several
    xdist workers (``--dist loadfile``) no worker is left alone with a long file at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


def pytest_terminal_summary(terminalreporter):
    """One line for the tests skipped because a real data file is missing (tests/data_files.py)."""
    from tests.data_files import DATA_SKIP

    skipped = [r for r in terminalreporter.stats.get("skipped", []) if DATA_SKIP in str(r.longrepr)]
    if skipped:
        terminalreporter.write_line(
            f"{len(skipped)} tests skipped: test data not found; run scripts/fetch_test_data.py"
        )
