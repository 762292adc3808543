"""The persistent local Prefect server of ``prefect-tinker run``: the API with its UI, kept between runs.

Without ``PREFECT_API_URL``, the first ``prefect-tinker run`` starts a Prefect server and later runs
reuse it, as flows do with the embedded Tinker server (:mod:`tinker_local.launcher`). It is
``prefect server start --host 127.0.0.1 --port P`` with the UI on, detached from the command (its own
session), so the link a run prints (``View at http://127.0.0.1:P/runs/flow-run/<id>``) opens the run
in the Prefect UI while it runs and after it ended: its logs, task runs, artifacts (progress, curves,
metrics, summaries) and asset events.

Its state lives in ``<root>/prefect/`` (``root``: ``$PREFECT_TINKER_HOME`` or ``~/.prefect-tinker``):

- ``home/``: the server's ``PREFECT_HOME`` (the SQLite database ``prefect.db``, the UI's files);
- ``server.json``: the record (``pid``, ``start_ticks``, ``port``, ``api_url``, ``ui_url``, ``home``,
  ``log``, ``started_at``, ``startup_s``, ``command``, ``identity``) of the running server;
- ``server.log``: its output; ``server.lock``: an ``flock`` serialising starts and stops;
- ``port``: the last port; a restarted server takes it again when it is free, so old links work.

A recorded server is reused when its process is the recorded one (pid and start time) and
``GET /api/health`` answers 200. One of another identity (interpreter or Prefect version: an upgrade
migrates the database) is replaced, unless flow runs started on it in the last day are still
``RUNNING``. The server gets the secret-free environment of
:func:`tinker_local.server_env.server_environment` plus its own Prefect settings, never the caller's
``PREFECT_*`` settings (a profile, an API key, another database).

``prefect-tinker ui`` (:mod:`prefect_tinker.cli.ui`) opens, shows and stops it.
``PREFECT_TINKER_UI=off`` makes ``run`` use the temporary API without UI that dies with the command
(:mod:`prefect_tinker.cli.prefect_api`) instead. Server commands: Prefect's ``prefect server
start`` (https://docs.prefect.io/v3/api-ref/cli/server).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from tinker_local import procs
from tinker_local.launcher import default_root
from tinker_local.server_env import server_environment

__all__ = [
    "UI_ENV",
    "PrefectServerError",
    "ensure_prefect_server",
    "prefect_server_folder",
    "prefect_server_status",
    "run_api",
    "server_identity",
    "stop_prefect_server",
    "ui_enabled",
]

#: ``off`` (or ``0``, ``false``, ``no``): ``run`` uses a temporary API without UI instead
UI_ENV = "PREFECT_TINKER_UI"
#: a fixed port for the server (default: the last one, else a free one)
PORT_ENV = "PREFECT_TINKER_UI_PORT"
RECORD_FILE = "server.json"
_FALSE = {"off", "0", "false", "no"}


class PrefectServerError(RuntimeError):
    """The local Prefect server could not be started, reused or stopped (one line, or the line and
    the tail of its log)."""


def ui_enabled() -> bool:
    """Whether ``run`` keeps the persistent server (``$PREFECT_TINKER_UI`` is not ``off``/``0``/``false``/``no``)."""
    return os.environ.get(UI_ENV, "").strip().lower() not in _FALSE


def prefect_server_folder(root: str | os.PathLike[str] | None = None) -> Path:
    """``<root>/prefect`` (``root`` default: ``$PREFECT_TINKER_HOME`` or ``~/.prefect-tinker``), absolute."""
    return (Path(root).expanduser() if root else default_root()).resolve() / "prefect"


def server_identity() -> dict[str, str]:
    """What a server started by this process runs: ``python`` (the interpreter, symlinks resolved)
    and ``prefect`` (Prefect's version, which fixes the database schema and the UI)."""
    import prefect

    return {"python": os.path.realpath(sys.executable), "prefect": str(prefect.__version__)}


def _alive(record: dict[str, Any]) -> bool:
    """The recorded process still exists and is the one recorded (same start time: not a reused pid)."""
    pid = int(record.get("pid", -1))
    return procs.pid_alive(pid) and procs.pid_start_ticks(pid) == record.get("start_ticks")


def _healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(api_url + "/health", timeout=timeout) as resp:  # noqa: S310
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _port_free(port: int) -> bool:
    """Whether a server can listen on ``port`` of 127.0.0.1 (as uvicorn binds: ``SO_REUSEADDR``, so
    connections of a stopped server in ``TIME_WAIT`` do not count)."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _recent_running_runs(api_url: str) -> int:
    """Flow runs ``RUNNING`` on the server that started within the last day (0 when it cannot tell;
    a busy server's 503 is asked again, 3 times in all)."""
    since = (datetime.now(UTC) - timedelta(days=1)).isoformat()
    body = {"flow_runs": {"state": {"type": {"any_": ["RUNNING"]}}, "start_time": {"after_": since}}}
    for attempt in range(3):
        req = urllib.request.Request(
            api_url + "/flow_runs/count",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=5.0) as resp:  # noqa: S310
                return int(json.loads(resp.read()))
        except urllib.error.HTTPError as exc:
            if exc.code != 503:
                return 0
        except (urllib.error.URLError, OSError, ValueError, TypeError):
            return 0
        time.sleep(1.0 + attempt)
    return 0


def _stop_record(folder: Path, record: dict[str, Any], timeout: float) -> bool:
    """Stop the recorded server (SIGTERM, SIGKILL after ``timeout`` s, then anything left in its
    process group) and remove the record; True when a live server was stopped."""
    alive = _alive(record)
    if alive:
        pid = int(record["pid"])
        procs.terminate(pid, timeout)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # its own session: the group is the server's
    (folder / RECORD_FILE).unlink(missing_ok=True)
    return alive


def _server_env(home: Path, port: int) -> dict[str, str]:
    api_url = f"http://127.0.0.1:{port}/api"
    return {
        **server_environment(),  # the basics, no secrets, none of the caller's PREFECT_* settings
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_UI_API_URL": api_url,  # what the UI in the browser calls
        "PREFECT_UI_ENABLED": "true",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
    }


def _choose_port(folder: Path, port: int | None) -> int:
    if port:
        return port
    if os.environ.get(PORT_ENV):
        try:
            return int(os.environ[PORT_ENV])
        except ValueError:
            raise PrefectServerError(f"{PORT_ENV}={os.environ[PORT_ENV]!r} is not a port number") from None
    try:
        last = int((folder / "port").read_text())
    except (OSError, ValueError):
        last = 0
    return last if last and _port_free(last) else procs.free_port()


def ensure_prefect_server(
    root: str | os.PathLike[str] | None = None, *, port: int | None = None, startup_timeout: float = 180.0
) -> dict[str, Any]:
    """Reuse the healthy local Prefect server recorded in ``<root>/prefect/server.json`` or start one
    (see the module docstring) and wait until ``GET /api/health`` answers.

    Args:
        root: the prefect-tinker state folder (default ``$PREFECT_TINKER_HOME`` or ``~/.prefect-tinker``).
        port: the port of a new server (default ``$PREFECT_TINKER_UI_PORT``, else the last port
            when free, else a free port). A running server on another port is an error.
        startup_timeout: seconds to wait for a new server (the first start on an empty database
            takes 10-20 s on a loaded 2-core machine).

    Returns:
        The record: ``pid``, ``start_ticks``, ``port``, ``api_url`` (``http://127.0.0.1:P/api``),
        ``ui_url`` (``http://127.0.0.1:P``), ``home``, ``log``, ``started_at`` (Unix seconds),
        ``startup_s`` (seconds from start to the first health answer), ``command``, ``identity``,
        ``started`` (True when this call started it) and ``replaced`` (how the identity of the
        server it replaced differed, e.g. ``"prefect 3.9.0 -> 3.9.1"``, else None).

    Raises:
        PrefectServerError: the running server uses another port than ``port``; it runs another
            identity while runs use it; the port is taken; the server exited or did not answer
            in time (then stopped; the message ends with its log's last lines).
    """
    folder = prefect_server_folder(root)
    home = folder / "home"
    home.mkdir(parents=True, exist_ok=True)
    with procs.file_lock(folder / "server.lock"):
        record = procs.read_record(folder / RECORD_FILE)
        # a busy server may answer slowly: two tries of 5 s before it counts as hung and is replaced
        if record and _alive(record) and any(_healthy(record["api_url"], timeout=5.0) for _ in range(2)):
            if port and record.get("port") != port:
                raise PrefectServerError(
                    f"the local Prefect server already runs on port {record['port']} (pid {record['pid']}); "
                    "'prefect-tinker ui stop' first to move it"
                )
            was, now = record.get("identity") or {}, server_identity()
            if was == now:
                return {**record, "started": False, "replaced": None}
            replaced = ", ".join(f"{k} {was.get(k)} -> {v}" for k, v in now.items() if was.get(k) != v)
            busy = _recent_running_runs(record["api_url"])
            if busy:
                raise PrefectServerError(
                    f"the local Prefect server {record['ui_url']} (pid {record['pid']}) runs another Python or "
                    f"Prefect ({replaced}) and {busy} flow run(s) on it are RUNNING; let them finish "
                    "(or mark them crashed), then 'prefect-tinker ui stop'"
                )
        else:
            replaced = None
        if record:
            _stop_record(folder, record, timeout=10.0)  # dead, unhealthy or stale
        port = _choose_port(folder, port)
        if not _port_free(port):
            raise PrefectServerError(f"port {port} of 127.0.0.1 is taken; set {PORT_ENV} to another port")
        log_path = folder / "server.log"
        cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["--ui", "--analytics-off"]
        proc = procs.start_detached(cmd, log_path=log_path, cwd=folder, env=_server_env(home, port))
        api_url = f"http://127.0.0.1:{port}/api"
        t0 = time.monotonic()
        procs.wait_ready(
            proc,
            lambda: _healthy(api_url, timeout=1.0),
            what="the local Prefect server",
            url=f"{api_url}/health",
            log_path=log_path,
            timeout=startup_timeout,
            poll_s=0.2,
            error=PrefectServerError,
            tail_lines=20,
        )
        record = {
            "pid": proc.pid,
            "start_ticks": procs.pid_start_ticks(proc.pid),
            "port": port,
            "api_url": api_url,
            "ui_url": f"http://127.0.0.1:{port}",
            "home": str(home),
            "log": str(log_path),
            "started_at": time.time(),
            "startup_s": round(time.monotonic() - t0, 2),
            "command": cmd,
            "identity": server_identity(),
        }
        procs.write_record(folder / RECORD_FILE, record)
        (folder / "port").write_text(str(port))
        return {**record, "started": True, "replaced": replaced}


def prefect_server_status(root: str | os.PathLike[str] | None = None) -> dict[str, Any] | None:
    """The record of the local Prefect server with ``running`` (its process lives) and ``healthy``
    (``/api/health`` answers 200) added, or None when none is recorded."""
    folder = prefect_server_folder(root)
    record = procs.read_record(folder / RECORD_FILE)
    if record is None:
        return None
    running = _alive(record)
    return {**record, "running": running, "healthy": running and _healthy(record.get("api_url", ""))}


def stop_prefect_server(root: str | os.PathLike[str] | None = None, timeout: float = 10.0) -> dict[str, Any] | None:
    """Stop the local Prefect server (SIGTERM, SIGKILL after ``timeout`` seconds) and remove its
    record; its database stays. Returns the removed record with ``stopped`` (True when a live server
    was stopped, False when its process was already gone), or None when none was recorded."""
    folder = prefect_server_folder(root)
    if not folder.exists():
        return None
    with procs.file_lock(folder / "server.lock"):
        record = procs.read_record(folder / RECORD_FILE)
        if record is None:
            return None
        return {**record, "stopped": _stop_record(folder, record, timeout)}


@contextlib.contextmanager
def run_api(
    root: str | os.PathLike[str] | None = None, announce: Callable[[str], None] | None = None
) -> Iterator[str | None]:
    """The Prefect API of one ``prefect-tinker run``: the body runs against the persistent local
    server (started when needed; ``announce`` gets a line saying so), or with ``PREFECT_TINKER_UI=off``
    against a temporary API that dies with the command. Yields its API URL, or None when
    ``PREFECT_API_URL`` is set (the user's own server wins; nothing is started).

    Raises:
        PrefectServerError: see :func:`ensure_prefect_server`.
        PrefectAPIError: the temporary API did not start.
    """
    from prefect_tinker.cli.prefect_api import api_url_set, temporary_prefect_api, using_api

    if api_url_set():
        yield None
    elif not ui_enabled():
        with temporary_prefect_api() as url:
            yield url
    else:
        timeout = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") or 180)
        record = ensure_prefect_server(root, startup_timeout=timeout)
        if record["started"] and announce is not None:
            why = f"replacing one of {record['replaced']}; " if record["replaced"] else ""
            announce(
                f"Started the local Prefect server with its UI at {record['ui_url']} ({why}pid {record['pid']}, "
                f"ready in {record['startup_s']:.0f} s); it stays up for later runs: "
                "'prefect-tinker ui' opens it, 'prefect-tinker ui stop' stops it"
            )
        with using_api(record["api_url"]):
            yield record["api_url"]
