"""Which Tinker API a server speaks, told in one line before a run starts.

The installed ``tinker`` SDK (0.38) speaks one version of the wire protocol (docs/backends.md,
"What a compatible server must answer"). A server written against an older SDK fails it in two
ways that the SDK reports only as bare HTTP errors deep inside a run:

- it has no ``POST /api/v1/client/config`` (the SDK's first request of every client): HTTP 404;
- it validates request bodies strictly and refuses fields the SDK added since (``optimizer_config``
  of ``create_model``, say): HTTP 422 whose ``detail`` lists errors of type ``extra_forbidden``
  (FastAPI / pydantic's answer to an unknown field).

:func:`check_server_api` asks ``client/config`` itself (once per client, before the SDK's own
retries begin) and :func:`older_api_error` reads a 422 the SDK raised; both name the server, the
SDK version and what is missing in an :class:`OlderServerAPIError`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OlderServerAPIError", "check_server_api", "older_api_error", "sdk_api_version"]

#: the SDK's first request of every client
CLIENT_CONFIG = "/api/v1/client/config"


class OlderServerAPIError(ValueError):
    """The server speaks an older Tinker API than the installed SDK (not retried: a user error)."""


def sdk_api_version() -> str:
    """``major.minor`` of the installed ``tinker`` SDK (the protocol changes with the minor version)."""
    import tinker

    return ".".join(str(tinker.__version__).split(".")[:2])


def _older(base_url: str, what: str) -> OlderServerAPIError:
    return OlderServerAPIError(
        f"server at {base_url} speaks an older Tinker API than the installed SDK {sdk_api_version()}: {what}"
    )


def _extra_fields(body: Any) -> list[str]:
    """Field names of the ``extra_forbidden`` errors in a 422 body (FastAPI's ``{"detail": [...]}``)."""
    detail = body.get("detail") if isinstance(body, dict) else None
    if not isinstance(detail, list):
        return []
    names = []
    for err in detail:
        if isinstance(err, dict) and err.get("type") == "extra_forbidden":
            loc = [str(p) for p in err.get("loc") or [] if p != "body"]
            names.append(".".join(loc) or "?")
    return names


def check_server_api(base_url: str, api_key: str, *, timeout: float = 30.0) -> None:
    """Ask the server at ``base_url`` the SDK's first question (``POST /api/v1/client/config``).

    Anything but the two answers of an older server (404; 422 ``extra_forbidden``) is left to the
    SDK, which retries what is transient and reports the rest itself (a bad key, a server that
    does not answer).

    Raises:
        OlderServerAPIError: ``server at URL speaks an older Tinker API than the installed SDK
            0.38: /api/v1/client/config not found`` (or the fields it refused).
    """
    import httpx
    import tinker

    url = base_url.rstrip("/") + CLIENT_CONFIG
    try:
        resp = httpx.post(
            url, json={"sdk_version": str(tinker.__version__)}, headers={"X-API-Key": api_key}, timeout=timeout
        )
    except httpx.HTTPError:
        return  # unreachable or slow: the SDK's retries and its own error
    if resp.status_code == 404:
        raise _older(base_url, f"{CLIENT_CONFIG} not found")
    if resp.status_code == 422:
        try:
            fields = _extra_fields(resp.json())
        except ValueError:
            fields = []
        if fields:
            raise _older(
                base_url, f"{CLIENT_CONFIG} refuses the request field(s) {', '.join(fields)} (422 extra_forbidden)"
            )


def older_api_error(exc: BaseException, base_url: str) -> OlderServerAPIError | None:
    """The :class:`OlderServerAPIError` an SDK error means, or None.

    ``exc`` (or an exception in its ``__cause__`` / ``__context__`` chain) is a ``tinker``
    ``APIStatusError`` with HTTP 422 listing ``extra_forbidden`` fields: the message names the
    endpoint and the fields, e.g. ``... SDK 0.38: /api/v1/create_model refuses the request field(s)
    optimizer_config (422 extra_forbidden)``.
    """
    import tinker

    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, tinker.APIStatusError) and cur.status_code == 422:
            fields = _extra_fields(cur.body)
            if not fields:
                try:
                    fields = _extra_fields(cur.response.json())
                except ValueError:
                    fields = []
            if fields:
                path = cur.request.url.path if cur.request is not None else "a request"
                return _older(
                    base_url, f"{path} refuses the request field(s) {', '.join(fields)} (422 extra_forbidden)"
                )
        cur = cur.__cause__ or cur.__context__
    return None
