"""Exceptions shared by the local engine modules."""

from __future__ import annotations

from typing import Any, overload


class EngineUserError(ValueError):
    """A request the engine cannot serve because of the caller's input (unknown model or model id,
    token id outside the vocabulary, sequence longer than the context, unsupported loss function,
    malformed loss inputs, ...).  The message names the offending value.  The HTTP server maps
    it to request-error category "User" (not retried)."""


class UnknownModelError(EngineUserError):
    """``resolve_model`` got a name that is neither a preset, a known hub id, nor a local
    Hugging Face model directory.  Subclass of ``ValueError`` (via ``EngineUserError``)."""


class HttpError(Exception):
    """The HTTP server answers the request with ``status`` and ``{"detail": detail}`` (4xx: the
    SDK raises its user-category status errors, e.g. ``NotFoundError`` / 404,
    ``UnprocessableEntityError`` / 422, without retrying)."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers  # extra response headers (e.g. Retry-After of a 429)


def required_field(body: dict[str, Any], key: str, endpoint: str) -> Any:
    """``body[key]`` of a JSON request body.

    Raises:
        HttpError: 422 naming ``endpoint`` and ``key`` when the field is missing or null.
    """
    if body.get(key) is None:
        raise HttpError(422, f"{endpoint}: field {key!r} is required")
    return body[key]


@overload
def int_field(body: dict[str, Any], key: str, endpoint: str, default: int) -> int: ...
@overload
def int_field(body: dict[str, Any], key: str, endpoint: str, default: None = None) -> int | None: ...
def int_field(body: dict[str, Any], key: str, endpoint: str, default: int | None = None) -> int | None:
    """``int(body[key])``, or ``default`` when the field is missing or null.

    Raises:
        HttpError: 422 naming ``endpoint``, ``key`` and the value when it is not an integer.
    """
    v = body.get(key)
    if v is None:
        return default
    try:
        return int(v)
    except (TypeError, ValueError):
        raise HttpError(422, f"{endpoint}: field {key!r} must be an integer, got {v!r}") from None
