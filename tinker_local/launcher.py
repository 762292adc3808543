"""Start, check and stop the embedded local server as a detached process (no Prefect import).

The server keeps its state in a folder ``root`` (default ``$PREFECT_TINKER_HOME`` or
``~/.prefect-tinker``): ``server.json`` (the record: pid, port, base_url, log, start time and
command of the running server), ``server.log`` (its output) and ``server.lock`` (an ``flock``
serialising starts and stops across processes). A recorded server is reused when its process is
alive and ``GET /api/v1/healthz`` answers 200; otherwise a new one starts.

Used by ``TinkerCredentials(local=True)`` (:mod:`tinker_blocks.credentials`) and by
``python -m tinker_local status|stop`` (:mod:`tinker_local.cli`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from tinker_local import procs
from tinker_local.server_env import server_environment

__all__ = [
    "HEALTH_PATH",
    "active_sessions",
    "identity_change",
    "server_identity",
    "LOG_FILE",
    "SERVER_FILE",
    "LocalServerError",
    "SessionsUnknownError",
    "default_root",
    "ensure_server",
    "healthy",
    "read_record",
    "serve_command",
    "stop_server",
]

HEALTH_PATH = "/api/v1/healthz"
SERVER_FILE = "server.json"
LOG_FILE = "server.log"
LOCK_FILE = "server.lock"

_log = logging.getLogger(__name__)


class LocalServerError(RuntimeError):
    """The embedded local server could not be started or did not become healthy."""


def default_root() -> Path:
    """``$PREFECT_TINKER_HOME`` if set, else ``~/.prefect-tinker`` (user folder expanded)."""
    env = os.environ.get("PREFECT_TINKER_HOME")
    return Path(env).expanduser() if env else Path.home() / ".prefect-tinker"


def healthy(base_url: str, timeout: float = 1.0) -> bool:
    """True when ``GET {base_url}/api/v1/healthz`` answers 200 within ``timeout`` seconds."""
    try:
        with urllib.request.urlopen(base_url + HEALTH_PATH, timeout=timeout) as resp:  # noqa: S310
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def read_record(root: Path) -> dict[str, Any] | None:
    """The record ``<root>/server.json`` of the last server started there, or None when there is
    none or it cannot be read."""
    return procs.read_record(root / SERVER_FILE)


def serve_command(
    port: int,
    root: Path,
    *,
    models: Sequence[str] = (),
    device: str | None = None,
    threads: int | None = None,
    sampler_workers: int = 0,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command starting the server: ``python -m tinker_local serve --host 127.0.0.1 --port P
    --root DIR`` plus ``--model M`` per preloaded model, ``--device``/``--threads`` when set,
    ``--sampler-workers N`` when N > 0, then ``extra_args``."""
    cmd = [sys.executable, "-m", "tinker_local", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--root", str(root)]
    for model in models:
        cmd += ["--model", model]
    if device:
        cmd += ["--device", device]
    if threads:
        cmd += ["--threads", str(threads)]
    if sampler_workers:
        cmd += ["--sampler-workers", str(sampler_workers)]
    return cmd + list(extra_args)


@functools.lru_cache(maxsize=1)
def server_identity() -> dict[str, str]:
    """What a server started by this process would run: ``python`` (the interpreter, symlinks
    resolved), ``version`` (of the prefect-tinker distribution) and ``code`` (``sha256:`` over the
    path and content of every ``.py`` file of the ``tinker_local`` package, in path order).
    Recorded in ``server.json``; a recorded server with another identity is stale (another
    virtualenv, an upgrade, edited server code). Computed once per process."""
    try:
        version = importlib.metadata.version("prefect-tinker")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    pkg = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for f in sorted(pkg.rglob("*.py")):
        digest.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return {"python": os.path.realpath(sys.executable), "version": version, "code": "sha256:" + digest.hexdigest()}


def identity_change(record: dict[str, Any]) -> str | None:
    """How the recorded server's identity differs from :func:`server_identity` (e.g.
    ``"tinker_local code (edited or upgraded) sha256:ab.. -> sha256:cd.."``; a record without one:
    ``"no identity recorded"``), or None."""
    was, now = record.get("identity"), server_identity()
    if not isinstance(was, dict):
        return "no identity recorded (started by an older version)"

    def shown(key: str, value: Any) -> str:  # code hashes: their first 12 hex digits
        return str(value)[:19] if key == "code" else str(value)

    label = {"code": "tinker_local code (edited or upgraded)"}
    diff = [f"{label.get(k, k)} {shown(k, was.get(k))} -> {shown(k, now[k])}" for k in now if was.get(k) != now[k]]
    return ", ".join(diff) or None


class SessionsUnknownError(LocalServerError):
    """The server did not say which of its sessions are in use (an HTTP error such as 401, a
    timeout, an answer that is not a session list); the message says why, in one line."""


def active_sessions(base_url: str, api_key: str, *, timeout: float = 5.0, max_pages: int = 50) -> int:
    """Sessions of the server at ``base_url`` in use: whose client heartbeated within the last
    minute (the server's ``active`` status, ``POST /api/v1/sessions/search``, every page) or, not
    finished, created within the last minute (the SDK's first heartbeat comes 10 s after); a
    session whose status and creation time cannot be read counts as in use.

    Raises:
        SessionsUnknownError: the server did not tell within ``timeout`` seconds per page and
            ``max_pages`` pages of 200 (an HTTP error, a refused key, a timeout, an answer that is
            not a session list). Callers deciding whether a server may be stopped take that as
            "in use".
    """
    sessions: list[Any] = []
    cursor: Any = None
    for _ in range(max_pages):
        body: dict[str, Any] = {"limit": 200} | ({"cursor": cursor} if cursor else {})
        req = urllib.request.Request(
            base_url + "/api/v1/sessions/search",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-API-Key": api_key},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:  # noqa: S310
                page = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            raise SessionsUnknownError(f"its session list answered HTTP {exc.code} {exc.reason}") from None
        except json.JSONDecodeError as exc:
            raise SessionsUnknownError(f"its session list is not JSON ({exc})") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:  # refused, timed out (5 s), bad URL
            reason = getattr(exc, "reason", None) or exc
            raise SessionsUnknownError(f"its session list could not be read ({reason})") from None
        if not isinstance(page, dict) or not isinstance(page.get("sessions"), list):
            raise SessionsUnknownError("its session list answered without a 'sessions' list")
        sessions += page["sessions"]
        cursor = page.get("next_cursor")
        if not cursor:
            break
    else:
        raise SessionsUnknownError(f"its session list has more than {max_pages} pages")

    def live(s: Any) -> bool:
        if not isinstance(s, dict):
            return True
        st = s.get("status")
        if st is not None and not isinstance(st, dict):
            return True  # cannot tell: in use
        status = (st or {}).get("type")
        if status is not None:
            return bool(status == "active")
        try:
            created = datetime.fromisoformat(str(s.get("created_at")).replace("Z", "+00:00")).timestamp()
        except ValueError:
            return True  # cannot tell: in use
        return time.time() - created < 60.0

    return sum(1 for s in sessions if live(s))


def ensure_server(
    root: Path,
    command: Callable[[int], list[str]],
    *,
    port: int | None = None,
    startup_timeout: float = 120.0,
    logger: logging.Logger | logging.LoggerAdapter[Any] | None = None,
    api_key: str = "tml-local",
    on_replace: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Reuse the healthy server recorded in ``<root>/server.json`` (on ``port`` when given) or
    start ``command(port)`` (on ``port`` or a free port) as a detached process with the secret-free
    environment of :func:`tinker_local.server_env.server_environment`, and wait for its health check.
    A recorded server of another :func:`server_identity` (other interpreter, version or server
    code) is stopped and replaced (``on_replace(record)`` is called first, e.g. to drop cached
    clients), unless live sessions use it or it does not say whether they do (asked with
    ``api_key``: a refused key, a timeout or a malformed answer counts as in use).

    Returns:
        The record ``{"pid", "port", "base_url", "log", "started_at", "command"}``.

    Raises:
        LocalServerError: a stale server still in use or that cannot tell whether it is, the
            port serves something unrecorded, or the server exited early or did not answer
            ``/api/v1/healthz`` within ``startup_timeout`` seconds (it is then stopped); the
            message includes the tail of ``server.log``.
    """
    root.mkdir(parents=True, exist_ok=True)
    with procs.file_lock(root / LOCK_FILE):
        record = read_record(root)
        if (
            record
            and (port is None or record.get("port") == port)
            and procs.pid_alive(int(record.get("pid", -1)))
            and healthy(record["base_url"])
        ):
            change = identity_change(record)
            if change is None:
                return record
            where = f"the embedded server at {record['base_url']} (pid {record['pid']}) runs other code ({change})"
            then = "'prefect-tinker local stop' (or give another backend.local_root)"
            try:
                busy = active_sessions(record["base_url"], api_key)
            except SessionsUnknownError as exc:  # any doubt: in use, left running
                raise LocalServerError(
                    f"{where} and it cannot tell whether sessions still use it: {exc}; kept running; "
                    f"when nothing uses it, {then}"
                ) from None
            if busy:
                raise LocalServerError(f"{where} and {busy} live session(s) still use it; let them finish, then {then}")
            (logger or _log).warning(
                "Restarting the embedded local server %s (pid %s): %s", record["base_url"], record["pid"], change
            )
            if on_replace is not None:
                on_replace(record)
            procs.terminate(int(record["pid"]), timeout=10.0)
            (root / SERVER_FILE).unlink(missing_ok=True)
        port = port or procs.free_port()
        base_url = f"http://127.0.0.1:{port}"
        if healthy(base_url):
            raise LocalServerError(
                f"port {port} already serves something not recorded in {root / SERVER_FILE}; "
                "choose another local_port or leave it empty"
            )
        log_path = root / LOG_FILE
        cmd = command(port)
        # no API keys, cloud secrets or tokens in its environment (tinker_local/server_env.py)
        proc = procs.start_detached(cmd, log_path=log_path, cwd=root, env=server_environment())
        (logger or _log).info("Starting local Tinker server on %s (pid %d, log %s)", base_url, proc.pid, log_path)
        procs.wait_ready(
            proc,
            lambda: healthy(base_url, timeout=0.5),
            what="local Tinker server",
            url=base_url + HEALTH_PATH,
            log_path=log_path,
            timeout=startup_timeout,
            poll_s=0.1,
            error=LocalServerError,
            tail_lines=30,
        )
        record = {
            "pid": proc.pid,
            "port": port,
            "base_url": base_url,
            "log": str(log_path),
            "started_at": time.time(),
            "command": cmd,
            "identity": server_identity(),
        }
        procs.write_record(root / SERVER_FILE, record)
        return record


def stop_server(root: Path, timeout: float = 10.0) -> dict[str, Any] | None:
    """Stop the server recorded in ``<root>/server.json`` (:func:`tinker_local.procs.terminate`) and remove the record.

    Returns:
        The removed record with ``"stopped"`` set (True when a live server was stopped, False when
        its process was already gone), or None when no server was recorded.
    """
    if not root.exists():
        return None
    with procs.file_lock(root / LOCK_FILE):
        record = read_record(root)
        if not record:
            return None
        pid = int(record.get("pid", -1))
        alive = pid > 0 and procs.pid_alive(pid)
        if alive:
            procs.terminate(pid, timeout)
        (root / SERVER_FILE).unlink(missing_ok=True)
        return {**record, "stopped": alive}
