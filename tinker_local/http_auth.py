"""Who calls the HTTP layer, and what it answered: authentication, request counts, the access log.

``AuthCountLog`` is the server app's ASGI middleware; the rules it applies (API keys, JWTs, the
loopback-only server without keys) are in the ``tinker_local.server`` docstring, and the caller it
finds is ``tinker_local.tenancy.CURRENT`` while the request is handled.
"""

from __future__ import annotations

import json
import logging
import time

from fastapi.responses import JSONResponse

from .auth import InvalidToken, is_api_key, looks_like_jwt
from .http_api import API
from .keys import KeyStore
from .service import LocalService
from .tenancy import CURRENT, LOCAL_PRINCIPAL, Principal, is_loopback

logger = logging.getLogger("tinker_local.server")

# polled routes: logged at debug level when they answer 200 or 408
QUIET_ROUTES = ("/retrieve_future", "/session_heartbeat", "/healthz", "/telemetry", "/client/dynamic_config")


async def _no_body():
    return {"type": "http.request", "body": b"", "more_body": False}


class AuthCountLog:
    """Pure ASGI middleware (a ``BaseHTTPMiddleware`` costs several ms per request on a busy
    loop): authentication (not for healthz; see ``authenticate``) setting ``tenancy.CURRENT``
    for the request, the body size bound (``max_body_bytes``: a longer body, by its
    Content-Length or as it streams in, is answered 413 before a handler reads it), per-route
    request counts, the access log (debug level for polls; never a key), and the count of
    ``asample`` requests being received (the sampling batcher waits for them)."""

    def __init__(self, app, service: LocalService, keys: KeyStore, max_body_bytes: int | None = None):
        self.app = app
        self.svc = service
        self.keys = keys
        self.max_body_bytes = max_body_bytes

    def authenticate(self, scope) -> Principal | JSONResponse:
        """The caller of ``scope``, or the refusal to answer: 401 for a missing, unknown or revoked
        key (or an invalid JWT), 403 for a non-loopback caller of a server without keys."""
        key = dict(scope["headers"]).get(b"x-api-key", b"").decode("latin-1")
        user = None
        if self.svc.jwt is not None and looks_like_jwt(key):
            try:
                user = self.svc.jwt.user_of(key)
            except InvalidToken as e:
                return JSONResponse(
                    {"detail": str(e)}, status_code=401, headers={"WWW-Authenticate": 'Bearer error="invalid_token"'}
                )
        if self.keys.any():
            if user is not None:  # a JWT: its user must still hold a key
                entry = next((e for e in self.keys.entries() if e.name == user), None)
            else:
                entry = self.keys.lookup(key)
            if entry is None:
                return JSONResponse(
                    {
                        "detail": "unknown or revoked API key (X-API-Key); ask the server's "
                        "admin for one: prefect-tinker local keys add NAME"
                    },
                    status_code=401,
                    headers={"WWW-Authenticate": 'Bearer error="invalid_token"'} if user is not None else None,
                )
            return Principal(entry.name, admin=entry.admin)
        client = scope.get("client")
        if client is not None and not is_loopback(client[0]):
            return JSONResponse(
                {
                    "detail": "this server has no API keys and answers loopback callers "
                    "only; its admin adds one with: prefect-tinker local keys add NAME"
                },
                status_code=403,
            )
        if user is None and not is_api_key(key):
            return JSONResponse(
                {"detail": "X-API-Key header must hold an API key starting with 'tml-'"}, status_code=401
            )
        return LOCAL_PRINCIPAL

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, t0 = scope["path"], time.monotonic()
        token = None
        if path.startswith(API) and path != f"{API}/healthz":
            who = self.authenticate(scope)
            if isinstance(who, JSONResponse):
                logger.info("%s %s -> %d (%s)", scope["method"], path, who.status_code, json.loads(who.body)["detail"])
                return await who(scope, receive, send)
            token = CURRENT.set(who)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        sampling = path == f"{API}/asample"
        if sampling:
            self.svc.store.incoming(+1)
        try:
            if self.max_body_bytes is not None and path.startswith(API):
                receive = await self._bounded_body(scope, receive)
                if receive is None:
                    too_large = JSONResponse(
                        {
                            "detail": f"request limit: {scope['method']} {path}: the body is over the limit of "
                            f"{self.max_body_bytes} bytes (serve --max-body-bytes)"
                        },
                        status_code=413,
                    )
                    return await too_large(scope, _no_body, send_status)
            await self.app(scope, receive, send_status)
        finally:
            if sampling:
                self.svc.store.incoming(-1)
            key = getattr(scope.get("route"), "path", None) or "(no route)"  # bounded key set
            self.svc.request_counts[key] = self.svc.request_counts.get(key, 0) + 1
            quiet = path.endswith(QUIET_ROUTES) and status[0] in (200, 408)
            logger.log(
                logging.DEBUG if quiet else logging.INFO,
                "%s %s -> %d (%.1f ms) %s",
                scope["method"],
                path,
                status[0],
                (time.monotonic() - t0) * 1000,
                CURRENT.get().name,
            )
            if token is not None:
                CURRENT.reset(token)

    async def _bounded_body(self, scope, receive):
        """Read the request body (at most ``max_body_bytes``) and return a ``receive`` that replays
        it; None when it is longer (by its Content-Length, before reading, or as it arrives)."""
        limit = self.max_body_bytes or 0
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                if int(length) > limit:
                    return None
            except ValueError:
                return None
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                break
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return None
            chunks.append(body)
            more = message.get("more_body", False)
        data = b"".join(chunks)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": data, "more_body": False}
            return await receive()

        return replay
