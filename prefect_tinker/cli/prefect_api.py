"""A temporary Prefect API for ``prefect-tinker run`` that dies with the command.

Since the persistent local Prefect server with its UI (:mod:`prefect_tinker.cli.prefect_server`)
became the default, ``run`` uses this one only with ``PREFECT_TINKER_UI=off`` (nothing stays
running after the command, and the printed run link is dead once it ends).

Without ``PREFECT_API_URL`` a Prefect flow starts its own temporary API server (uvicorn in a
child process) and stops it at exit, but a killed command (SIGKILL, or any signal Python does
not handle) never reaches that exit: the server lives on with parent pid 1, holding the
command's stdout. :func:`temporary_prefect_api` starts the same server itself, with

- a parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set by a tiny launcher
  that then ``exec``\\ s the server, so the server has no process of its own in between): the
  kernel kills the server the moment the command dies, however it dies;
- its output in ``<PREFECT_TINKER_HOME>/prefect-server.log`` (not the command's stdout);
- ``PREFECT_API_URL`` pointing at it for the flow (settings and environment), and at a normal
  exit the Prefect log and event workers drained, then the server stopped (SIGTERM, SIGKILL
  after 5 s).

Nothing is started when ``PREFECT_API_URL`` is set (a real server) or where ``prctl`` does not
exist (not Linux): Prefect's own temporary server is used then.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["PrefectAPIError", "api_url_set", "supported", "temporary_prefect_api", "using_api"]

#: the launcher: arm the parent-death signal, check the parent did not die meanwhile, exec the server
_LAUNCHER = (
    "import ctypes, os, signal, sys\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:\n"  # 1 = PR_SET_PDEATHSIG
    "    sys.exit('prctl(PR_SET_PDEATHSIG) failed: errno %d' % ctypes.get_errno())\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(0)\n"  # the parent died before the signal was armed
    "os.execv(sys.executable, [sys.executable] + sys.argv[2:])\n"
)


class PrefectAPIError(RuntimeError):
    """The temporary Prefect API did not start (the message ends with its log's last lines)."""


def supported() -> bool:
    """Whether this platform has the parent-death signal (Linux)."""
    return sys.platform.startswith("linux")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api_url_set() -> bool:
    """Whether a Prefect API is configured (``PREFECT_API_URL`` in the environment or the profile)."""
    from prefect.settings import get_current_settings

    return bool(os.environ.get("PREFECT_API_URL") or get_current_settings().api.url)


def _server_argv(port: int) -> list[str]:
    import prefect

    return [
        "-m",
        "uvicorn",
        "--app-dir",
        str(prefect.__module_path__.parent),
        "--factory",
        "prefect.server.api.server:create_app",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "error",
        "--lifespan",
        "on",
    ]


def _server_env() -> dict[str, str]:
    from prefect.settings import get_current_settings

    return {
        **os.environ,
        **get_current_settings().to_environment_variables(exclude_unset=True),
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }


def _wait_ready(proc: subprocess.Popen, api_url: str, timeout: float, log_path: Path) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise PrefectAPIError(
                    f"the temporary Prefect API exited with code {proc.returncode}; "
                    f"last lines of {log_path}:\n{_tail(log_path)}"
                )
            try:
                if client.get(f"{api_url}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise PrefectAPIError(
        f"the temporary Prefect API did not answer {api_url}/health within {timeout:g} s; "
        f"last lines of {log_path}:\n{_tail(log_path)}"
    )


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) or "(empty)"
    except OSError:
        return "(no log)"


def _drain_prefect_workers() -> None:
    """Send the flow's buffered logs and events before the API goes away (as Prefect's test
    harness does)."""
    import inspect

    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.utilities.asyncutils import run_coro_as_sync

    async def drain() -> None:
        for fn in (lambda: APILogWorker.instance().drain(), EventsWorker.drain_all):
            try:
                result = fn()
                if inspect.isawaitable(result):
                    await result
            except RuntimeError:  # never started
                pass

    try:
        run_coro_as_sync(drain())
    except Exception:  # best effort: the flow's result is what matters now
        pass


def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def temporary_prefect_api(
    log_dir: str | os.PathLike[str] | None = None, startup_timeout: float | None = None
) -> Iterator[str | None]:
    """Run the body against a temporary Prefect API that dies with this process (see the module
    docstring); yields its API URL, or None when nothing was started (``PREFECT_API_URL`` set, or
    not Linux).

    Args:
        log_dir: folder of ``prefect-server.log`` (default ``$PREFECT_TINKER_HOME`` or
            ``~/.prefect-tinker``).
        startup_timeout: seconds to wait for the server (default
            ``$PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` or 180).

    Raises:
        PrefectAPIError: the server exited or did not answer in time (it is stopped).
    """
    if api_url_set() or not supported():
        yield None
        return
    folder = Path(log_dir or os.environ.get("PREFECT_TINKER_HOME") or Path.home() / ".prefect-tinker").expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    log_path = folder / "prefect-server.log"
    timeout = startup_timeout or float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS") or 180)
    port = _free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    with open(log_path, "ab") as log:
        log.write(
            f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} temporary Prefect API on {api_url} "
            f"for pid {os.getpid()}\n".encode()
        )
        log.flush()
        proc = subprocess.Popen(
            [sys.executable, "-c", _LAUNCHER, str(os.getpid()), *_server_argv(port)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_server_env(),
            start_new_session=True,  # Ctrl-C reaches the command (which stops this server), not the server
        )
    try:
        _wait_ready(proc, api_url, timeout, log_path)
        with using_api(api_url):
            yield api_url
    finally:
        _stop(proc)


@contextlib.contextmanager
def using_api(api_url: str) -> Iterator[None]:
    """Run the body against the Prefect API at ``api_url`` (e.g. ``http://127.0.0.1:4200/api``):
    ``PREFECT_API_URL`` set in Prefect's settings and in the environment (for subprocesses of
    the flow: process task runners), restored afterwards; at the end the Prefect log and event
    workers are drained, so the run's last logs and events reach that API before it may go away."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    previous = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = api_url
    try:
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            try:
                yield
            finally:
                _drain_prefect_workers()
    finally:
        if previous is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = previous
