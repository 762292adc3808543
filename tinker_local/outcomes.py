"""What a request of the local Tinker server comes to: its ``FutureRecord`` (polled by the SDK's
``retrieve_future``) and the ``Outcome`` of running its work.

Results are ``Outcome``s: JSON dicts, protobuf bytes, or an error with category "user" |
"server" (the SDK's ``RequestErrorCategory`` values, lower case on the wire).  Which errors are
the caller's: ``is_user_error``.  The queueing and the compute thread: ``tinker_local.futures``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .tenancy import LOCAL_USER

logger = logging.getLogger("tinker_local.futures")


class UserError(ValueError):
    """A request the caller got wrong; its future fails with category "user"."""


@dataclass
class Outcome:
    """The result of a job: exactly one of ``json``, ``proto`` or ``error`` is set."""

    json: dict[str, Any] | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "server"


class FutureRecord:
    """State of one request id; ``event`` fires (on the server loop) when it completes."""

    def __init__(self, request_id: str, kind: str, loop: asyncio.AbstractEventLoop | None, user: str = LOCAL_USER):
        self.request_id = request_id
        self.kind = kind
        self.user = user  # only this user may poll it
        self.created = time.time()
        self.outcome: Outcome | None = None
        self.completed_at: float | None = None
        self.delivered_at: float | None = None
        self._loop = loop
        self.event = asyncio.Event() if loop is not None else None
        self._thread_event = threading.Event()

    def complete(self, outcome: Outcome) -> None:
        self.outcome = outcome
        self.completed_at = time.time()
        self._thread_event.set()
        if self.event is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self.event.set)
            except RuntimeError:  # loop closed during shutdown
                pass

    def wait_blocking(self, timeout: float | None = None) -> bool:
        """Block the calling (non-loop) thread until done; True when complete."""
        return self._thread_event.wait(timeout)


def execute(
    kind: str, request_id: str, fn: Callable[[], Any] | None, model_id: str | None = None, seq_id: int | None = None
) -> Outcome:
    """Run ``fn`` of request ``request_id`` (its ``kind``; ``model_id`` and ``seq_id`` for the log)
    and turn what it returns or raises into an ``Outcome``: an ``Outcome`` as is, bytes as
    protobuf, anything else as JSON; a user error (``is_user_error``) fails with category
    "user", any other exception with "server" (logged with its traceback)."""
    t0 = time.monotonic()
    try:
        if fn is None:
            raise RuntimeError(f"{kind}: a batched job runs through its batch_fn")
        result = fn()
        if isinstance(result, Outcome):
            outcome = result
        elif isinstance(result, (bytes, bytearray)):
            outcome = Outcome(proto=bytes(result))
        else:
            outcome = Outcome(json=result)
    except Exception as e:  # mapped to the SDK's error categories
        if is_user_error(e):
            outcome = Outcome(error=f"{type(e).__name__}: {e}", category="user")
            logger.info("%s %s failed (user error): %s", kind, request_id, e)
        else:
            outcome = Outcome(error=f"internal error in {kind}: {type(e).__name__}: {e}", category="server")
            logger.error("%s %s failed:\n%s", kind, request_id, traceback.format_exc())
    logger.info(
        "%s %s%s done in %.3fs%s",
        kind,
        request_id,
        f" (model {model_id} seq {seq_id})" if seq_id is not None else "",
        time.monotonic() - t0,
        " [error]" if outcome.error else "",
    )
    return outcome


def is_user_error(e: BaseException) -> bool:
    """UserError, ProtocolError and the engine's EngineUserError count as user errors."""
    if isinstance(e, UserError):
        return True
    from .protocol import ProtocolError

    if isinstance(e, ProtocolError):
        return True
    for cls in type(e).__mro__:
        if cls.__name__ in ("EngineUserError", "UnknownModelError"):
            return True
    return False
