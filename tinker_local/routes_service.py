"""Service routes of the HTTP layer: health, client configuration, JWT exchange, telemetry,
sessions (create, heartbeat, finish, listing, search, project, trace export), server capabilities
and ``tinker_local``'s own counters (``GET /api/v1/local_stats``).

A session of another user answers 404 as an unknown one (``tinker_local.tenancy``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from .auth import is_api_key
from .errors import HttpError
from .faults import FaultState
from .http_api import API, json_body
from .keys import KeyStore
from .service import LocalService
from .tenancy import CURRENT


def add_service_routes(
    app: FastAPI, svc: LocalService, fault_state: FaultState, sampler_pool: Any, keys: KeyStore
) -> None:
    """Add the service routes answered by ``svc`` to ``app``; ``fault_state``, ``sampler_pool``
    (a ``tinker_local.sampler_pool.SamplerPool`` or None) and ``keys`` (the users) feed
    ``local_stats``."""
    ten = svc.tenancy

    def route(method: str, path: str):
        return app.api_route(f"{API}{path}", methods=[method])

    @route("GET", "/healthz")
    async def healthz():
        return {"status": "ok"}

    @route("POST", "/client/config")
    async def client_config(request: Request):
        # API-key auth, sampling futures polled one by one; custom losses run here when enabled.
        return {
            "pjwt_auth_enabled": svc.jwt is not None,
            "sample_use_retrieve_futures": False,
            "custom_loss_server_side": bool(svc.custom_loss_server_side),
            "sample_join_sampling_session": False,
        }

    @route("POST", "/client/dynamic_config")
    async def client_dynamic_config(request: Request):
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @route("POST", "/auth/token")
    async def auth_token(request: Request):
        if svc.jwt is None:
            raise HttpError(404, "JWT auth is off on this server (serve --jwt-auth turns it on)")
        if not is_api_key(request.headers.get("x-api-key", "")):
            raise HttpError(401, "auth/token: exchange an API key starting with 'tml-'")
        return {"jwt": svc.jwt.mint(CURRENT.get().name)}

    @route("POST", "/telemetry")
    async def telemetry(request: Request):
        return {"status": "accepted"}

    @route("POST", "/create_session")
    async def create_session(request: Request):
        out = svc.create_session(await json_body(request))
        ten.audit("session_create", session_id=out["session_id"])
        return out

    @route("POST", "/session_heartbeat")
    async def session_heartbeat(request: Request):
        body = await json_body(request)
        if not ten.may_use_session(str(body.get("session_id"))):
            raise HttpError(404, f"session_heartbeat: unknown session {body.get('session_id')!r}")
        return svc.heartbeat(body)

    @route("POST", "/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request):
        if not ten.may_use_session(session_id):
            raise HttpError(404, f"unknown session {session_id!r}")
        return svc.finish_session(session_id, await json_body(request))

    @route("GET", "/get_server_capabilities")
    async def get_server_capabilities():
        return await asyncio.to_thread(svc.rest.capabilities)

    @route("GET", "/local_stats")
    async def local_stats():
        # tinker_local only: the caller's own counters; an admin key (and the one user of a server
        # without keys) also sees every user's and the server's (compute thread, faults, workers)
        me = CURRENT.get()
        mine = await asyncio.to_thread(ten.counters, me.name)
        if not me.admin:
            return {"user": me.name, "counters": mine}
        users = set(svc.store.compute.user_totals()) | {e.name for e in keys.entries()} | {me.name}
        return {
            "user": me.name,
            "counters": mine,
            "users": {u: await asyncio.to_thread(ten.counters, u) for u in sorted(users)},
            "compute": dict(svc.store.stats),
            "requests": dict(svc.request_counts),
            "sampling": svc.sampling.sampling_stats,
            "engine": dict(svc.engine.stats),
            "faults": dict(fault_state.counts),
            "fault_config": {"fail_every": fault_state.config.fail_every, "drop_every": fault_state.config.drop_every},
            "sampler_workers": sampler_pool.stats() if sampler_pool is not None else None,
            "base_models": svc.engine.resident_bases(),
        }

    @route("GET", "/sessions")
    async def list_sessions(limit: int = 20, offset: int = 0):
        return svc.sessions.list_sessions(limit, offset)

    @route("POST", "/sessions/search")
    async def search_sessions(request: Request):
        return svc.sessions.search_sessions(await json_body(request))

    @route("GET", "/sessions/{session_id}")
    async def get_session(session_id: str):
        return svc.sessions.get_session(session_id)

    @route("PUT", "/sessions/{session_id}/project")
    async def assign_session_project(session_id: str, request: Request):
        return svc.sessions.assign_session_project(session_id, await json_body(request))

    @route("GET", "/sessions/{session_id}/trace_export")
    async def trace_export(session_id: str, request: Request):
        out = await asyncio.to_thread(svc.sessions.trace_export, session_id, str(request.base_url))
        ten.audit("trace_download", session_id=session_id)
        return out
