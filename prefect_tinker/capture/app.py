"""The capture server's FastAPI app: OpenAI-compatible routes, bearer-token auth, error bodies.

Routes (each also under a client-tag prefix ``/r/<tag>``, e.g. ``/r/agent-a/v1/chat/completions``,
the tag stored as the row's ``client``):

- ``POST /v1/chat/completions``, ``POST /v1/completions`` (JSON or ``stream: true`` SSE);
- ``POST /v1/feedback`` (an extension): ``{"id": <completion id>, "index": 0, "rating": 1 | -1 |
  "good" | "bad" | <number>, "label"?, "comment"?}`` rates a returned sequence (a ``ratings`` row of
  source ``client``; the flywheel's filter reads it as ``rating``);
- ``GET /v1/models``, ``GET /v1/models/{id}``;
- ``GET /health`` (no token; ``{"status": "ok", "session": ..., "pending_rows": ..., "checkpoint": ...}``).

The model is a :class:`~prefect_tinker.capture.model.ModelSource`: a
:class:`~prefect_tinker.capture.model.ServedModel`, or a
:class:`~prefect_tinker.capture.follow.ModelFollower` (``--model alias:LINE@ALIAS``); each request
takes the model current when it arrives.

With a token configured every ``/v1`` route needs ``Authorization: Bearer <token>`` (compared in
constant time); a wrong or missing token answers 401 ``invalid_api_key``. Errors are OpenAI error
bodies ``{"error": {"message", "type", "param", "code"}}`` (400 bad JSON / parameters / context,
401, 404 unknown model or route, 413 body too large, 502 backend failure).
"""

from __future__ import annotations

import hmac
import logging
import re
import time
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefect_tinker.capture.generate import RequestContext, chat_completion, completion
from prefect_tinker.capture.model import ModelSource
from prefect_tinker.capture.recorder import CaptureRecorder
from prefect_tinker.capture.requests import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    FeedbackRequest,
    parse_body,
)
from prefect_tinker.capture.responses import response_body, sse_events

__all__ = ["MAX_BODY_BYTES", "create_app"]

logger = logging.getLogger("prefect_tinker.capture")

#: Largest request body accepted (bytes).
MAX_BODY_BYTES = 16 * 1024 * 1024
_TAG = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def _error(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def create_app(
    model: ModelSource,
    recorder: CaptureRecorder,
    *,
    session_id: str,
    token: str | None = None,
    ratings: CaptureRecorder | None = None,
) -> FastAPI:
    """The ASGI app serving ``model`` and recording every returned sequence with ``recorder``.

    Args:
        model: what to sample from (:func:`~prefect_tinker.capture.model.open_served_model`), or
            a follower of a reference; started when the app starts (a follower then refreshes in the
            background) and stopped when it shuts down.
        recorder: where rows go; closed (flushed) when the app shuts down.
        session_id: the capture session, the ``run_id`` of every row.
        token: bearer token required on ``/v1`` routes (None: no auth, for loopback binds only;
            the CLI enforces that).
        ratings: the recorder of ``ratings`` rows (``POST /v1/feedback``); None: that route
            answers 404.
    """
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        model.start()
        try:
            yield
        finally:
            model.stop()
            recorder.close()
            if ratings is not None:
                ratings.close()

    app = FastAPI(title="prefect-tinker capture", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return _error(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("capture request %s %s failed", request.method, request.url.path)
        return _error(APIError(500, f"internal error: {type(exc).__name__}", type="server_error"))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(APIError(400, f"invalid request: {exc.errors()[0].get('msg')}"))

    def authorize(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise APIError(
                401, "You didn't provide an API key: send 'Authorization: Bearer <token>'", code="invalid_api_key"
            )
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise APIError(401, "Incorrect API key provided", code="invalid_api_key")

    def context(request: Request, tag: str | None, user: str | None) -> RequestContext:
        if tag is not None and not _TAG.match(tag):
            raise APIError(400, f"client tag {tag!r} in the path must be 1-64 characters from A-Z a-z 0-9 . _ -")
        return RequestContext(run_id=session_id, client=tag or user or request.headers.get("user-agent"))

    async def body(request: Request) -> bytes:
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
            raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
        return raw

    async def answer(request: Request, tag: str | None, cls: type, run: Any) -> Any:
        started_at = time.monotonic()
        authorize(request)
        req = parse_body(await body(request), cls)
        ctx = context(request, tag, req.user)
        ctx.started = started_at
        gen = await run(model.current(), req, ctx)  # the model of this request, to its end
        recorder.record(gen.rows)
        if req.stream:
            return StreamingResponse(
                sse_events(gen, req.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return JSONResponse(response_body(gen))

    def models_list() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(n) for n in model.current().names]}

    def _model_card(name: str) -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": started, "owned_by": "prefect-tinker"}
        if model.current().max_context:
            card["max_model_len"] = model.current().max_context
        return card

    async def feedback(request: Request) -> dict[str, Any]:
        authorize(request)
        if ratings is None:
            raise APIError(404, "this server records no feedback", code="not_found")
        req = parse_body(await body(request), FeedbackRequest)
        row = {
            "run_id": session_id,
            "request_id": req.id,
            "sequence_index": req.index,
            "source": "client",
            "rating": req.rating,
            "label": req.label,
            "comment": req.comment,
        }
        ratings.record([row])
        return {"object": "feedback", "id": req.id, "index": req.index, "rating": req.rating}

    for prefix in ("", "/r/{tag}"):

        def routes(prefix: str = prefix) -> None:
            @app.post(prefix + "/v1/chat/completions")
            async def chat(request: Request, tag: str | None = None):
                return await answer(request, tag, ChatCompletionRequest, chat_completion)

            @app.post(prefix + "/v1/completions")
            async def complete(request: Request, tag: str | None = None):
                return await answer(request, tag, CompletionRequest, completion)

            @app.post(prefix + "/v1/feedback")
            async def rate(request: Request, tag: str | None = None):
                return await feedback(request)

            @app.get(prefix + "/v1/models")
            async def models(request: Request, tag: str | None = None):
                authorize(request)
                return models_list()

            @app.get(prefix + "/v1/models/{model_id:path}")
            async def model_card(request: Request, model_id: str, tag: str | None = None):
                authorize(request)
                model.current().check_model(model_id)
                return _model_card(model_id)

        routes()

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "session": session_id,
            "pending_rows": recorder.pending,
            "flush_errors": recorder.stats["flush_errors"],
            "checkpoint": model.current().checkpoint,
        }

    return app
