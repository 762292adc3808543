"""Exceptions shared by the local engine modules."""

from __future__ import annotations


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

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status = status
        self.detail = detail
