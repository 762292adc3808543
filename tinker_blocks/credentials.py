"""``TinkerCredentials``: a Prefect credentials block that hands out ``tinker.ServiceClient``s.

Three backends, one client path (the unmodified ``tinker`` SDK):

- hosted Tinker: ``TinkerCredentials(api_key="tml-...")`` (``base_url`` unset);
- a self-hosted Tinker-compatible server: ``TinkerCredentials(base_url="http://host:8000",
  api_key="tml-...")`` (a shared ``tinker_local``: ``https://...`` with ``ca_bundle`` naming the CA
  that signed its certificate; docs/shared-server.md);
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

import contextlib
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

from prefect.blocks.abstract import CredentialsBlock
from pydantic import ConfigDict, Field, SecretStr, field_validator

from tinker_blocks.docs import docs_url
from tinker_blocks.server_api import check_server_api
from tinker_local import launcher
from tinker_local.launcher import LocalServerError

__all__ = [
    "LocalServerError",
    "TinkerCredentials",
    "close_clients",
    "ensure_local_server",
    "server_command",
    "stop_local_server",
]

LOCAL_API_KEY = "tml-local"

_clients: dict[tuple, Any] = {}
_clients_lock = threading.Lock()


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
    ca_bundle: str | None = Field(
        default=None,
        description=(
            "PEM file of the CA that signed the server's TLS certificate (an https:// base_url with a "
            "private CA); trusted in addition to the public CAs."
        ),
        examples=["/etc/prefect-tinker/ca.pem"],
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
        default=0,
        ge=0,
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
        default=1800.0,
        gt=0,
        description="Longest wait in seconds for one request's result before it fails "
        "(the server is also checked while waiting).",
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

    def backend_name(self) -> str:
        """``"local"`` (embedded server), ``"remote"`` (``base_url`` set) or ``"hosted"``."""
        if self.local:
            return "local"
        return "remote" if self.base_url else "hosted"

    def backend_identity(self) -> str:
        """Where weights are served, as a key: ``local:<root folder>`` or ``<backend_name>:<base_url>``
        (the same ``tinker://`` path on two servers is two different models). Starts nothing."""
        if self.local:
            return f"local:{self.resolved_local_root()}"
        return f"{self.backend_name()}:{self.base_url or ''}"

    def resolved_local_root(self) -> Path:
        """The local server's folder (``local_root`` or :func:`tinker_local.launcher.default_root`), absolute."""
        return (Path(self.local_root).expanduser() if self.local_root else launcher.default_root()).resolve()

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
            OlderServerAPIError: the server at ``base_url`` speaks an older Tinker API than the
                installed SDK (:mod:`tinker_blocks.server_api`; a ValueError).
            LocalServerError: local mode and the server did not start or answer within
                ``local_startup_timeout`` (the message ends with the tail of ``server.log``).
        """
        import tinker

        if self.local:
            key = self._cache_key()
            with _clients_lock:
                cached = _clients.get(key)
            if cached is not None and launcher.healthy(cached[0]):
                return cached[1]
            if cached is not None:  # its server died: stop its session's heartbeat before a new server starts
                _forget_clients({"base_url": cached[0]})
            info = ensure_local_server(self)
            api_key = self.api_key.get_secret_value() if self.api_key else LOCAL_API_KEY
            client = tinker.ServiceClient(base_url=info["base_url"], api_key=api_key)
            with _clients_lock:
                _clients[key] = (info["base_url"], client)
            return client
        api_key = self._remote_api_key()
        if self.ca_bundle:
            trust_ca_bundle(Path(self.ca_bundle).expanduser())
        key = self._cache_key(api_key)
        with _clients_lock:
            cached = _clients.get(key)
        if cached is not None:
            return cached[1]
        if self.base_url:  # a self-hosted server: one line now if it speaks an older API than the SDK
            check_server_api(self.base_url, api_key)
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
# The process launcher itself is tinker_local.launcher; these bind it to a block's settings.


def trust_ca_bundle(ca: Path) -> Path:
    """Make this process's HTTPS clients (the tinker SDK's httpx client among them) trust the
    CA certificates in PEM file ``ca`` besides the public ones: ``SSL_CERT_FILE`` is pointed at a
    bundle of certifi's CAs, the file ``SSL_CERT_FILE`` named before, and ``ca`` (httpx reads
    ``SSL_CERT_FILE`` when it creates a client).  Returns the bundle's path.

    Raises:
        ValueError: ``ca`` is not a readable file holding a PEM certificate.
    """
    import tempfile

    import certifi

    try:
        extra = ca.read_text()
    except OSError as e:
        raise ValueError(f"TinkerCredentials.ca_bundle: cannot read {ca}: {e.strerror}") from None
    if "-----BEGIN CERTIFICATE-----" not in extra:
        raise ValueError(f"TinkerCredentials.ca_bundle: {ca} holds no PEM certificate")
    parts = [Path(certifi.where()).read_text()]
    current = os.environ.get("SSL_CERT_FILE")
    if current and Path(current).is_file():
        parts.append(Path(current).read_text())
    if extra in "".join(parts):
        return Path(current or certifi.where())
    parts.append(extra)
    text = "\n".join(parts)
    bundle = Path(tempfile.gettempdir()) / f"prefect-tinker-ca-{hashlib.sha256(text.encode()).hexdigest()[:16]}.pem"
    if not bundle.is_file():
        tmp = bundle.with_name(f".{bundle.name}.{os.getpid()}")
        tmp.write_text(text)
        os.replace(tmp, bundle)
    os.environ["SSL_CERT_FILE"] = str(bundle)
    return bundle


def server_command(block: TinkerCredentials, port: int, root: Path) -> list[str]:
    """The command starting the local server for ``block`` (:func:`tinker_local.launcher.serve_command`
    with the block's ``local_models``, ``local_device``, ``local_threads``, ``local_sampler_workers``
    and ``local_extra_args``)."""
    return launcher.serve_command(
        port,
        root,
        models=block.local_models,
        device=block.local_device,
        threads=block.local_threads,
        sampler_workers=block.local_sampler_workers,
        extra_args=block.local_extra_args,
    )


def ensure_local_server(block: TinkerCredentials) -> dict:
    """Reuse the healthy server recorded in ``<local_root>/server.json`` or start a new one
    (:func:`tinker_local.launcher.ensure_server` with :func:`server_command`).

    Returns:
        The record ``{"pid", "port", "base_url", "log", "started_at", "command", "identity"}``
        (:func:`tinker_local.launcher.server_identity`). A recorded server with another identity is stopped and
        replaced, unless a session heartbeated to it within the last minute.

    Raises:
        LocalServerError: the server exited early or did not answer ``/api/v1/healthz`` within
            ``block.local_startup_timeout`` seconds (the message includes the log's tail), or a
            stale server is still in use by live sessions (one line saying what differs).
    """
    root = block.resolved_local_root()
    return launcher.ensure_server(
        root,
        lambda port: server_command(block, port, root),
        port=block.local_port,
        startup_timeout=block.local_startup_timeout,
        logger=block.logger,
        api_key=block.api_key.get_secret_value() if block.api_key else LOCAL_API_KEY,
        on_replace=_forget_clients,
    )


def _forget_clients(record: dict) -> None:
    """Drop and close this process's cached SDK clients of a server about to stop (``record``: its
    server.json). While it still answers, their sessions are finished (waiting at most 5 s), so that
    their heartbeats stop instead of warning, for the rest of the process, about a server that is
    gone; the clients of a dead server are closed at once, without finishing their sessions."""
    with _clients_lock:
        gone = [_clients.pop(k)[1] for k in [k for k, v in _clients.items() if v[0] == record["base_url"]]]
    answers = bool(gone) and launcher.healthy(record["base_url"])
    for client in gone:
        closing = client.close("interrupted", detail="the embedded server is stopping")
        if answers:
            with contextlib.suppress(Exception):  # a hung server: the SDK goes on in its own thread
                closing.result(timeout=5)
        else:
            # A dead server: the SDK would retry the finish request for minutes and heartbeat (warning every
            # 10 s from the second minute) until then; closing the session's connection holder (tinker 0.38's
            # ServiceClient._session_holder) ends both at once.
            holder = getattr(client, "_session_holder", None)
            if holder is not None:
                holder.close()


def close_clients(base_url: str) -> None:
    """Close this process's cached SDK clients of the server at ``base_url`` (their sessions finished
    while it still answers), for a caller about to stop a server it started itself; the next
    :meth:`TinkerCredentials.get_client` for that URL makes a new client."""
    _forget_clients({"base_url": base_url})


def stop_local_server(local_root: str | os.PathLike[str] | None = None, timeout: float = 10.0) -> bool:
    """Stop the server recorded in ``<local_root>/server.json`` (SIGTERM, then SIGKILL), remove the
    record; this process's cached clients of it are closed first.

    Returns:
        True if a live server was stopped, False if none was recorded or it was already gone.
    """
    root = Path(local_root).expanduser().resolve() if local_root else launcher.default_root().resolve()
    if (recorded := launcher.read_record(root)) is not None:
        _forget_clients(recorded)
    record = launcher.stop_server(root, timeout=timeout)
    return record is not None and bool(record["stopped"])
