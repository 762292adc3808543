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
