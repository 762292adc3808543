"""``TinkerCredentials``: a Prefect credentials block that hands out ``tinker.ServiceClient``s.

Three backends, one client path (the unmodified ``tinker`` SDK):

- hosted Tinker: ``TinkerCredentials(api_key="tml-...")`` (``base_url`` unset);
- a self-hosted Tinker-compatible server: ``TinkerCredentials(base_url="http://host:8000",
  api_key="tml-...")``;
- the embedded local server: ``TinkerCredentials(local=True)`` starts (or reuses)
  ``python -m tinker_local serve`` on 127.0.0.1 as a detached process and points the SDK at it.

Local mode keeps its state in ``local_root`` (default ``$PREFECT_TINKER_HOME`` or
``~/.prefect-tinker``): ``server.json`` (pid, port, base_url of the running server),
``server.log`` (the server's output) and ``server.lock`` (serialises starts across processes).
A recorded server is reused when its process is alive and ``GET /api/v1/healthz`` answers;
otherwise a new one starts on ``local_port`` (or a free port).  ``get_client`` never hands out a
client for a server that does not answer: the SDK would retry a dead port for ~5 minutes.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from prefect.blocks.abstract import CredentialsBlock
from pydantic import ConfigDict, Field, SecretStr, field_validator

from tinker_blocks.docs import docs_url
from tinker_blocks.local_env import server_environment
from tinker_blocks.procs import pid_alive as _pid_alive

__all__ = [
    "LocalServerError",
    "TinkerCredentials",
    "default_local_root",
    "ensure_local_server",
    "server_command",
    "server_identity",
    "stop_local_server",
]

LOCAL_API_KEY = "tml-local"
HEALTH_PATH = "/api/v1/healthz"
_SERVER_FILE = "server.json"
_LOG_FILE = "server.log"
_LOCK_FILE = "server.lock"

_clients: dict[tuple, Any] = {}
_clients_lock = threading.Lock()


class LocalServerError(RuntimeError):
    """The embedded local server could not be started or did not become healthy."""


def default_local_root() -> Path:
    """``$PREFECT_TINKER_HOME`` if set, else ``~/.prefect-tinker``."""
    env = os.environ.get("PREFECT_TINKER_HOME")
    return Path(env).expanduser() if env else Path.home() / ".prefect-tinker"


class TinkerCredentials(CredentialsBlock):
    """Credentials and connection settings for a Tinker (or Tinker-compatible) service.

    ``get_client()`` returns a ``tinker.ServiceClient`` for the hosted service, for a server at
    ``base_url``, or for an embedded local server this block starts on 127.0.0.1 (``local=True``).

    Example:
        Load stored credentials and create a LoRA training client:
        ```python
        from tinker_blocks import TinkerCredentials

        credentials = TinkerCredentials.load("BLOCK_NAME")
        service_client = credentials.get_client()
        training_client = service_client.create_lora_training_client(base_model="tiny", rank=8)
        ```
    """

    model_config = ConfigDict(hide_input_in_errors=True)  # never echo a bad key in errors

    _block_type_name = "Tinker Credentials"
    _block_type_slug = "tinker-credentials"
    _description = (
        "Connection settings for Tinker: an API key for the hosted service, the URL of a "
        "self-hosted Tinker-compatible server, or an embedded local server started on demand."
    )
    _documentation_url = docs_url("backends")  # type: ignore[assignment]

    api_key: SecretStr | None = Field(
        default=None,
        description=(
            "Tinker API key (starts with 'tml-'). Falls back to the TINKER_API_KEY environment "
            "variable; not needed in local mode."
        ),
    )
    base_url: str | None = Field(
        default=None,
        description="URL of a Tinker-compatible server; leave empty for the hosted Tinker service.",
        examples=["http://gpu-box:8000"],
    )
    local: bool = Field(
        default=False,
        description="Start (or reuse) an embedded local tinker_local server on 127.0.0.1 instead.",
    )
    local_root: str | None = Field(
        default=None,
        description=(
            "Folder of the local server (models, checkpoints, server.json, server.log); "
            "default $PREFECT_TINKER_HOME or ~/.prefect-tinker."
        ),
    )
    local_port: int | None = Field(
        default=None, ge=1, le=65535, description="Port of the local server; empty picks a free port."
    )
    local_models: list[str] = Field(
        default_factory=list,
        description="Models the local server preloads at start (e.g. 'tiny'); others load on first use.",
    )
    local_device: str | None = Field(
        default=None, description="Torch device of the local server ('cpu', 'cuda'); empty picks cuda when present."
    )
    local_threads: int | None = Field(
        default=None, ge=1, description="Torch threads of the local server; empty uses all cores."
    )
    local_sampler_workers: int = Field(
        default=0, ge=0,
        description=(
            "Sampler worker processes of the local server: sampling runs apart from training, so "
            "streaming and async RL overlap them; the server's threads are shared between them. 0 = off."
        ),
    )
    local_extra_args: list[str] = Field(
        default_factory=list, description="Extra command-line arguments for 'python -m tinker_local serve'."
    )
    local_startup_timeout: float = Field(
        default=120.0, gt=0, description="Seconds to wait for a starting local server to answer its health check."
    )
    request_deadline_s: float = Field(
        default=1800.0, gt=0, description="Longest wait in seconds for one request's result before it fails (the server is also checked while waiting)."
    )

    @field_validator("api_key")
    @classmethod
    def _check_key(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and value.get_secret_value() and not value.get_secret_value().startswith("tml-"):
            raise ValueError("api_key must start with 'tml-' (the key itself is not shown)")
        if value is not None and not value.get_secret_value():
            return None
        return value

    @field_validator("base_url")
    @classmethod
    def _check_url(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        value = value.strip().rstrip("/")
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"base_url must start with http:// or https://, got {value!r}")
        return value

    # ------------------------------------------------------------------ public API

    @classmethod
    def local_default(cls, **kwargs: Any) -> "TinkerCredentials":
        """A block for the embedded local server with default settings (overridable by kwargs)."""
        return cls(local=True, **kwargs)

    def backend_name(self) -> str:
        """``"local"`` (embedded server), ``"remote"`` (``base_url`` set) or ``"hosted"``."""
        if self.local:
            return "local"
        return "remote" if self.base_url else "hosted"

    def resolved_local_root(self) -> Path:
        """The local server's folder (``local_root`` or :func:`default_local_root`), absolute."""
        return (Path(self.local_root).expanduser() if self.local_root else default_local_root()).resolve()

    def base_url_for_sdk(self) -> str | None:
        """The ``base_url`` handed to the SDK: the local server's URL (starting it if needed),
        ``base_url``, or None (the SDK's hosted default / ``TINKER_BASE_URL``).

        Raises:
            LocalServerError: local mode and the server cannot be started.
        """
        if self.local:
            return ensure_local_server(self)["base_url"]
        return self.base_url

    def get_client(self) -> Any:
        """A ``tinker.ServiceClient`` for this block's backend, cached per settings in this process.

        Returns:
            ``tinker.ServiceClient`` (lazy: no request is made until it is used).

        Raises:
            ValueError: hosted/remote mode without an API key (field or ``TINKER_API_KEY``), or a
                key not starting with ``tml-``.
            LocalServerError: local mode and the server did not start or answer within
                ``local_startup_timeout`` (the message ends with the tail of ``server.log``).
        """
        import tinker

        if self.local:
            key = self._cache_key()
            with _clients_lock:
                cached = _clients.get(key)
            if cached is not None and _healthy(cached[0]):
                return cached[1]
            info = ensure_local_server(self)
            api_key = self.api_key.get_secret_value() if self.api_key else LOCAL_API_KEY
            client = tinker.ServiceClient(base_url=info["base_url"], api_key=api_key)
            with _clients_lock:
                _clients[key] = (info["base_url"], client)
            return client
        api_key = self._remote_api_key()
        key = self._cache_key(api_key)
        with _clients_lock:
            if key not in _clients:
                _clients[key] = (self.base_url, tinker.ServiceClient(base_url=self.base_url, api_key=api_key))
            return _clients[key][1]

    def stop_local_server(self, timeout: float = 10.0) -> bool:
        """Stop the local server recorded in ``server.json`` (see :func:`stop_local_server`)."""
        return stop_local_server(self.resolved_local_root(), timeout=timeout)

    def restart_local_server(self, timeout: float = 10.0) -> dict:
        """Replace the embedded server after it died or hung: stop the recorded process if it
        still exists (SIGTERM, SIGKILL after ``timeout`` s), forget the cached clients of its URL,
        start a new server. Clients of the old server are useless afterwards: get a new one with
        :meth:`get_client` and recreate training clients from their last checkpoint (the
        checkpoints live in ``local_root`` and survive the restart).

        Returns:
            The new server's record (``pid``, ``port``, ``base_url``, ``log``, ...).

        Raises:
            ValueError: not local mode. LocalServerError: the new server did not start (the
                message ends with the tail of ``server.log``).
        """
        if not self.local:
            raise ValueError("restart_local_server() needs local=True (the embedded server)")
        stop_local_server(self.resolved_local_root(), timeout=timeout)
        return ensure_local_server(self)

    # ------------------------------------------------------------------ helpers

    def _remote_api_key(self) -> str:
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        env = os.environ.get("TINKER_API_KEY", "")
        where = f"the server at {self.base_url}" if self.base_url else "the hosted Tinker service"
        if not env:
            raise ValueError(
                f"TinkerCredentials.api_key is required for {where}: set the block's api_key or "
                "TINKER_API_KEY (or use local=True for the embedded local server)"
            )
        if not env.startswith("tml-"):
            raise ValueError("TINKER_API_KEY must start with 'tml-' (the key itself is not shown)")
        return env

    def _cache_key(self, api_key: str | None = None) -> tuple:
        secret = api_key if api_key is not None else (self.api_key.get_secret_value() if self.api_key else "")
        digest = hashlib.sha256(secret.encode()).hexdigest()  # the key itself is never stored
        if self.local:
            return ("local", str(self.resolved_local_root()), self.local_port, digest)
        return (self.backend_name(), self.base_url, digest)


# ---------------------------------------------------------------------- local server management


def _healthy(base_url: str, timeout: float = 1.0) -> bool:
    """True when ``GET {base_url}/api/v1/healthz`` answers 200."""
    try:
        with urllib.request.urlopen(base_url + HEALTH_PATH, timeout=timeout) as resp:  # noqa: S310
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no server log)"
    tail = text.splitlines()[-lines:]
    return "\n".join(tail) if tail else "(server log is empty)"


def server_command(block: TinkerCredentials, port: int, root: Path) -> list[str]:
    """The command starting the local server: ``python -m tinker_local serve --host 127.0.0.1
    --port P --root DIR`` plus ``--model M`` per preloaded model, ``--device``/``--threads`` when
    set, ``--sampler-workers N`` when N > 0, then ``local_extra_args``."""
    cmd = [sys.executable, "-m", "tinker_local", "serve", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--root", str(root)]
    for model in block.local_models:
        cmd += ["--model", model]
    if block.local_device:
        cmd += ["--device", block.local_device]
    if block.local_threads:
        cmd += ["--threads", str(block.local_threads)]
    if block.local_sampler_workers:
        cmd += ["--sampler-workers", str(block.local_sampler_workers)]
    return cmd + list(block.local_extra_args)


@functools.lru_cache(maxsize=1)
def server_identity() -> dict[str, str]:
    """What the embedded server started by this process runs: ``python`` (the interpreter, symlinks
    resolved: virtualenvs over one base Python with the same code share a server), ``version`` (of
    the prefect-tinker distribution) and ``code`` (``sha256:`` over the path and
    content of every ``.py`` file of the ``tinker_local`` package, in path order). Recorded in
    ``server.json``; a recorded server with another identity is stale (another virtualenv, an
    upgrade, edited server code). Computed once per process."""
    import importlib.metadata
    import importlib.util

    try:
        version = importlib.metadata.version("prefect-tinker")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    spec = importlib.util.find_spec("tinker_local")
    digest = hashlib.sha256()
    if spec is not None and spec.submodule_search_locations:
        pkg = Path(next(iter(spec.submodule_search_locations)))
        for f in sorted(pkg.rglob("*.py")):
            digest.update(f.relative_to(pkg).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return {"python": os.path.realpath(sys.executable), "version": version, "code": "sha256:" + digest.hexdigest()}


def _identity_change(record: dict) -> str | None:
    """How the recorded server's identity differs from :func:`server_identity` (``"code
    sha256:ab.. -> sha256:cd.."``; a record without one: ``"no identity recorded"``), or None."""
    was, now = record.get("identity"), server_identity()
    if not isinstance(was, dict):
        return "no identity recorded (started by an older version)"
    def shown(key: str, value: Any) -> str:  # code hashes: their first 12 hex digits
        return str(value)[:19] if key == "code" else str(value)

    diff = [f"{k} {shown(k, was.get(k))} -> {shown(k, now[k])}" for k in now if was.get(k) != now[k]]
    return ", ".join(diff) or None


def _active_sessions(base_url: str, api_key: str) -> int:
    """Sessions of the server at ``base_url`` in use: whose client heartbeated within the last minute
    (the server's ``active`` status, ``POST /api/v1/sessions/search``) or, not finished, created
    within the last minute (the SDK's first heartbeat comes 10 s after); 0 when it cannot tell."""
    from datetime import datetime

    req = urllib.request.Request(base_url + "/api/v1/sessions/search", data=json.dumps({"limit": 200}).encode(),
                                 headers={"Content-Type": "application/json", "X-API-Key": api_key}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5.0) as resp:  # noqa: S310
            sessions = json.loads(resp.read()).get("sessions") or []
    except (urllib.error.URLError, OSError, ValueError):
        return 0

    def live(s: dict) -> bool:
        status = (s.get("status") or {}).get("type")
        if status is not None:
            return status == "active"
        try:
            created = datetime.fromisoformat(str(s.get("created_at")).replace("Z", "+00:00")).timestamp()
        except ValueError:
            return False
        return time.time() - created < 60.0

    return sum(1 for s in sessions if live(s))


def _read_record(root: Path) -> dict | None:
    try:
        return json.loads((root / _SERVER_FILE).read_text())
    except (OSError, ValueError):
        return None


class _FileLock:
    """Exclusive ``flock`` on ``path`` (no-op where fcntl is unavailable)."""

    def __init__(self, path: Path):
        self.path = path
        self.fh = None

    def __enter__(self) -> "_FileLock":
        self.fh = open(self.path, "a+")
        try:
            import fcntl

            fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX)
        except ImportError:
            pass
        return self

    def __exit__(self, *exc: Any) -> None:
        self.fh.close()  # closing releases the lock


def ensure_local_server(block: TinkerCredentials) -> dict:
    """Reuse the healthy server recorded in ``<local_root>/server.json`` or start a new one.

    Returns:
        The record ``{"pid", "port", "base_url", "log", "started_at", "command", "identity"}``
        (:func:`server_identity`). A recorded server with another identity is stopped and replaced,
        unless a session heartbeated to it within the last minute.

    Raises:
        LocalServerError: the server exited early or did not answer ``/api/v1/healthz`` within
            ``block.local_startup_timeout`` seconds (the message includes the log's tail), or a
            stale server is still in use by live sessions (one line saying what differs).
    """
    root = block.resolved_local_root()
    root.mkdir(parents=True, exist_ok=True)
    with _FileLock(root / _LOCK_FILE):
        record = _read_record(root)
        if (
            record
            and (block.local_port is None or record.get("port") == block.local_port)
            and _pid_alive(int(record.get("pid", -1)))
            and _healthy(record["base_url"])
        ):
            change = _identity_change(record)
            if change is None:
                return record
            # a stale server (another interpreter, version or server code): replace it unless in use
            api_key = block.api_key.get_secret_value() if block.api_key else LOCAL_API_KEY
            busy = _active_sessions(record["base_url"], api_key)
            if busy:
                raise LocalServerError(
                    f"the embedded server at {record['base_url']} (pid {record['pid']}) runs other code ({change}) "
                    f"and {busy} live session(s) still use it; let them finish, then 'prefect-tinker local stop' "
                    f"(or give another backend.local_root)"
                )
            block.logger.warning("Restarting the embedded local server %s (pid %s): %s",
                                 record["base_url"], record["pid"], change)
            _terminate(int(record["pid"]), timeout=10.0)
            (root / _SERVER_FILE).unlink(missing_ok=True)
            with _clients_lock:
                for key in [k for k, v in _clients.items() if v[0] == record["base_url"]]:
                    del _clients[key]
        port = block.local_port or _free_port()
        base_url = f"http://127.0.0.1:{port}"
        if _healthy(base_url):
            raise LocalServerError(
                f"port {port} already serves something not recorded in {root / _SERVER_FILE}; "
                "choose another local_port or leave it empty"
            )
        log_path = root / _LOG_FILE
        cmd = server_command(block, port, root)
        env = server_environment()  # no API keys, cloud secrets or tokens (tinker_blocks/local_env.py)
        with open(log_path, "ab") as log:
            log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=str(root), env=env, start_new_session=True,
            )
        block.logger.info("Starting local Tinker server on %s (pid %d, log %s)", base_url, proc.pid, log_path)
        deadline = time.monotonic() + block.local_startup_timeout
        while not _healthy(base_url, timeout=0.5):
            if proc.poll() is not None:
                raise LocalServerError(
                    f"local Tinker server exited with code {proc.returncode} before answering "
                    f"{base_url}{HEALTH_PATH}; last lines of {log_path}:\n{_log_tail(log_path)}"
                )
            if time.monotonic() > deadline:
                _terminate(proc.pid, timeout=5.0)
                raise LocalServerError(
                    f"local Tinker server did not answer {base_url}{HEALTH_PATH} within "
                    f"{block.local_startup_timeout:g} s (stopped it); last lines of {log_path}:\n{_log_tail(log_path)}"
                )
            time.sleep(0.1)
        record = {
            "pid": proc.pid, "port": port, "base_url": base_url, "log": str(log_path),
            "started_at": time.time(), "command": cmd, "identity": server_identity(),
        }
        tmp = root / (_SERVER_FILE + ".tmp")
        tmp.write_text(json.dumps(record, indent=2))
        tmp.replace(root / _SERVER_FILE)
        return record


def _terminate(pid: int, timeout: float) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    while _pid_alive(pid) and time.monotonic() < deadline + 5:
        time.sleep(0.05)


def stop_local_server(local_root: str | os.PathLike[str] | None = None, timeout: float = 10.0) -> bool:
    """Stop the server recorded in ``<local_root>/server.json`` (SIGTERM, then SIGKILL) and
    remove the record.

    Returns:
        True if a live server was stopped, False if none was recorded or it was already gone.
    """
    root = Path(local_root).expanduser().resolve() if local_root else default_local_root().resolve()
    with _FileLock(root / _LOCK_FILE) if root.exists() else _NullCtx():
        record = _read_record(root)
        if not record:
            return False
        pid = int(record.get("pid", -1))
        alive = pid > 0 and _pid_alive(pid)
        if alive:
            _terminate(pid, timeout)
        (root / _SERVER_FILE).unlink(missing_ok=True)
        with _clients_lock:
            for key in [k for k, v in _clients.items() if v[0] == record.get("base_url")]:
                del _clients[key]
        return alive


class _NullCtx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
