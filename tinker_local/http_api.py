"""What the route groups of the HTTP layer share: the API prefix and the JSON request body.

Every route of the Tinker API lives under ``API`` (``/api/v1``, tinker SDK 0.38); a JSON body that
is not a JSON object (or is nested too deeply to parse) answers HTTP 422 naming the route.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from .errors import HttpError

API = "/api/v1"


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object body (``{}`` when empty); HttpError 422 when it is not JSON or not
    an object."""
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise HttpError(422, f"{request.url.path}: body is not JSON: {e}") from e
    except RecursionError:
        raise HttpError(422, f"{request.url.path}: body is nested too deeply") from None
    if not isinstance(body, dict):
        raise HttpError(422, f"{request.url.path}: body must be a JSON object")
    return body
