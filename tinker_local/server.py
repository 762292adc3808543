"""HTTP layer of ``tinker_local``: a Tinker-API-compatible server (tinker SDK 0.38 wire protocol).

Point the unmodified SDK at it with ``tinker.ServiceClient(base_url="http://127.0.0.1:PORT",
api_key="tml-local")``. Every route lives under ``/api/v1``; every route except
``GET /api/v1/healthz`` needs an ``X-API-Key`` header: one of the server's keys
(``prefect-tinker local keys add NAME``; 401 for an unknown or revoked one), or, while the server
has no keys, any key starting with ``tml-`` from a loopback caller (others: 403).  Each key's user
sees only what its requests made (``tinker_local.tenancy``).
See tinker_local/PROTOCOL.md for the protocol facts this relies on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

from .auth import InvalidToken, JwtIssuer, is_api_key, looks_like_jwt
from .faults import FaultConfig, FaultInjector, FaultState
from .keys import KeyStore
from .rest_sessions import account_feature
from .service import HttpError, LocalService
from .tenancy import CURRENT, LOCAL_PRINCIPAL, Limits, Principal, is_loopback

logger = logging.getLogger("tinker_local.server")

API = "/api/v1"
SWEEP_EVERY_S = 60.0  # expired checkpoints are deleted at least this often (and on every lookup)
_QUIET = ("/retrieve_future", "/session_heartbeat", "/healthz", "/telemetry", "/client/dynamic_config")


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise HttpError(422, f"{request.url.path}: body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise HttpError(422, f"{request.url.path}: body must be a JSON object")
    return body


def create_app(
    engine: Any,
    root: Path | str | None = None,
    *,
    models: list[str] | None = None,
    poll_wait_s: float = 20.0,
    gap_timeout_s: float = 30.0,
    datum_cls: type | None = None,
    faults: FaultConfig | None = None,
    batch_quiet_s: float = 0.02,
    batch_max_wait_s: float = 0.1,
    custom_loss_server_side: bool = True,
    url_ttl_s: float = 3600.0,
    jwt_auth: bool = False,
    sampler_pool: Any = None,
    limits: Limits | None = None,
) -> FastAPI:
    """Build the FastAPI app speaking the tinker 0.38 protocol in front of ``engine``.

    Args:
        engine: an object with the ``tinker_local.engine.Engine`` interface.
        root: server root folder (registry at ``root/server/registry.jsonl``); defaults to
            ``engine.root``.
        models: base model names announced by ``get_server_capabilities``.
        poll_wait_s: how long ``retrieve_future`` holds a poll for a pending request before
            answering HTTP 408 ``{"type": "try_again"}`` (the SDK polls again at once).
        gap_timeout_s: how long a model waits for a missing seq_id before skipping it.
        faults: fault injection (``tinker_local.faults``); None or all zero = off.
        batch_quiet_s, batch_max_wait_s: how long a sampling request waits for more to batch
            with it: while they keep arriving less than ``batch_quiet_s`` apart or are still
            being received, at most ``batch_max_wait_s`` and at most a tenth of the batch's
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
            read from ``root/server/api_keys.json`` (``tinker_local.keys``) on every change.
    Raises:
        ValueError: when no root is given and the engine has none.
    """
    root = root if root is not None else getattr(engine, "root", None)
    if root is None:
        raise ValueError("create_app: give root= (the engine has no .root)")
    svc = LocalService(
        engine, Path(root), models=models, gap_timeout_s=gap_timeout_s, datum_cls=datum_cls, url_ttl_s=url_ttl_s
    )
    svc.custom_loss_server_side = custom_loss_server_side
    svc.tenancy.limits = limits or Limits()
    keys = KeyStore(root)
    svc.jwt = JwtIssuer(svc.signer._secret, clock=lambda: svc.clock()) if jwt_auth else None
    svc.store.batch_quiet_s, svc.store.batch_max_wait_s = batch_quiet_s, batch_max_wait_s
    if sampler_pool is not None:
        svc.attach_sampler_pool(sampler_pool)
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

    app.add_middleware(_AuthCountLog, service=svc, keys=keys)
    ten = svc.tenancy

    @app.exception_handler(HttpError)
    async def http_error(_request: Request, exc: HttpError):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status)

    def route(method: str, path: str):
        return app.api_route(f"{API}{path}", methods=[method])

    # -- service ----------------------------------------------------------------------------------
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
        out = svc.create_session(await _json_body(request))
        ten.audit("session_create", session_id=out["session_id"])
        return out

    @route("POST", "/session_heartbeat")
    async def session_heartbeat(request: Request):
        body = await _json_body(request)
        if not ten.may_use_session(str(body.get("session_id"))):
            raise HttpError(404, f"session_heartbeat: unknown session {body.get('session_id')!r}")
        return svc.heartbeat(body)

    @route("POST", "/sessions/{session_id}/finish")
    async def finish_session(session_id: str, request: Request):
        if not ten.may_use_session(session_id):
            raise HttpError(404, f"unknown session {session_id!r}")
        return svc.finish_session(session_id, await _json_body(request))

    @route("GET", "/get_server_capabilities")
    async def get_server_capabilities():
        return await asyncio.to_thread(svc.capabilities)

    @route("GET", "/local_stats")
    async def local_stats():
        # tinker_local only: compute-thread and fault-injection counters (for tests, benchmarks)
        return {
            "compute": dict(svc.store.stats),
            "requests": dict(svc.request_counts),
            "sampling": dict(svc.sampling_stats),
            "faults": dict(fault_state.counts),
            "fault_config": {"fail_every": fault_state.config.fail_every, "drop_every": fault_state.config.drop_every},
            "sampler_workers": sampler_pool.stats() if sampler_pool is not None else None,
        }

    @route("GET", "/sessions")
    async def list_sessions(limit: int = 20, offset: int = 0):
        return svc.list_sessions(limit, offset)

    @route("POST", "/sessions/search")
    async def search_sessions(request: Request):
        return svc.search_sessions(await _json_body(request))

    @route("GET", "/sessions/{session_id}")
    async def get_session(session_id: str):
        return svc.get_session(session_id)

    @route("PUT", "/sessions/{session_id}/project")
    async def assign_session_project(session_id: str, request: Request):
        return svc.assign_session_project(session_id, await _json_body(request))

    @route("GET", "/sessions/{session_id}/trace_export")
    async def trace_export(session_id: str, request: Request):
        out = await asyncio.to_thread(svc.trace_export, session_id, str(request.base_url))
        ten.audit("trace_download", session_id=session_id)
        return out

    # -- training ---------------------------------------------------------------------------------
    @route("POST", "/create_model")
    async def create_model(request: Request):
        body = await _json_body(request)
        ten.guard("create_model", body)
        out = svc.create_model(body)
        ten.audit("model_create", model_id=out["model_id"], base_model=body.get("base_model"))
        return out

    @route("POST", "/get_info")
    async def get_info(request: Request):
        body = await _json_body(request)
        ten.guard("get_info", body)
        # off the loop: the engine lock may be held by a long job on the compute thread
        return await asyncio.to_thread(svc.get_info, body)

    async def _fwd(request: Request, forward_only: bool):
        raw = await request.body()
        return svc.forward_backward(raw, request.headers.get("content-encoding"), forward_only)

    @route("POST", "/forward_backward")
    async def forward_backward(request: Request):
        return await _fwd(request, False)

    @route("POST", "/forward")
    async def forward(request: Request):
        return await _fwd(request, True)

    for name in (
        "optim_step",
        "save_weights",
        "save_weights_for_sampler",
        "load_weights",
        "create_sampling_session",
        "join_sampling_session",
        "asample",
        "weights_info",
        "save_weights_external",
        "create_custom_loss",
    ):
        _add_json_route(app, name, getattr(svc, name), ten)

    @route("GET", "/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str):
        if not ten.owns_sampler(sampler_id):
            raise HttpError(404, f"unknown sampling session {sampler_id!r}")
        return await asyncio.to_thread(svc.get_sampler, sampler_id)

    @route("POST", "/retrieve_future")
    async def retrieve_future(request: Request):
        body = await _json_body(request)
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

    # -- REST -------------------------------------------------------------------------------------
    @route("GET", "/training_runs")
    async def training_runs(limit: int = 20, offset: int = 0, project_id: str | None = None):
        return svc.training_runs(limit, offset, project_id)

    @route("GET", "/training_runs/{model_id}")
    async def training_run(model_id: str):
        return svc.training_run(model_id)

    @route("GET", "/training_runs/{model_id}/checkpoints")
    async def run_checkpoints(model_id: str):
        return svc.checkpoints(model_id)

    # the routes ending in /ttl, /publish, /external_weights_urls come before the generic DELETE
    @route("PUT", "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def checkpoint_ttl(model_id: str, checkpoint_id: str, request: Request):
        _owner_only(svc, model_id, checkpoint_id)
        return svc.set_checkpoint_ttl(model_id, checkpoint_id, await _json_body(request))

    @route("POST", "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
    async def publish_checkpoint(model_id: str, checkpoint_id: str):
        _owner_only(svc, model_id, checkpoint_id)
        out = svc.set_published(model_id, checkpoint_id, True)
        ten.audit("checkpoint_publish", model_id=model_id, tinker_path=f"tinker://{model_id}/{checkpoint_id}")
        return out

    @route("DELETE", "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
    async def unpublish_checkpoint(model_id: str, checkpoint_id: str):
        _owner_only(svc, model_id, checkpoint_id)
        out = svc.set_published(model_id, checkpoint_id, False)
        ten.audit("checkpoint_unpublish", model_id=model_id, tinker_path=f"tinker://{model_id}/{checkpoint_id}")
        return out

    @route("GET", "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(model_id: str, checkpoint_id: str, request: Request):
        _owner_only(svc, model_id, checkpoint_id)
        out = await asyncio.to_thread(svc.external_weights_urls, model_id, checkpoint_id, str(request.base_url))
        ten.audit("checkpoint_download", model_id=model_id, tinker_path=f"tinker://{model_id}/{checkpoint_id}")
        return out

    @route("DELETE", "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str):
        _owner_only(svc, model_id, checkpoint_id)
        out = svc.delete_checkpoint(model_id, checkpoint_id)
        ten.audit("checkpoint_delete", model_id=model_id, tinker_path=f"tinker://{model_id}/{checkpoint_id}")
        return out

    @route("GET", "/checkpoints")
    async def all_checkpoints(limit: int = 100, offset: int = 0):
        return svc.checkpoints(None, limit, offset)

    @route("POST", "/copy_weights")
    async def copy_weights(request: Request):
        body = await _json_body(request)
        out = await asyncio.to_thread(svc.copy_weights, body, request.headers.get("x-idempotency-key"))
        ten.audit("checkpoint_copy", source_path=body.get("source_path"), tinker_path=out.get("tinker_path"))
        return out

    @route("GET", "/billing/usage/checkpoints/current")
    async def checkpoint_storage_usage(project_id: str | None = None):
        return svc.storage_usage(project_id)

    @route("GET", "/billing/usage/events")
    async def billing_usage_events():
        raise account_feature("billing/usage/events")

    @route("GET", "/audit")
    async def audit_log(event_type: str = "all", day: str | None = None):
        return await asyncio.to_thread(ten.audit_log, event_type, day)

    # -- signed downloads (no API key: the URL's signature is the credential) --------------------
    @app.get("/downloads/external/{model_id}/{name}/{file:path}")
    async def download_external(
        model_id: str, name: str, file: str, expires: str | None = None, sig: str | None = None
    ):
        with ten.acting_for_owner(model_id):
            path = await asyncio.to_thread(svc.external_download, model_id, name, file, expires, sig)
        return FileResponse(path, filename=Path(file).name)

    @app.get("/downloads/trace/{session_id}/{file}")
    async def download_trace(session_id: str, file: str, expires: str | None = None, sig: str | None = None):
        path = svc.trace_download(session_id, file, expires, sig)
        return FileResponse(path, media_type="application/json", filename=file)

    if fault_state.config.active:  # outermost: faults hit every route, auth included
        app.add_middleware(FaultInjector, state=fault_state)
    return app


def _owner_only(svc: LocalService, model_id: str, checkpoint_id: str) -> None:
    """Changes to a checkpoint (TTL, publish flag, downloads, deletion) are its owner's: another
    user gets 404 as for an unknown one, or 403 for a checkpoint published to all."""
    if svc.tenancy.owns_model(model_id):
        return
    uri = f"tinker://{model_id}/{checkpoint_id}"
    ck = svc.registry.checkpoints.get(uri)
    if ck is None or not ck.public:
        raise HttpError(404, f"unknown checkpoint {uri!r}: not saved on this server, or deleted")
    raise HttpError(
        403,
        f"tinker://{model_id}/{checkpoint_id} is published by another user: "
        "you may load and sample it, only its owner may change or delete it",
    )


async def _sweep_forever(svc: LocalService) -> None:
    """Delete expired checkpoints once a minute (lookups also sweep), off the event loop."""
    while True:
        await asyncio.sleep(SWEEP_EVERY_S)
        try:
            await asyncio.to_thread(svc.sweep_expired)
        except Exception:  # never let the sweeper die
            logger.exception("sweeping expired checkpoints failed")


class _AuthCountLog:
    """Pure ASGI middleware (a ``BaseHTTPMiddleware`` costs several ms per request on a busy
    loop): authentication (not for healthz; see ``authenticate``) setting ``tenancy.CURRENT``
    for the request, per-route request counts, the access log (debug level for polls; never a
    key), and the count of ``asample`` requests being received (the sampling batcher waits for
    them)."""

    def __init__(self, app, service: LocalService, keys: KeyStore):
        self.app = app
        self.svc = service
        self.keys = keys

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
            await self.app(scope, receive, send_status)
        finally:
            if sampling:
                self.svc.store.incoming(-1)
            key = getattr(scope.get("route"), "path", None) or "(no route)"  # bounded key set
            self.svc.request_counts[key] = self.svc.request_counts.get(key, 0) + 1
            quiet = path.endswith(_QUIET) and status[0] in (200, 408)
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


# audit events of the JSON routes: route -> event (``tinker_local.tenancy`` audit log)
_AUDITED = {
    "save_weights": "checkpoint_save",
    "save_weights_for_sampler": "checkpoint_save",
    "save_weights_external": "checkpoint_save",
    "load_weights": "checkpoint_load",
    "create_sampling_session": "checkpoint_load",
}


def _add_json_route(app: FastAPI, name: str, handler: Any, tenancy: Any) -> None:
    async def endpoint(request: Request):
        body = await _json_body(request)
        refused = tenancy.guard(name, body)
        if refused is not None:
            return refused
        out = handler(body)
        event = _AUDITED.get(name)
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


def serve(
    model: list[str],
    host: str = "127.0.0.1",
    port: int = 8000,
    root: Path | str = ".",
    *,
    dtype: str = "auto",
    device: str | None = None,
    num_threads: int | None = None,
    log_level: str = "info",
    faults: FaultConfig | None = None,
    custom_loss_server_side: bool = True,
    jwt_auth: bool = False,
    sampler_workers: int = 0,
    tls_cert: Path | str | None = None,
    tls_key: Path | str | None = None,
    limits: Limits | None = None,
) -> None:
    """Build an Engine under ``root``, preload ``model`` names, and serve until interrupted.

    ``sampler_workers`` N > 0: sampling runs in N worker processes next to the trainer
    (``tinker_local.sampler_pool``); ``num_threads`` (default: the CPUs this process may use) is
    then the total, split by ``split_threads`` (each worker ``total // (N + 1)``, the trainer the
    rest).  The workers are ready before the port is bound.

    Blocking. Models named later in ``create_model`` calls are loaded lazily by the engine.
    ``faults``: fault injection for reliability tests (default: from the environment,
    ``TINKER_LOCAL_FAIL_EVERY`` / ``TINKER_LOCAL_DROP_EVERY``).
    ``tls_cert``/``tls_key``: PEM files; the server then speaks HTTPS (uvicorn's ``ssl_certfile`` /
    ``ssl_keyfile``).  ``limits``: per-user limits (``tinker_local.tenancy.Limits``).
    Raises whatever the engine raises for an unknown model name (before binding the port);
    ``InsecureBind`` before loading anything when ``host`` is not a loopback address and the
    server has no API keys.
    """
    import uvicorn

    from .compute import keep_freed_memory
    from .engine import Engine

    keep_freed_memory()  # no page faults on every step's activations (see its docstring)
    root = Path(root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    check_bind(host, root)
    pool = None
    if sampler_workers > 0:
        from .compute import available_cpus
        from .sampler_pool import SamplerPool, split_threads

        total = int(num_threads or available_cpus())
        num_threads, per_worker = split_threads(total, sampler_workers)
        if num_threads + sampler_workers * per_worker > total:
            logger.warning(
                "--threads %d is less than --sampler-workers %d + 1: trainer and workers "
                "use %d threads in all, more than asked",
                total,
                sampler_workers,
                num_threads + sampler_workers * per_worker,
            )
        logger.info("threads: trainer %d, %d sampler worker(s) x %d", num_threads, sampler_workers, per_worker)
        pool = SamplerPool(
            root, sampler_workers, threads_per_worker=per_worker, device=device, dtype=dtype, preload=list(model)
        )
    engine = Engine(root, device=device, dtype=dtype, num_threads=num_threads)
    for name in model:
        t0 = time.monotonic()
        info = engine.load_base_model(name)
        logger.info(
            "preloaded %s in %.1fs (tokenizer %s, context %s)",
            name,
            time.monotonic() - t0,
            info.get("tokenizer_id"),
            info.get("max_context"),
        )
    if pool is not None:
        t0 = time.monotonic()
        pool.start(wait_ready=True)
        logger.info("%d sampler worker(s) ready in %.1fs", sampler_workers, time.monotonic() - t0)
    faults = faults if faults is not None else FaultConfig.from_env()
    if faults.active:
        logger.warning(
            "fault injection on: 503 every %d requests, connection drop every %d", faults.fail_every, faults.drop_every
        )
    app = create_app(
        engine,
        root,
        models=list(model),
        faults=faults,
        custom_loss_server_side=custom_loss_server_side,
        jwt_auth=jwt_auth,
        sampler_pool=pool,
        limits=limits,
    )
    scheme = "https" if tls_cert else "http"
    logger.info(
        "tinker_local serving %s on %s://%s:%d (root %s, %d API key(s))",
        ", ".join(model) or "-",
        scheme,
        host,
        port,
        root,
        len(KeyStore(root).entries()),
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        ssl_certfile=str(tls_cert) if tls_cert else None,
        ssl_keyfile=str(tls_key) if tls_key else None,
    )


class InsecureBind(RuntimeError):
    """``serve`` on a non-loopback address of a server without API keys."""


def check_bind(host: str, root: Path) -> None:
    """Raise ``InsecureBind`` (one line saying how to add a key) when ``host`` is not a loopback
    address and ``root`` holds no API keys: anyone reaching the port could use the server."""
    if not is_loopback(host) and not KeyStore(root).any():
        raise InsecureBind(
            f"refusing to serve on {host}: the server in {root} has no API keys, so anyone "
            f"who can reach it could use it; add one first: prefect-tinker local keys add NAME "
            f"--root {root}"
        )
