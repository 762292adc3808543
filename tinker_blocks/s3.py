"""S3 plumbing for the stores (no Prefect import): fsspec options, error classes, retries, DuckDB.

- :func:`s3_storage_options` builds ``s3fs.S3FileSystem`` keyword arguments from explicit values
  (an :class:`~tinker_blocks.s3_credentials.S3Credentials` block) or, for each value not given,
  the standard AWS environment: ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_SESSION_TOKEN``, ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION`` /
  ``AWS_REGION``. With none of them, botocore's own chain applies (``~/.aws``, instance roles).
- :func:`is_transient` tells network trouble and 5xx/429/408 answers (retry) from wrong
  credentials, missing buckets and other 4xx answers (fail at once).
- :func:`retry_call` retries a call on transient errors with exponential backoff and jitter until
  a deadline, then raises :class:`StoreUnavailableError`; an outage is said once when it starts
  and once when the store answers again, however many calls and threads retry meanwhile.
- :func:`attach_filesystem` makes a DuckDB connection read the store's URLs: DuckDB's own
  ``httpfs`` extension when it loads (it is faster), else the fsspec filesystem
  (``register_filesystem``, works offline). ``$PREFECT_TINKER_DUCKDB_HTTPFS``: ``auto``
  (default: ``LOAD httpfs``, no download), ``install`` (``INSTALL`` first: needs the internet),
  ``off`` (always fsspec).
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlparse

__all__ = [
    "StoreAccessError",
    "StoreUnavailableError",
    "s3_storage_options",
    "is_transient",
    "is_access_error",
    "retry_call",
    "attach_filesystem",
    "HTTPFS_ENV",
    "is_missing_part_error",
    "execute_once",
    "retry_missing_part",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

HTTPFS_ENV = "PREFECT_TINKER_DUCKDB_HTTPFS"
#: seconds an S3 listing is reused (see :func:`s3_storage_options`)
LISTINGS_EXPIRY_S = 5.0

# botocore timeouts and retries: short, so that an outage is handled by retry_call's backoff
_CONFIG_KWARGS = {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 2, "mode": "standard"}}


class StoreAccessError(PermissionError):
    """The store cannot be used with these credentials/settings: wrong or missing credentials,
    no permission, a missing bucket that cannot be created. Not retried."""


class StoreUnavailableError(ConnectionError):
    """The store kept failing with transient errors (server down, timeouts, 5xx) until the retry
    deadline. Retrying later may succeed; buffered rows are kept by the writer."""


def _env(env: Mapping[str, str], *names: str) -> str | None:
    for n in names:
        v = env.get(n)
        if v:
            return v
    return None


def s3_storage_options(
    *,
    key: str | None = None,
    secret: str | None = None,
    token: str | None = None,
    endpoint_url: str | None = None,
    region: str | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``s3fs.S3FileSystem``; each value not given comes from ``env``
    (default ``os.environ``: the AWS variables listed in the module docstring).

    Listings are cached for :data:`LISTINGS_EXPIRY_S` seconds: DuckDB asks for each file's size
    and date several times per query, and without the cache each ask is a HEAD request (6 per
    file, 5x slower queries); parts are immutable, so only new or compacted-away parts written by
    *another* process can be missed, for at most that long (this process's writes invalidate
    the cache at once). Botocore retries are short (:func:`retry_call` handles outages); a
    custom endpoint uses path-style addressing (what MinIO, SeaweedFS and most S3-compatible
    servers expect).
    """
    env = os.environ if env is None else env
    key = key or _env(env, "AWS_ACCESS_KEY_ID")
    secret = secret or _env(env, "AWS_SECRET_ACCESS_KEY")
    token = token or _env(env, "AWS_SESSION_TOKEN")
    endpoint_url = endpoint_url or _env(env, "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    region = region or _env(env, "AWS_DEFAULT_REGION", "AWS_REGION")
    opts: dict[str, Any] = {"use_listings_cache": True, "listings_expiry_time": LISTINGS_EXPIRY_S}
    config = dict(_CONFIG_KWARGS)
    if key and secret:
        opts["key"], opts["secret"] = key, secret
        if token:
            opts["token"] = token
    if endpoint_url:
        opts["endpoint_url"] = endpoint_url
        config["s3"] = {"addressing_style": "path"}
    if region:
        opts["client_kwargs"] = {"region_name": region}
    opts["config_kwargs"] = config
    return opts


def _botocore_classes() -> tuple[tuple[type, ...], type | None]:
    try:
        from botocore.exceptions import (
            ConnectionClosedError,
            EndpointConnectionError,
            HTTPClientError,
            NoCredentialsError,
        )
    except ImportError:  # pragma: no cover - s3fs depends on botocore
        return (), None
    return (HTTPClientError, EndpointConnectionError, ConnectionClosedError), NoCredentialsError


_TRANSIENT_CODES = {
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "RequestTimeout",
    "RequestTimeTooSkewed",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "503",
    "500",
    "502",
    "504",
}


# in a message: S3 answers, and the errors of a failed read that DuckDB quotes as text
_TRANSIENT_TEXT = (
    "SlowDown",
    "ServiceUnavailable",
    "InternalError",
    "Service Unavailable",
    "EndpointConnectionError",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "ConnectionRefusedError",
    "ConnectionResetError",
    "ServerDisconnectedError",
    "ClientConnectorError",
    "Could not establish connection",  # DuckDB httpfs
)


def _status_and_code(exc: BaseException) -> tuple[int | None, str | None]:
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        err = resp.get("Error") or {}
        meta = resp.get("ResponseMetadata") or {}
        return meta.get("HTTPStatusCode"), err.get("Code")
    return None, None


def _chain(exc: BaseException):
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def is_access_error(exc: BaseException) -> bool:
    """True for wrong/missing credentials or a denied request (HTTP 401/403, botocore
    ``NoCredentialsError``, ``PermissionError``)."""
    _, no_creds = _botocore_classes()
    for cur in _chain(exc):
        if isinstance(cur, PermissionError) or (no_creds and isinstance(cur, no_creds)):
            return True
        status, code = _status_and_code(cur)
        if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
            return True
    return False


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` (or an exception it wraps) may pass on a retry: connection refused or
    reset, timeouts, HTTP 408/429/5xx, S3 ``SlowDown``/``InternalError``/``ServiceUnavailable``,
    and a DuckDB error quoting one of those (a read through fsspec that met the outage). False
    for access errors, missing buckets/keys and other 4xx."""
    if is_access_error(exc):
        return False
    http_errors, _ = _botocore_classes()
    for cur in _chain(exc):
        if isinstance(cur, FileNotFoundError):
            return False
        if http_errors and isinstance(cur, http_errors):
            return True
        if isinstance(cur, (ConnectionError, TimeoutError)):
            return True
        status, code = _status_and_code(cur)
        if status is not None:
            return status in (408, 429) or status >= 500
        if code in _TRANSIENT_CODES:
            return True
        name = type(cur).__name__
        if name in (
            "ClientConnectorError",
            "ServerDisconnectedError",
            "ClientOSError",
            "ServerTimeoutError",
            "FSTimeoutError",
            "IncompleteRead",
            "ResponseParserError",
        ):
            return True
        msg = str(cur)
        if any(c in msg for c in _TRANSIENT_TEXT):
            return True
    return False


@dataclass
class _Outage:
    """A store found not answering: since when (the start of the first failed attempt, monotonic
    seconds), how many retries so far, how many calls gave up."""

    since: float
    retries: int = 0
    given_up: int = 0


_outages: dict[str, _Outage] = {}
_outages_lock = threading.Lock()


def _outage_retry(where: str, what: str, exc: BaseException, deadline_s: float, setting: str, tried_at: float) -> None:
    """One more retry against ``where`` after an attempt started at ``tried_at`` (monotonic) failed:
    the first of an outage is said (one warning), the others go to the debug log."""
    with _outages_lock:
        outage = _outages.get(where)
        if outage is None:
            outage = _outages[where] = _Outage(tried_at)
            first = True
        else:
            first = False
        outage.retries += 1
    if first:
        log.warning(
            "%s is not answering (%s); its writes, reads and lease renewals retry for up to %g s (%s); one line "
            "follows when it answers again",
            where,
            _short(exc, 200),
            deadline_s,
            setting,
        )
    else:
        log.debug("%s failed again (%s)", what, _short(exc))


def _outage_over(where: str) -> None:
    """A call to ``where`` succeeded: an outage said before is over (one line)."""
    if where not in _outages:  # the common case, without the lock
        return
    with _outages_lock:
        outage = _outages.pop(where, None)
    if outage is not None:
        gave_up = f"; {outage.given_up} call(s) gave up meanwhile" if outage.given_up else ""
        log.warning(
            "%s answers again after %.1f s (%d retries%s)",
            where,
            time.monotonic() - outage.since,
            outage.retries,
            gave_up,
        )


def retry_call(
    fn: Callable[[], T],
    *,
    what: str,
    deadline_s: float,
    first_wait_s: float = 0.2,
    max_wait_s: float = 5.0,
    sleep: Callable[[float], None] = time.sleep,
    where: str | None = None,
    setting: str = "retry_seconds",
) -> T:
    """Call ``fn()``; on a transient error (:func:`is_transient`) wait and call again, the waits
    growing x2 from ``first_wait_s`` up to ``max_wait_s`` (+-25% jitter), until ``deadline_s``
    seconds have passed since the first call.

    An outage is said once per store ``where`` (default ``what``), whatever the number of calls
    and threads retrying against it: the first retry while it is not known to be out logs one
    warning (naming the store, the error and the window ``deadline_s`` with the name of its
    ``setting``); later retries go to the debug log; the first call to succeed afterwards logs one
    line saying it answers again and after how long.

    Raises:
        StoreAccessError: an access error (wrong credentials, forbidden), at once.
        StoreUnavailableError: still failing transiently at the deadline (one line, naming the
            window and its setting; chained to the last error).
        Exception: any other error from ``fn``, at once.
    """
    where = where or what
    start = time.monotonic()
    wait = first_wait_s
    attempt = 0
    while True:
        attempt += 1
        tried_at = time.monotonic()
        try:
            out = fn()
        except Exception as exc:
            if is_access_error(exc):
                raise StoreAccessError(f"{what}: access denied ({_short(exc)}); check the S3 credentials") from exc
            if isinstance(exc, StoreUnavailableError) or not is_transient(exc):
                raise  # (an inner call that gave up after its own window: said once, not again)
            elapsed = time.monotonic() - start
            if elapsed >= deadline_s:
                with _outages_lock:
                    if where in _outages:
                        _outages[where].given_up += 1
                raise StoreUnavailableError(
                    f"{what}: no answer for {elapsed:.1f} s, after {attempt} attempt(s) "
                    f"({setting} = {deadline_s:g} s): {_short(exc)}"
                ) from exc
            _outage_retry(where, what, exc, deadline_s, setting, tried_at)
            pause = min(wait * random.uniform(0.75, 1.25), max(deadline_s - elapsed, 0.0))
            sleep(pause)
            wait = min(wait * 2, max_wait_s)
        else:
            _outage_over(where)
            return out


_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception)\b:")


def _short(exc: BaseException, limit: int = 300) -> str:
    """``<type>: <first line of the message>`` (``limit`` characters at most); for a message that holds a
    Python traceback (DuckDB quotes the one of a failed fsspec read), its error line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if lines and lines[0].startswith("Traceback"):
        lines = [line for line in lines if _ERROR_LINE.match(line)] or lines
    text = lines[0] if lines else ""
    return f"{type(exc).__name__}: {text[:limit]}" if text else type(exc).__name__


# ----- DuckDB ------------------------------------------------------------------------------------
#: what DuckDB says (through fsspec, httpfs or the local file system) when a listed file is gone
_MISSING_PART = (
    "FileNotFoundError",
    "No such file or directory",
    "NoSuchKey",
    "The specified key does not exist",
    "HTTP 404",
    "No files found that match the pattern",
)


def is_missing_part_error(exc: BaseException) -> bool:
    """True when a DuckDB query failed because a Parquet part it had listed was deleted before it
    was read: a compaction merged it into a new part (written first) and removed it. Running the
    query again lists the parts anew and succeeds. False for SQL errors (catalog, binder, parser)."""
    import duckdb

    if not isinstance(exc, duckdb.Error) or isinstance(
        exc, (duckdb.CatalogException, duckdb.BinderException, duckdb.ParserException)
    ):
        return False
    return any(m in str(exc) for m in _MISSING_PART)


def retry_missing_part(fn: Callable[[], T], *, attempts: int = 4, before_retry: Callable[[], None] | None = None) -> T:
    """``fn()``, called again (after ``before_retry()``, which drops cached listings) when it fails
    with :func:`is_missing_part_error` (a concurrent compaction deleted a listed part), up to
    ``attempts`` times. Other errors are raised at once; the last missing-part error after
    ``attempts`` tries."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt >= attempts or not is_missing_part_error(exc):
                raise
            log.info("a part vanished during the query (compacted meanwhile); re-running it (%d)", attempt)
            if before_retry is not None:
                before_retry()
            time.sleep(0.05 * attempt)
    raise AssertionError("unreachable")


def execute_once(connect: Callable[[], Any], sql: str, params: Any = None) -> tuple[list[str], list[tuple]]:
    """``(column names, rows)`` of ``sql`` on a fresh connection from ``connect()`` (closed after).
    Stores run it through :meth:`~tinker_blocks.store_io.ParquetStore.reading`, which re-runs it on
    a missing part, an unreadable part or an outage."""
    con = connect()
    try:
        cur = con.execute(sql, params or [])
        return ([], []) if cur.description is None else ([d[0] for d in cur.description], cur.fetchall())
    finally:
        con.close()


def _sql_lit(s: str) -> str:
    return "'" + str(s).replace("'", "''") + "'"


def _httpfs_secret(con: Any, scope: str, opts: Mapping[str, Any]) -> None:
    parts = ["TYPE s3", f"KEY_ID {_sql_lit(opts['key'])}", f"SECRET {_sql_lit(opts['secret'])}"]
    if opts.get("token"):
        parts.append(f"SESSION_TOKEN {_sql_lit(opts['token'])}")
    region = (opts.get("client_kwargs") or {}).get("region_name")
    if region:
        parts.append(f"REGION {_sql_lit(region)}")
    endpoint = opts.get("endpoint_url")
    if endpoint:
        u = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
        parts += [
            f"ENDPOINT {_sql_lit(u.netloc)}",
            "URL_STYLE 'path'",
            f"USE_SSL {'true' if u.scheme == 'https' else 'false'}",
        ]
    parts.append(f"SCOPE {_sql_lit(scope)}")
    name = "pt_s3_" + format(abs(hash(scope)) % (1 << 40), "x")
    con.execute(f"CREATE OR REPLACE SECRET {name} ({', '.join(parts)})")


def attach_filesystem(con: Any, fs: Any, scope: str, opts: Mapping[str, Any], mode: str | None = None) -> str:
    """Let ``con`` read URLs under ``scope`` (e.g. ``s3://bucket/prefix``); return the way used:
    ``"httpfs"`` or ``"fsspec"``.

    httpfs is used for ``s3://`` scopes with an explicit key and secret when the extension loads
    (``mode``/``$PREFECT_TINKER_DUCKDB_HTTPFS``: ``auto`` loads an installed extension only,
    ``install`` tries ``INSTALL httpfs`` first, ``off`` never). Any failure falls back silently
    to ``con.register_filesystem(fs)`` (the store passes a :class:`PartCacheFS`).
    """
    import duckdb

    mode = (mode or os.environ.get(HTTPFS_ENV) or "auto").strip().lower()
    if mode not in ("auto", "install", "off"):
        mode = "auto"
    if mode != "off" and scope.startswith("s3://") and opts.get("key") and opts.get("secret"):
        try:
            if mode == "install":
                con.execute("INSTALL httpfs")
            con.execute("LOAD httpfs")
            _httpfs_secret(con, scope, opts)
            return "httpfs"
        except duckdb.Error as exc:
            log.debug("DuckDB httpfs unavailable (%s); reading through fsspec", exc)
    con.register_filesystem(fs)
    return "fsspec"
