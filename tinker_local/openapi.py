"""The server's OpenAPI document, with the JSON request bodies the tinker SDK sends.

The routes read their JSON bodies themselves (``tinker_local.http_api.json_body``), so FastAPI
knows no body schema; ``describe_bodies`` adds each route's body as the SDK's own pydantic request
model (``tinker.types.<Name>Request``) describes it, so that clients and fuzzers
(``schemathesis``) see what a route takes.  ``forward`` / ``forward_backward`` take a protobuf
``ForwardBackwardRequest`` and are described as binary bodies (``application/octet-stream``).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from .http_api import API

# route (under API) -> the tinker.types request model of its JSON body
BODIES = {
    "/create_session": "CreateSessionRequest",
    "/session_heartbeat": "SessionHeartbeatRequest",
    "/create_model": "CreateModelRequest",
    "/get_info": "GetInfoRequest",
    "/optim_step": "OptimStepRequest",
    "/save_weights": "SaveWeightsRequest",
    "/save_weights_for_sampler": "SaveWeightsForSamplerRequest",
    "/save_weights_external": "SaveWeightsExternalRequest",
    "/load_weights": "LoadWeightsRequest",
    "/create_sampling_session": "CreateSamplingSessionRequest",
    "/join_sampling_session": "JoinSamplingSessionRequest",
    "/asample": "SampleRequest",
    "/create_custom_loss": "CreateCustomLossRequest",
    "/retrieve_future": "FutureRetrieveRequest",
    "/client/config": "ClientConfigRequest",
    "/telemetry": "TelemetrySendRequest",
    "/sessions/search": "SessionSearchRequest",
}


def describe_bodies(app: FastAPI) -> None:
    """Make ``app.openapi()`` describe the request bodies of ``BODIES`` (and the protobuf ones)."""
    import tinker.types as types

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        from fastapi.openapi.utils import get_openapi

        doc = get_openapi(title=app.title, version="0.38", routes=app.routes)
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, name in BODIES.items():
            op = doc["paths"].get(f"{API}{path}", {}).get("post")
            if op is None:
                continue
            schema = getattr(types, name).model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(schema.pop("$defs", {}))
            components[name] = schema
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
            }
        for path in ("/forward", "/forward_backward"):
            op = doc["paths"].get(f"{API}{path}", {}).get("post")
            if op is not None:
                op["requestBody"] = {
                    "required": True,
                    "description": "a tinker ForwardBackwardRequest protobuf, optionally zstd-compressed",
                    "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                }
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
