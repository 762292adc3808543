"""Waiting on a Tinker server without waiting forever (no Prefect import).

The SDK retries a vanished server for minutes per request and polls a pending future without
end; a run waiting on a killed embedded server would print heartbeat warnings and hang.
:func:`wait_result` waits on an SDK future in slices of ``poll_s`` seconds and, between slices,
checks the server (:class:`ServerProbe`):

- the embedded local server (``TinkerCredentials(local=True)``): its recorded process must exist
  and its port must answer ``GET /api/v1/healthz``; a dead process ends the wait at once, a port
  that does not answer for ``unanswered_s`` seconds too -- :class:`ServerGone` naming the URL, the
  pid, the log file and the log's last lines;
- a remote or hosted server: its base URL must answer (any HTTP status counts as an answer) --
  :class:`ServerGone` after ``unanswered_s`` seconds of silence;
- every server: no result after ``deadline_s`` seconds -- :class:`ServerDeadline`.

On either error the SDK future is cancelled. :class:`ServerGone` is a ``ConnectionError``
(transient for the task retry policy): the caller restarts the embedded server
(``TinkerCredentials.restart_local_server()``), drops its clients and recreates the training
client from the last checkpoint.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinker_local.launcher import HEALTH_PATH, read_record

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials
from tinker_local.procs import pid_alive

__all__ = ["DEFAULT_DEADLINE_S", "ServerDeadline", "ServerGone", "ServerProbe", "server_answers", "wait_result"]

log = logging.getLogger(__name__)

#: default longest wait for one result (seconds): far above a step of a large model
DEFAULT_DEADLINE_S = 1800.0


class ServerGone(ConnectionError):
    """The Tinker server a request waits on is gone (process exited, or no answer for too long).
    Attributes: ``url``, ``pid`` (None for remote servers), ``log_path`` (None for remote), ``reason``."""

    def __init__(self, message: str, *, url: str, reason: str, pid: int | None = None, log_path: str | None = None):
        super().__init__(message)
        self.url, self.reason, self.pid, self.log_path = url, reason, pid, log_path


class ServerDeadline(TimeoutError):
    """No result from the server within the deadline (``url``, ``deadline_s``)."""

    def __init__(self, message: str, *, url: str, deadline_s: float):
        super().__init__(message)
        self.url, self.deadline_s = url, deadline_s


def server_answers(base_url: str, timeout: float = 2.0) -> bool:
    """Whether anything answers HTTP at ``base_url`` (``GET /api/v1/healthz``; any status code
    counts: a hosted service may not have that route)."""
    try:
        with urllib.request.urlopen(base_url.rstrip("/") + HEALTH_PATH, timeout=timeout):  # noqa: S310
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _tail(path: str | None, lines: int = 12) -> str:
    if not path:
        return ""
    try:
        text = Path(path).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "\n".join(text)


@dataclass
class ServerProbe:
    """What to check about one server: its ``base_url``, and for the embedded server its
    process ``pid`` and ``log_path``. Make one with :meth:`of` when the client is created."""

    base_url: str
    pid: int | None = None
    log_path: str | None = None

    @classmethod
    def of(cls, credentials: TinkerCredentials) -> ServerProbe:
        """The probe of ``credentials``' server: for ``local=True`` the server recorded in its
        ``server.json`` (not started here), else the block's ``base_url`` (the SDK's default
        hosted URL when empty).

        Raises:
            ServerGone: local mode and no server is recorded.
        """
        if credentials.local:
            root = credentials.resolved_local_root()
            record = read_record(root)
            if not record:
                raise ServerGone(
                    f"no local Tinker server is recorded in {root / 'server.json'}",
                    url="(none)",
                    reason="not recorded",
                    log_path=str(root / "server.log"),
                )
            return cls(record["base_url"], int(record["pid"]), record.get("log"))
        from tinker.lib.base_url import resolve_base_url  # the SDK's own default and TINKER_BASE_URL

        return cls(resolve_base_url(credentials.base_url))

    def dead_reason(self) -> str | None:
        """Why the server is certainly gone (its process exited), else None."""
        if self.pid is not None and not pid_alive(self.pid):
            return f"its process {self.pid} exited"
        return None

    def gone(self, reason: str, what: str) -> ServerGone:
        where = (
            f"the local Tinker server at {self.base_url} (pid {self.pid})"
            if self.pid
            else f"the Tinker server at {self.base_url}"
        )
        msg = f"{where} is gone while waiting for {what}: {reason}"
        if self.log_path:
            tail = _tail(self.log_path)
            msg += f"; its log: {self.log_path}" + (f" (last lines:\n{tail})" if tail else "")
        return ServerGone(msg, url=self.base_url, reason=reason, pid=self.pid, log_path=self.log_path)


def _cancel(future: Any) -> None:
    try:
        inner = future.future() if hasattr(future, "future") else future
        inner.cancel()
    except Exception:  # cancelling is best effort
        pass


def wait_result(
    future: Any,
    server: ServerProbe | TinkerCredentials,
    *,
    deadline_s: float = DEFAULT_DEADLINE_S,
    poll_s: float = 2.0,
    unanswered_s: float = 30.0,
    what: str = "a request",
) -> Any:
    """``future.result()`` of an SDK future (``tinker.APIFuture`` or ``concurrent.futures.Future``),
    watching the server while it is pending (see the module docstring).

    Args:
        server: a :class:`ServerProbe`, or a ``TinkerCredentials`` block (probed now).
        deadline_s: the longest wait in seconds.
        poll_s: seconds between two server checks.
        unanswered_s: seconds the server may leave its port unanswered before it counts as gone.
        what: the request, for messages (``"forward_backward of run sft-1"``).

    Returns:
        The future's result (its own exception is raised as is).

    Raises:
        ServerGone: the server's process exited or it did not answer for ``unanswered_s``.
        ServerDeadline: no result within ``deadline_s``.
    """
    probe = server if isinstance(server, ServerProbe) else ServerProbe.of(server)
    inner = future.future() if hasattr(future, "future") else future
    start = last_answer = last_note = time.monotonic()
    while True:
        done, _ = cf.wait([inner], timeout=poll_s)
        if done:
            return future.result()
        now = time.monotonic()
        reason = probe.dead_reason()
        if reason is None:
            if server_answers(probe.base_url, timeout=min(2.0, max(poll_s, 0.2))):
                last_answer = time.monotonic()
            elif time.monotonic() - last_answer > unanswered_s:
                reason = f"it has not answered {probe.base_url}{HEALTH_PATH} for {time.monotonic() - last_answer:.0f} s"
        if reason is not None:
            if inner.done():  # finished meanwhile: its result wins
                return future.result()
            _cancel(future)
            raise probe.gone(reason, what)
        if now - start > deadline_s:
            _cancel(future)
            raise ServerDeadline(
                f"no result for {what} from the Tinker server at {probe.base_url} within "
                f"{deadline_s:g} s (the server answers its health check, but this request "
                "is stuck)",
                url=probe.base_url,
                deadline_s=deadline_s,
            )
        if now - last_note >= 60.0:
            log.info("still waiting for %s from %s (%.0f s)", what, probe.base_url, now - start)
            last_note = now
