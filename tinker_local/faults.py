"""Fault injection for reliability tests of clients of the local Tinker server.

``FaultConfig(fail_every=N)`` answers every N-th API request with HTTP 503 before it is handled
(the SDK retries 5xx); ``FaultConfig(drop_every=M)`` handles every M-th request and then drops
the connection after the response headers, so the client never gets the body and must retry a
request the server already ran (the server's request-id / ``seq_id`` de-duplication makes the
retry return the original result).  Counted requests are those under ``/api/v1`` except
``/api/v1/healthz`` and ``/api/v1/local_stats``; a request that is both N-th and M-th fails
with 503.

Set from the command line (``serve --fail-every N --drop-every M``) or the environment
(``TINKER_LOCAL_FAIL_EVERY``, ``TINKER_LOCAL_DROP_EVERY``); 0 = off (the default).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("tinker_local.faults")

ENV_FAIL_EVERY = "TINKER_LOCAL_FAIL_EVERY"
ENV_DROP_EVERY = "TINKER_LOCAL_DROP_EVERY"


@dataclass(frozen=True)
class FaultConfig:
    """``fail_every``: every n-th API request gets a 503 (0 = never); ``drop_every``: every
    n-th request runs, then its connection closes before the body (0 = never)."""

    fail_every: int = 0
    drop_every: int = 0

    def __post_init__(self):
        for k in ("fail_every", "drop_every"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{k} must be an integer >= 0, got {v!r}")

    @property
    def active(self) -> bool:
        return bool(self.fail_every or self.drop_every)

    @classmethod
    def from_env(cls, environ: dict | None = None) -> FaultConfig:
        """Read ``TINKER_LOCAL_FAIL_EVERY`` / ``TINKER_LOCAL_DROP_EVERY``; ValueError naming the
        variable if one is not an integer >= 0."""
        env = os.environ if environ is None else environ
        values = {}
        for field_name, var in (("fail_every", ENV_FAIL_EVERY), ("drop_every", ENV_DROP_EVERY)):
            raw = (env.get(var) or "0").strip()
            try:
                values[field_name] = int(raw)
            except ValueError:
                raise ValueError(f"{var} must be an integer >= 0, got {raw!r}") from None
        return cls(**values)


class FaultState:
    """A ``FaultConfig`` and its counters: ``counts`` = requests seen, failed, dropped."""

    def __init__(self, config: FaultConfig, prefix: str = "/api/v1"):
        self.config = config
        self.prefix = prefix
        self.counts = {"requests": 0, "failed": 0, "dropped": 0}
        self._lock = threading.Lock()

    def decide(self, path: str) -> str | None:
        """The action for the next request to ``path``: "fail", "drop" or None (counts it)."""
        if not path.startswith(self.prefix) or path in (f"{self.prefix}/healthz", f"{self.prefix}/local_stats"):
            return None
        with self._lock:
            self.counts["requests"] += 1
            n = self.counts["requests"]
            if self.config.fail_every and n % self.config.fail_every == 0:
                self.counts["failed"] += 1
                return "fail"
            if self.config.drop_every and n % self.config.drop_every == 0:
                self.counts["dropped"] += 1
                return "drop"
        return None


class FaultInjector:
    """ASGI middleware applying ``state`` (a ``FaultState``) to ``app``; use
    ``fastapi_app.add_middleware(FaultInjector, state=...)`` so it wraps everything else."""

    def __init__(self, app: ASGIApp, state: FaultState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        action = self.state.decide(scope.get("path", "")) if scope["type"] == "http" else None
        if action is None:
            return await self.app(scope, receive, send)
        if action == "fail":
            logger.info("fault injection: 503 for %s", scope.get("path"))
            body = json.dumps({"detail": "injected fault (tinker_local --fail-every)"}).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return None

        started: list[Message] = []

        async def hold(message: Message) -> None:  # run the request fully, keep its response to ourselves
            if message["type"] == "http.response.start":
                started.append(message)

        await self.app(scope, receive, hold)
        logger.info("fault injection: dropping the connection of %s after handling it", scope.get("path"))
        if started:  # headers (with the real content-length) but no body: the server closes
            await send(started[0])
        return None
