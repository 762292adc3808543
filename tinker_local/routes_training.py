"""Training and sampling routes of the HTTP layer: models (create, info), forward / backward, the
JSON requests answered with a future (optimizer steps, saves, loads, sampling sessions, samples,
custom losses), sampling sessions, and the futures' polls (``retrieve_future``).

Every request is checked by ``Tenancy.guard`` before the service sees it; saves and loads are
written to the audit log (``tinker_local.tenancy``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .errors import HttpError
from .http_api import API, json_body
from .request_log import SeqOrder
from .service import LocalService
from .tenancy import Tenancy

# audit events of the JSON routes: route -> event (``tinker_local.tenancy`` audit log)
AUDITED = {
    "save_weights": "checkpoint_save",
    "save_weights_for_sampler": "checkpoint_save",
    "save_weights_external": "checkpoint_save",
    "load_weights": "checkpoint_load",
    "create_sampling_session": "checkpoint_load",
}


def add_training_routes(app: FastAPI, svc: LocalService, poll_wait_s: float) -> None:
    """Add the training and sampling routes answered by ``svc`` to ``app``; ``retrieve_future``
    holds a poll of a pending request up to ``poll_wait_s`` seconds before answering HTTP 408
    ``{"type": "try_again"}``."""
    ten = svc.tenancy

    def route(method: str, path: str):
        return app.api_route(f"{API}{path}", methods=[method])

    @route("POST", "/create_model")
    async def create_model(request: Request):
        body = await json_body(request)
        ten.guard("create_model", body)
        out = svc.create_model(body)
        ten.audit("model_create", model_id=out["model_id"], base_model=body.get("base_model"))
        return out

    @route("POST", "/get_info")
    async def get_info(request: Request):
        body = await json_body(request)
        ten.guard("get_info", body)
        # off the loop: the engine lock may be held by a long job on the compute thread
        return await asyncio.to_thread(svc.get_info, body)

    async def fwd(request: Request, forward_only: bool):
        raw = await request.body()
        return svc.forward_backward(raw, request.headers.get("content-encoding"), forward_only)

    @route("POST", "/forward_backward")
    async def forward_backward(request: Request):
        return await fwd(request, False)

    @route("POST", "/forward")
    async def forward(request: Request):
        return await fwd(request, True)

    for name, handler in svc.json_routes().items():
        # content-seeded sampling counts a session's requests in seq_id order (tinker_local.request_log)
        order = svc.content_seeds.order if name == "asample" and svc.content_seeds is not None else None
        add_json_route(app, name, handler, ten, order)

    @route("GET", "/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        if not ten.owns_sampler(sampler_id):
            raise HttpError(404, f"unknown sampling session {sampler_id!r}")
        return await asyncio.to_thread(svc.sampling.get_sampler, sampler_id)

    @route("POST", "/retrieve_future")
    async def retrieve_future(request: Request):
        body = await json_body(request)
        rid = str(body.get("request_id", ""))
        rec = svc.store.get(rid)
        if rec is None or not ten.may_poll(rec):  # another user's future: as if unknown
            return JSONResponse({"detail": f"unknown or expired request_id {rid!r}"}, status_code=410)
        if rec.outcome is None and rec.event is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(rec.event.wait(), timeout=poll_wait_s)
        out = rec.outcome
        if out is None:
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"}, status_code=408)
        svc.store.mark_delivered(rid)
        if out.error is not None:
            return {"error": out.error, "category": out.category}
        if out.proto is not None:
            return Response(out.proto, media_type="application/x-protobuf")
        return out.json

    @route("POST", "/cancel_future")
    async def cancel_future(request: Request):
        return {}  # work already queued runs to completion; its result is simply never fetched


def add_json_route(
    app: FastAPI,
    name: str,
    handler: Callable[[dict[str, Any]], dict[str, Any]],
    tenancy: Tenancy,
    order: SeqOrder | None = None,
) -> None:
    """``POST /api/v1/<name>``: the JSON body, checked by ``tenancy.guard``, answered by
    ``handler(body)``; the events of ``AUDITED`` are written to the audit log. With ``order``
    (``asample`` under content-seeded sampling), the requests of a sampling session are handled
    in ``seq_id`` order."""

    async def endpoint(request: Request):
        body = await json_body(request)
        refused = tenancy.guard(name, body)
        if refused is not None:
            return refused
        session, seq = body.get("sampling_session_id"), body.get("seq_id")
        if order is None or session is None or not isinstance(seq, int):
            out = handler(body)
        else:
            await order.admit(str(session), seq)
            try:
                out = handler(body)
            finally:
                await order.done(str(session), seq)
        event = AUDITED.get(name)
        path = body.get("model_path") if name == "create_sampling_session" else body.get("path")
        if event is not None and (name != "create_sampling_session" or path):
            tenancy.audit(
                event,
                model_id=out.get("model_id") or body.get("model_id"),
                tinker_path=path if event == "checkpoint_load" else None,
                name=path if event == "checkpoint_save" else None,
                purpose="sampling" if name == "create_sampling_session" else None,
            )
        return out

    endpoint.__name__ = name
    app.add_api_route(f"{API}/{name}", endpoint, methods=["POST"])
