"""REST routes of the HTTP layer: training runs, checkpoints (listing, TTL, publish flag, external
weights URLs, deletion, copies), storage usage, the audit log, and the signed downloads.

A checkpoint is changed only by its owner (``Tenancy.check_checkpoint_owner``); the signed download
routes take no API key (the URL's signature is the credential, ``tinker_local.signing``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse

from .http_api import API, json_body
from .rest_sessions import account_feature
from .service import LocalService


def add_rest_routes(app: FastAPI, svc: LocalService) -> None:
    """Add the REST and signed-download routes answered by ``svc`` to ``app``."""
    ten = svc.tenancy

    def route(method: str, path: str):
        return app.api_route(f"{API}{path}", methods=[method])

    @route("GET", "/training_runs")
    async def training_runs(limit: int = 20, offset: int = 0, project_id: str | None = None):
        return svc.rest.training_runs(limit, offset, project_id)

    @route("GET", "/training_runs/{model_id}")
    async def training_run(model_id: str):
        return svc.rest.training_run(model_id)

    @route("GET", "/training_runs/{model_id}/checkpoints")
    async def run_checkpoints(model_id: str):
        return svc.rest.checkpoints(model_id)

    # the routes ending in /ttl, /publish, /external_weights_urls come before the generic DELETE
    @route("PUT", "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def checkpoint_ttl(model_id: str, checkpoint_id: str, request: Request):
        ten.check_checkpoint_owner(model_id, checkpoint_id)
        return svc.rest.set_checkpoint_ttl(model_id, checkpoint_id, await json_body(request))

    @route("POST", "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
    async def publish_checkpoint(model_id: str, checkpoint_id: str):
        ten.check_checkpoint_owner(model_id, checkpoint_id)
        out = svc.rest.set_published(model_id, checkpoint_id, True)
        ten.audit("checkpoint_publish", model_id=model_id, tinker_path=f"tinker://{model_id}/{checkpoint_id}")
        return out

    @route("DELETE", "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish")
    async def unpublish_checkpoint(model_id: str, checkpoint_id: str):
        ten.check_checkpoint_owner(model_id, checkpoint_id)
        out = svc.rest.set_published(model_id, checkpoint_id, False)
        ten.audit("checkpoint_unpublish", model_id=model_id, tinker_path=f"tinker://{model_id}/{checkpoint_id}")
        return out

    @route("GET", "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(model_id: str, checkpoint_id: str, request: Request):
        ten.check_checkpoint_owner(model_id, checkpoint_id)
        out = await asyncio.to_thread(svc.export.external_weights_urls, model_id, checkpoint_id, str(request.base_url))
        ten.audit("checkpoint_download", model_id=model_id, tinker_path=f"tinker://{model_id}/{checkpoint_id}")
        return out

    @route("DELETE", "/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str):
        ten.check_checkpoint_owner(model_id, checkpoint_id)
        out = svc.rest.delete_checkpoint(model_id, checkpoint_id)
        ten.audit("checkpoint_delete", model_id=model_id, tinker_path=f"tinker://{model_id}/{checkpoint_id}")
        return out

    @route("GET", "/checkpoints")
    async def all_checkpoints(limit: int = 100, offset: int = 0):
        return svc.rest.checkpoints(None, limit, offset)

    @route("POST", "/copy_weights")
    async def copy_weights(request: Request):
        body = await json_body(request)
        out = await asyncio.to_thread(svc.rest.copy_weights, body, request.headers.get("x-idempotency-key"))
        ten.audit("checkpoint_copy", source_path=body.get("source_path"), tinker_path=out.get("tinker_path"))
        return out

    @route("GET", "/billing/usage/checkpoints/current")
    async def checkpoint_storage_usage(project_id: str | None = None):
        return svc.rest.storage_usage(project_id)

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
            path = await asyncio.to_thread(svc.export.external_download, model_id, name, file, expires, sig)
        return FileResponse(path, filename=Path(file).name)

    @app.get("/downloads/trace/{session_id}/{file}")
    async def download_trace(session_id: str, file: str, expires: str | None = None, sig: str | None = None):
        path = svc.sessions.trace_download(session_id, file, expires, sig)
        return FileResponse(path, media_type="application/json", filename=file)
