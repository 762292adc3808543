"""HTTP layer of ``tinker_local``: a Tinker-API-compatible server (tinker SDK 0.38 wire protocol).

Point the unmodified SDK at it with ``tinker.ServiceClient(base_url="http://127.0.0.1:PORT",
api_key="tml-local")``. Every route lives under ``/api/v1``; every route except
``GET /api/v1/healthz`` needs an ``X-API-Key`` header: one of the server's keys
(``prefect-tinker local keys add NAME``; 401 for an unknown or revoked one), or, while the server
has no keys, any key starting with ``tml-`` from a loopback caller (others: 403).  Each key's user
sees only what its requests made (``tinker_local.tenancy``).
See tinker_local/PROTOCOL.md for the protocol facts this relies on.

This module assembles the app: the service (``tinker_local.service``), the middleware
(``tinker_local.http_auth``), the route groups (``tinker_local.routes_service``,
``tinker_local.routes_training``, ``tinker_local.routes_rest``) and the expired-checkpoint
sweeper; ``tinker_local.serve`` runs it as a process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from .allowed_models import ModelAllowList
from .auth import JwtIssuer
from .errors import HttpError
from .faults import FaultConfig, FaultInjector, FaultState
from .http_auth import AuthCountLog
from .keys import KeyStore
from .loss_limits import GraphLimits
from .openapi import describe_bodies
from .request_limits import RequestLimits
from .request_log import ContentSeeds, RequestLog
from .routes_rest import add_rest_routes
from .routes_service import add_service_routes
from .routes_training import add_training_routes
from .service import LocalService
from .signing import load_secret
from .tenancy import Limits

logger = logging.getLogger("tinker_local.server")

# errors of a handler reading a request field of the wrong type or shape: answered 422 (see create_app)
MALFORMED = (TypeError, ValueError, AttributeError, KeyError, IndexError, OverflowError, RecursionError)
SWEEP_EVERY_S = 60.0  # expired checkpoints are deleted at least this often (and on every lookup)


def create_app(
    engine: Any,
    root: Path | str | None = None,
    *,
    models: list[str] | None = None,
    poll_wait_s: float = 20.0,
    gap_timeout_s: float = 30.0,
    datum_cls: type | None = None,
    faults: FaultConfig | None = None,
    batch_quiet_s: float = 0.05,
    batch_max_wait_s: float = 0.1,
    custom_loss_server_side: bool = True,
    url_ttl_s: float = 3600.0,
    jwt_auth: bool = False,
    sampler_pool: Any = None,
    limits: Limits | None = None,
    record_requests: Path | str | None = None,
    content_seeds: bool = False,
    default_lora_seed: int | None = None,
    request_limits: RequestLimits | None = None,
    graph_limits: GraphLimits | None = None,
) -> FastAPI:
    """Build the FastAPI app speaking the tinker 0.38 protocol in front of ``engine``.

    Args:
        engine: an object with the ``tinker_local.engine.Engine`` interface.
        root: server root folder (registry at ``root/server/registry.jsonl``); defaults to
            ``engine.root`` of a ``tinker_local.engine.Engine``.
        models: base model names announced by ``get_server_capabilities``.
        poll_wait_s: how long ``retrieve_future`` holds a poll for a pending request before
            answering HTTP 408 ``{"type": "try_again"}`` (the SDK polls again at once).
        gap_timeout_s: how long a model waits for a missing seq_id before skipping it.
        faults: fault injection (``tinker_local.faults``); None or all zero = off.
        batch_quiet_s, batch_max_wait_s: how long a sampling request waits for more to batch
            with it: while they keep arriving less than ``batch_quiet_s`` apart or are still
            being received, at most ``batch_max_wait_s`` and at most a quarter of the batch's
            expected compute time (seconds; ``tinker_local.futures``).
        custom_loss_server_side: advertise and run uploaded custom losses (client config flag;
            off: the SDK runs ``create_custom_loss`` losses client-side).
        url_ttl_s: lifetime of signed download URLs (external weights, session traces), seconds.
        jwt_auth: exchange API keys for short-lived JWTs (``tinker_local.auth``; client config
            ``pjwt_auth_enabled``), which ``RestClient.whoami`` needs; API keys stay accepted.
        sampler_pool: a ``tinker_local.sampler_pool.SamplerPool`` serving all sampling in worker
            processes while the engine trains (None: the engine samples in turn with training);
            the app closes it at shutdown.
        limits: per-user limits (``tinker_local.tenancy.Limits``; None: none).  The API keys are
            read from ``root/server/api_keys.json`` (``tinker_local.keys``) on every change; with
            keys, only the base models of ``models`` and of the allow-list
            (``tinker_local.allowed_models``) may be loaded.
        request_limits: sizes of one request (``tinker_local.request_limits``; None: the defaults).
        graph_limits: bounds of uploaded custom losses (``tinker_local.loss_limits``; None: the
            defaults).
        record_requests: a folder: every request's payload goes to ``<folder>/<session>.jsonl``
            (``tinker_local.request_log``); None: nothing recorded.
        content_seeds: draw each sampled sequence with a seed derived from the request's content
            (``tinker_local.request_log.content_seed``) instead of the request's own seed.
        default_lora_seed: LoRA initialisation seed of a ``create_model`` that gives none (None:
            random).
    Raises:
        ValueError: when no root is given and the engine has none.
    """
    if root is None:
        from .engine_core import EngineCore

        if not isinstance(engine, EngineCore):
            raise ValueError("create_app: give root= (the engine has no .root)")
        root = engine.root
    svc = LocalService(
        engine, Path(root), models=models, gap_timeout_s=gap_timeout_s, datum_cls=datum_cls, url_ttl_s=url_ttl_s
    )
    svc.custom_loss_server_side = custom_loss_server_side
    svc.tenancy.limits = limits or Limits()
    svc.request_log = RequestLog(record_requests) if record_requests is not None else None
    svc.content_seeds = ContentSeeds() if content_seeds else None
    svc.default_lora_seed = default_lora_seed
    svc.request_limits = request_limits or RequestLimits()
    svc.graph_limits = graph_limits or GraphLimits()
    keys = KeyStore(root)
    svc.model_allow = ModelAllowList(root, list(models or []), enforced=keys.any)
    # the JWT key derives from the server's URL-signing secret (tinker_local.auth)
    svc.jwt = JwtIssuer(load_secret(Path(root)), clock=lambda: svc.clock()) if jwt_auth else None
    svc.store.batch_quiet_s, svc.store.batch_max_wait_s = batch_quiet_s, batch_max_wait_s
    if sampler_pool is not None:
        svc.sampling.attach_sampler_pool(sampler_pool)
    fault_state = FaultState(faults or FaultConfig())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.store.start(asyncio.get_running_loop())
        sweeper = asyncio.create_task(_sweep_forever(svc))
        try:
            yield
        finally:
            sweeper.cancel()
            svc.store.stop()
            if sampler_pool is not None:
                sampler_pool.close()

    app = FastAPI(title="tinker_local", lifespan=lifespan)
    app.state.service = svc
    app.state.faults = fault_state

    app.add_middleware(AuthCountLog, service=svc, keys=keys, max_body_bytes=svc.request_limits.body_bytes)

    @app.exception_handler(HttpError)
    async def http_error(_request: Request, exc: HttpError):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)

    async def malformed(request: Request, exc: Exception):
        # a field of the wrong type or shape that no check named: the caller's input, answered
        # in one line (logged with its traceback, in case it is a server bug after all)
        logger.warning("%s %s: malformed request", request.method, request.url.path, exc_info=exc)
        text = " ".join(str(exc).split())[:300]
        return JSONResponse(
            {"detail": f"{request.url.path}: malformed request: {type(exc).__name__}: {text}"}, status_code=422
        )

    for exc_type in MALFORMED:
        app.add_exception_handler(exc_type, malformed)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        # FastAPI's own checks (query and path parameters): one line, like every other refusal
        parts = [f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors()]
        return JSONResponse({"detail": f"{request.url.path}: " + "; ".join(parts)[:500]}, status_code=422)

    add_service_routes(app, svc, fault_state, sampler_pool, keys)
    add_training_routes(app, svc, poll_wait_s)
    add_rest_routes(app, svc)
    describe_bodies(app)
    if fault_state.config.active:  # outermost: faults hit every route, auth included
        app.add_middleware(FaultInjector, state=fault_state)
    return app


async def _sweep_forever(svc: LocalService) -> None:
    """Delete expired checkpoints once a minute (lookups also sweep), off the event loop."""
    while True:
        await asyncio.sleep(SWEEP_EVERY_S)
        try:
            await asyncio.to_thread(svc.sweep_expired)
        except Exception:  # never let the sweeper die
            logger.exception("sweeping expired checkpoints failed")
