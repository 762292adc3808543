"""One request's work on the local server (``Job``) and running it into an ``Outcome``.

A ``Job`` is what ``tinker_local.futures.FutureStore`` queues: a plain job runs its ``fn``
(``run_job``); the jobs of one batch run together through the head job's ``batch_fn`` (``run_batch``:
payloads in, one result per payload out; an exception fails every job of the batch, an exception
returned in place of one result fails that job only).  Either way what comes back or is raised
becomes an ``Outcome`` by ``tinker_local.outcomes.execute``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .outcomes import Outcome, execute
from .tenancy import LOCAL_USER


@dataclass
class Job:
    """Work for the compute thread. ``fn`` returns an Outcome, a JSON dict or proto bytes; a
    batchable job has ``batch_key``, ``payload`` and ``batch_fn(list of payloads) -> list of
    results`` (each an Outcome / dict / bytes, or an Exception failing that job only)."""

    request_id: str
    kind: str
    fn: Callable[[], Any] | None
    model_id: str | None = None
    seq_id: int | None = None
    order: int = 0
    enqueued_at: float = field(default_factory=time.monotonic)
    batch_key: Any = None
    payload: Any = None
    batch_fn: Callable[[list[Any]], list[Any]] | None = None
    max_linger_s: float | None = None  # batch head: longest wait for more jobs (s; None: no limit
    # beyond the store's batch_max_wait_s)
    user: str = LOCAL_USER  # who submitted it (round-robin turns, per-user queue limits)


def run_batch(jobs: list[Job]) -> list[Outcome]:
    """Run ``jobs`` through their ``batch_fn``; per-job exceptions fail that job only."""
    head = jobs[0]
    results: list[Any]
    try:
        if head.batch_fn is None:
            raise RuntimeError(f"{head.kind}: a batched job has no batch_fn")
        results = head.batch_fn([j.payload for j in jobs])
        if len(results) != len(jobs):
            raise RuntimeError(f"batch_fn returned {len(results)} results for {len(jobs)} jobs")
    except Exception as e:
        results = [e] * len(jobs)
    return [
        execute(job.kind, job.request_id, functools.partial(_raise_or, res), job.model_id, job.seq_id)
        for job, res in zip(jobs, results, strict=True)
    ]


def _raise_or(result: Any) -> Any:
    if isinstance(result, BaseException):
        raise result
    return result


def run_job(job: Job) -> Outcome:
    """Run a job that is not batched (its ``fn``) into an ``Outcome``."""
    return execute(job.kind, job.request_id, job.fn, job.model_id, job.seq_id)
