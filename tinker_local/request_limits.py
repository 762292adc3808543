"""The size of one request to a ``tinker_local`` server, bounded: each bound refused with HTTP 413
and one line naming the bound and the ``serve`` flag that sets it.

``RequestLimits`` holds the bounds; the defaults suit a team server (a forward_backward of 4096
datums and 262144 tokens; a sampling request of 128 samples of 8192 tokens at most; 64 MiB bodies,
decompressed size included).  The HTTP layer checks the body size before a handler reads it
(``tinker_local.http_auth``); the service checks the counts when it parses a request.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import HttpError


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request (``serve --max-...``): ``body_bytes`` of a request body (after
    zstd decompression too), ``datums`` and ``tokens`` of a forward / forward_backward (model-input
    tokens, media chunks by their expected tokens), ``num_samples`` and ``sample_tokens``
    (``max_tokens``) of a sampling request, whose ``prompt + num_samples x max_tokens`` must also
    stay within ``tokens``."""

    body_bytes: int = 64 << 20
    datums: int = 4096
    tokens: int = 1 << 18
    num_samples: int = 128
    sample_tokens: int = 8192


def refuse(what: str, value: int, limit: int, flag: str) -> HttpError:
    """The HTTP 413 of a request over one bound (``flag``: the ``serve`` option that sets it)."""
    return HttpError(413, f"request limit: {what} is {value}, over the limit of {limit} (serve {flag})")


def check_training(limits: RequestLimits, endpoint: str, datums: int, tokens: int) -> None:
    """HttpError 413 when a forward / forward_backward has too many datums or tokens."""
    if datums > limits.datums:
        raise refuse(f"{endpoint}: datums per request", datums, limits.datums, "--max-datums-per-request")
    if tokens > limits.tokens:
        raise refuse(f"{endpoint}: tokens per request", tokens, limits.tokens, "--max-tokens-per-request")


def check_sampling(limits: RequestLimits, num_samples: int, max_tokens: int, prompt_tokens: int) -> None:
    """HttpError 413 when a sampling request asks for too many samples or tokens."""
    if num_samples > limits.num_samples:
        raise refuse("asample: num_samples", num_samples, limits.num_samples, "--max-num-samples")
    if max_tokens > limits.sample_tokens:
        raise refuse("asample: max_tokens", max_tokens, limits.sample_tokens, "--max-sample-tokens")
    total = prompt_tokens + num_samples * max_tokens
    if total > limits.tokens:
        raise refuse(
            "asample: prompt + num_samples x max_tokens tokens", total, limits.tokens, "--max-tokens-per-request"
        )
