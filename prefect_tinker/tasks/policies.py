"""Retry and cache policies shared by every task of the package.

One predicate, :func:`is_transient`, decides whether a failure is worth retrying; every task uses
:func:`retry_condition` (its Prefect form) together with :data:`RETRY_OPTIONS`. Transient: network
trouble, timeouts, HTTP 408/409/429/5xx and failed requests of category server/unknown. Permanent:
bad credentials, bad input (HTTP 400/404/422, failed requests of category user) and our own
validation errors — those fail at once so that the user sees the message instead of a retry loop;
and a store that stayed unreachable for its whole outage window (``StoreUnavailableError``: the store
already retried for its ``retry_seconds``, the one setting of how long an S3 outage is ridden out).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import tinker
from prefect.cache_policies import TASK_SOURCE, CacheKeyFnPolicy
from prefect.context import TaskRunContext
from prefect.tasks import TaskRunNameCallbackWithParameters, exponential_backoff
from prefect.utilities.annotations import quote as prefect_quote

from tinker_blocks.s3 import StoreUnavailableError

__all__ = [
    "is_transient",
    "retry_condition",
    "RETRY_OPTIONS",
    "cached_options",
    "file_sha256",
    "quote",
    "run_name_from_parameters",
]

T = TypeVar("T")


def quote(value: T) -> T:
    """``value`` wrapped in Prefect's :class:`~prefect.utilities.annotations.quote`: a task argument
    Prefect hands on without walking its items (lists of datums, token lists). Typed as ``value``,
    which is what the task function receives (Prefect unwraps the annotation before the call)."""
    return cast(T, prefect_quote(value))


def run_name_from_parameters(fn: Callable[[dict[str, Any]], str]) -> TaskRunNameCallbackWithParameters:
    """``fn(parameters) -> name`` as a task's ``task_run_name`` (Prefect calls it with the task's
    parameters because its argument is named ``parameters``). Prefect's protocol for such
    callbacks also declares a classmethod, which no plain function has, hence the cast."""
    return cast(TaskRunNameCallbackWithParameters, fn)


def _status(exc: BaseException) -> int | None:
    return getattr(exc, "status_code", None)


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` is a failure that may pass on a retry.

    Walks ``__cause__``/``__context__`` so wrapped SDK errors are classified by their origin.
    """
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, tinker.RequestFailedError):
            return str(cur.category).lower() != "user"
        if isinstance(cur, tinker.APIConnectionError):  # includes APITimeoutError
            return True
        if isinstance(cur, tinker.APIStatusError):
            code = _status(cur) or 0
            return code in (408, 409, 429) or code >= 500
        if isinstance(cur, tinker.TinkerError):  # e.g. a missing or malformed API key
            return False
        if isinstance(cur, StoreUnavailableError):  # the store retried for its whole outage window
            return False  # (retry_seconds): a task retry would stretch that one setting several-fold
        if isinstance(cur, (ConnectionError, TimeoutError)):
            return True
        if isinstance(cur, (ValueError, TypeError, KeyError, FileNotFoundError, PermissionError)):
            return False
        cur = cur.__cause__ or cur.__context__
    return False


def retry_condition(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect ``retry_condition_fn``: retry only transient failures (see :func:`is_transient`)."""
    try:
        state.result(raise_on_failure=True)
    except Exception as exc:  # the task's own exception
        return is_transient(exc)
    return False


#: Keyword arguments for ``@task`` that give every task the same retry behaviour.
RETRY_OPTIONS: dict[str, Any] = dict(
    retries=3,
    retry_delay_seconds=exponential_backoff(backoff_factor=2),
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_condition,
)


def cached_options(cache_key_fn: Callable[[TaskRunContext, dict[str, Any]], str | None]) -> dict[str, Any]:
    """Keyword arguments for ``@task`` of a task whose result is a function of ``cache_key_fn(context,
    parameters)``: cached under that key and the task's source (an edit of the task misses the cache),
    persisted so that a rerun reads it back, and retried as :data:`RETRY_OPTIONS` says."""
    return dict(
        cache_policy=TASK_SOURCE + CacheKeyFnPolicy(cache_key_fn=cache_key_fn), persist_result=True, **RETRY_OPTIONS
    )


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes (used in cache keys of tasks that read files).

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
