"""The future store and the single compute worker of the local Tinker server.

Every mutating request gets a request id at once; its work is a ``Job`` that runs on one
compute thread (the engine is never entered by two threads). Jobs of a training model that
carry a ``seq_id`` run strictly in seq_id order: a later seq_id waits until the previous one
has started; a seq_id that was already submitted returns the original request id. If the
next seq_id has not arrived after ``gap_timeout_s`` seconds while later ones wait, the lane
skips ahead (logged) so a client that died mid-submission cannot stall a model forever.

Fair share: every job belongs to the user whose request submitted it; when several users have
runnable jobs, the compute thread serves them in turn (round-robin over user names), so one
user's flood of sampling requests delays another user's training step by at most one job (or
one batch), not by the whole flood.  While another user's jobs wait, a batch does not linger for
more requests and takes at most ``FAIR_BATCH_JOBS`` jobs, so that one batch stays short.  One
user's own jobs keep their arrival order.

Batching: jobs submitted with a ``batch_key`` (sampling) wait in arrival order like any other;
when the compute thread reaches one, it lingers while more such requests are still being
received (``incoming``, counted by the HTTP layer) or keep arriving (gaps under the quiet
window), and then runs all queued jobs with that key in one call of their ``batch_fn``
(payloads in, one result per payload out).  The linger lasts at most ``batch_max_wait_s``, and
at most the first job's ``max_linger_s`` (the service sets it in proportion to the work the
batch will do, so a short request never waits long); the quiet window is ``batch_quiet_s``,
within that bound.  Which jobs share a batch depends on timing; what each job computes must
not (the sampling engine draws each request's tokens from its own seeded generator).

Side executors (``add_executor(name, threads)``): jobs submitted with ``executor=name`` wait in
that executor's own FIFO (users taking turns as on the compute thread) and run on its threads
instead of the compute thread (the sampler worker pool of ``tinker_local.sampler_pool`` uses one
thread per worker process, so sampling overlaps training).  Batching works there as above; one
thread of an executor lingers at a time, so concurrent requests still share a batch.  Without
side executors (the default) everything runs on the one compute thread.

Compute per user: each job's wall seconds on its thread (a batch's split evenly over its jobs) are
charged to its user in ``FutureStore.compute`` (``tinker_local.compute_usage``: the per-user
compute quota of ``tinker_local.tenancy`` and ``GET local_stats``).

What a job is and how one (or a batch) runs: ``tinker_local.jobs``.  Results are ``Outcome``s
(``tinker_local.outcomes``: JSON dicts, protobuf bytes, or an error with category "user" |
"server").  A result is kept ``RESULT_TTL_S`` seconds, or
``RETRIEVED_TTL_S`` after it was first delivered (re-polls after a lost response still find it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from .compute_usage import ComputeUsage
from .jobs import Job, run_batch, run_job
from .outcomes import FutureRecord, Outcome
from .tenancy import current_user

logger = logging.getLogger("tinker_local.futures")

# Completed futures are kept this long (seconds) so that re-polls after a network error work.
RESULT_TTL_S = 1800.0
RETRIEVED_TTL_S = 120.0
MAX_BATCH_JOBS = 256
FAIR_BATCH_JOBS = 8  # batch size bound while another user's jobs wait (fair share)


class _Lane:
    def __init__(self, next_seq: int):
        self.next_seq = next_seq
        self.pending: dict[int, Job] = {}
        self.blocked_since: float | None = None


class FutureStore:
    """Request ids -> FutureRecord, the per-model seq_id lanes, and the compute thread.

    Args:
        gap_timeout_s: how long a model's lane waits for a missing seq_id before skipping it.
        batch_quiet_s, batch_max_wait_s: linger of a batchable job (see the module docstring).
    """

    def __init__(self, gap_timeout_s: float = 30.0, batch_quiet_s: float = 0.05, batch_max_wait_s: float = 0.1):
        self.gap_timeout_s = gap_timeout_s
        self.batch_quiet_s = batch_quiet_s
        self.batch_max_wait_s = batch_max_wait_s
        self._last_batchable = 0.0
        self._incoming = 0  # batchable requests being received by the HTTP layer
        self.stats = {"jobs": 0, "batches": 0, "batched_jobs": 0, "max_batch": 0}
        self._records: dict[str, FutureRecord] = {}
        self._dedupe: dict[tuple[str, int], str] = {}
        self._lanes: dict[str, _Lane] = {}
        self._fifo: deque[Job] = deque()
        self._side: dict[str, deque[Job]] = {}  # side executor name -> its FIFO
        self._collecting: set[str] = set()  # side executors with a thread lingering for a batch
        self._side_n: dict[str, int] = {}  # side executor name -> threads
        self._side_last: dict[str, str] = {}  # side executor name -> user it served last
        self._side_threads: list[threading.Thread] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self.running: Job | None = None
        self._last_user: str | None = None  # whose job the compute thread took last (round-robin)
        self.compute = ComputeUsage()  # compute seconds per user (tenancy's quota, local_stats)

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Start the compute thread; ``loop`` is the event loop that awaits futures."""
        self._loop = loop
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="tinker-local-compute", daemon=True)
            self._thread.start()
            for name, n in self._side_n.items():
                for k in range(n):
                    t = threading.Thread(
                        target=self._run_side, args=(name,), daemon=True, name=f"tinker-local-{name}-{k}"
                    )
                    t.start()
                    self._side_threads.append(t)

    def add_executor(self, name: str, threads: int) -> None:
        """Declare side executor ``name`` served by ``threads`` threads (before ``start``)."""
        if threads < 1:
            raise ValueError(f"executor {name!r} needs >= 1 thread, got {threads}")
        with self._cv:
            self._side.setdefault(name, deque())
            self._side_n[name] = int(threads)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for t in self._side_threads:
            t.join(timeout)
        self._side_threads = []

    # -- submission ------------------------------------------------------------------------------
    def register_model(self, model_id: str, next_seq: int = 1) -> None:
        """Open the seq_id lane of a model; its first ordered request is ``next_seq``."""
        with self._cv:
            lane = self._lanes.get(model_id)
            if lane is None:
                self._lanes[model_id] = _Lane(next_seq)

    def lookup_seq(self, model_id: str, seq_id: int) -> str | None:
        """The request id already submitted for (model_id, seq_id), if any."""
        with self._cv:
            return self._dedupe.get((model_id, seq_id))

    def submit(
        self,
        kind: str,
        fn: Callable[[], Any] | None,
        *,
        model_id: str | None = None,
        seq_id: int | None = None,
        dedupe_key: tuple[str, int] | None = None,
        batch_key: Any = None,
        payload: Any = None,
        batch_fn: Callable[[list[Any]], list[Any]] | None = None,
        max_linger_s: float | None = None,
        executor: str | None = None,
    ) -> str:
        """Queue ``fn`` and return its request id (a repeated dedupe key returns the first id).

        With ``model_id`` and ``seq_id`` the job joins that model's ordered lane; otherwise it
        runs in arrival order. ``dedupe_key`` defaults to (model_id, seq_id) when both are set.
        A job with ``batch_key`` (no lane) runs through ``batch_fn([payload, ...])`` together
        with the other queued jobs of that key; ``max_linger_s`` (seconds) lowers the bound on how
        long it waits for them when it heads a batch (``batch_max_wait_s``).  ``executor``: the
        name of a side executor (``add_executor``) to run the job on instead of the compute thread
        (not with ``model_id``/``seq_id``); KeyError for an undeclared name.  The job belongs to
        the user of the request being handled (``tenancy.current_user``).
        """
        if executor is not None and executor not in self._side:
            raise KeyError(f"unknown executor {executor!r}")
        if dedupe_key is None and model_id is not None and seq_id is not None:
            dedupe_key = (model_id, seq_id)
        with self._cv:
            if dedupe_key is not None and dedupe_key in self._dedupe:
                rid = self._dedupe[dedupe_key]
                logger.info("repeated %s seq %s: returning request %s", kind, dedupe_key, rid)
                return rid
            self._purge_locked()
            rid = uuid.uuid4().hex
            user = current_user()
            self._records[rid] = FutureRecord(rid, kind, self._loop, user)
            if dedupe_key is not None:
                self._dedupe[dedupe_key] = rid
            job = Job(
                rid,
                kind,
                fn,
                model_id,
                seq_id,
                next(self._order),
                batch_key=batch_key,
                payload=payload,
                batch_fn=batch_fn,
                max_linger_s=max_linger_s,
                user=user,
            )
            if batch_key is not None:
                self._last_batchable = time.monotonic()
            if executor is not None:
                self._side[executor].append(job)
            elif model_id is not None and seq_id is not None:
                lane = self._lanes.get(model_id)
                if lane is None:  # unknown model (e.g. after a restart): start where it starts
                    lane = self._lanes[model_id] = _Lane(seq_id)
                if seq_id < lane.next_seq:
                    logger.warning(
                        "model %s: seq_id %d arrived after %d ran; running it now", model_id, seq_id, lane.next_seq - 1
                    )
                    self._fifo.append(job)
                else:
                    lane.pending[seq_id] = job
            else:
                self._fifo.append(job)
            self._cv.notify_all()
            return rid

    def incoming(self, delta: int) -> None:
        """The HTTP layer started (+1) or finished (-1) receiving a batchable request; a
        lingering batch waits for the ones in progress (within its bound)."""
        with self._cv:
            self._incoming = max(0, self._incoming + delta)
            if delta < 0:
                self._cv.notify_all()

    def burn(self, model_id: str, seq_id: int, reason: str) -> None:
        """Consume ``seq_id`` of ``model_id``'s lane without work (its request was refused at
        submission), so that the model's next request does not wait for it."""
        if (model_id, seq_id) in self._dedupe:
            return
        self.submit("refused", lambda: Outcome(error=reason, category="user"), model_id=model_id, seq_id=seq_id)

    def mark_delivered(self, request_id: str) -> None:
        """Note that a result was answered to a poll (it is then kept ``RETRIEVED_TTL_S``)."""
        rec = self.get(request_id)
        if rec is not None and rec.delivered_at is None:
            rec.delivered_at = time.time()

    def fail_now(self, kind: str, error: str, category: str = "user") -> str:
        """A request id whose future has already failed (for errors found at submission)."""
        with self._cv:
            rid = uuid.uuid4().hex
            rec = self._records[rid] = FutureRecord(rid, kind, self._loop, current_user())
        rec.complete(Outcome(error=error, category=category))
        return rid

    def get(self, request_id: str) -> FutureRecord | None:
        with self._cv:
            return self._records.get(request_id)

    def queued_by(self, user: str) -> int:
        """Jobs of ``user`` waiting or running (the per-user queue limit counts these)."""
        with self._cv:
            jobs = list(self._fifo) + [j for lane in self._lanes.values() for j in lane.pending.values()]
            jobs += [j for f in self._side.values() for j in f]
            n = sum(1 for j in jobs if j.user == user)
            return n + (1 if self.running is not None and self.running.user == user else 0)

    # -- compute thread --------------------------------------------------------------------------
    def _purge_locked(self) -> None:
        now = time.time()
        old = [
            rid
            for rid, r in self._records.items()
            if (r.completed_at is not None and now - r.completed_at > RESULT_TTL_S)
            or (r.delivered_at is not None and now - r.delivered_at > RETRIEVED_TTL_S)
        ]
        for rid in old:
            del self._records[rid]
        if old:
            gone = set(old)
            self._dedupe = {k: v for k, v in self._dedupe.items() if v not in gone}

    def _pick_locked(self) -> tuple[Job | None, float]:
        """Next runnable job and how long to wait if none.  Users take turns (round-robin in
        name order, starting after the user served last); within a user's turn the job that
        arrived first runs (a model's ordered lane offers only its next seq_id)."""
        heads: dict[str, tuple[Job, _Lane | None]] = {}  # user -> earliest runnable job
        wait = 3600.0
        now = time.monotonic()
        for job in self._fifo:
            if job.user not in heads:
                heads[job.user] = (job, None)
        for lane in self._lanes.values():
            if not lane.pending:
                lane.blocked_since = None
                continue
            head = lane.pending.get(lane.next_seq)
            if head is None:
                if lane.blocked_since is None:
                    lane.blocked_since = now
                if now - lane.blocked_since >= self.gap_timeout_s:
                    skip_to = min(lane.pending)
                    logger.warning("seq_id %d never arrived; skipping to %d", lane.next_seq, skip_to)
                    lane.next_seq = skip_to
                    head = lane.pending[skip_to]
                else:
                    wait = min(wait, self.gap_timeout_s - (now - lane.blocked_since))
                    continue
            lane.blocked_since = None
            if head.user not in heads or head.order < heads[head.user][0].order:
                heads[head.user] = (head, lane)
        if not heads:
            return None, wait
        users = sorted(heads)
        later = [u for u in users if self._last_user is not None and u > self._last_user]
        best, best_lane = heads[(later or users)[0]]
        self._last_user = best.user
        if best_lane is not None and best.seq_id is not None:  # a lane's jobs all carry their seq_id
            del best_lane.pending[best.seq_id]
            best_lane.next_seq = best.seq_id + 1
        else:
            del self._fifo[next(i for i, j in enumerate(self._fifo) if j is best)]
        return best, 0.0

    def _run(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._stop:
                        return
                    job, wait = self._pick_locked()
                    if job is not None:
                        break
                    self._cv.wait(timeout=max(0.05, wait))
                jobs = self._collect_batch_locked(job) if job.batch_key is not None else [job]
                self.running = job
                self.stats["jobs"] += len(jobs)
            t0 = time.monotonic()
            outcomes = run_batch(jobs) if job.batch_key is not None else [run_job(job)]
            with self._cv:
                self.running = None
                self.compute.charge([j.user for j in jobs], t0)
                recs = [self._records.get(j.request_id) for j in jobs]
            for rec, outcome in zip(recs, outcomes, strict=True):
                if rec is not None:
                    rec.complete(outcome)

    def _run_side(self, name: str) -> None:
        """A thread of side executor ``name``: its FIFO's jobs, batched like the compute thread's."""
        fifo = self._side[name]
        while True:
            with self._cv:
                while self._stop is False and (not fifo or name in self._collecting):
                    self._cv.wait(timeout=0.5)
                if self._stop:
                    return
                job = self._pop_fair_locked(fifo, name)
                if job.batch_key is not None:
                    self._collecting.add(name)
                    try:
                        jobs = self._collect_batch_locked(job, fifo)
                    finally:
                        self._collecting.discard(name)
                        self._cv.notify_all()
                else:
                    jobs = [job]
                self.stats["jobs"] += len(jobs)
            t0 = time.monotonic()
            outcomes = run_batch(jobs) if job.batch_key is not None else [run_job(job)]
            with self._cv:
                self.compute.charge([j.user for j in jobs], t0)
                recs = [self._records.get(j.request_id) for j in jobs]
            for rec, outcome in zip(recs, outcomes, strict=True):
                if rec is not None:
                    rec.complete(outcome)

    def _pop_fair_locked(self, fifo: deque[Job], name: str) -> Job:
        """The next job of side executor ``name``: the earliest of the user after the one it
        served last (round-robin over user names, as on the compute thread)."""
        users = sorted({j.user for j in fifo})
        last = self._side_last.get(name)
        user = ([u for u in users if last is not None and u > last] or users)[0]
        i = next(k for k, j in enumerate(fifo) if j.user == user)
        job = fifo[i]
        del fifo[i]
        self._side_last[name] = user
        return job

    def _collect_batch_locked(self, first: Job, fifo: deque[Job] | None = None) -> list[Job]:
        """Linger while jobs of ``first.batch_key`` are being received or keep arriving (see the
        module docstring), then take them all from ``fifo`` (default: the compute thread's) in
        FIFO order; while another user's jobs wait there, at once and at most ``FAIR_BATCH_JOBS``."""
        fifo = self._fifo if fifo is None else fifo
        bound = self.batch_max_wait_s
        if first.max_linger_s is not None:
            bound = min(bound, max(0.0, first.max_linger_s))
        window = min(self.batch_quiet_s, bound)
        deadline = time.monotonic() + bound
        while not self._stop:
            now = time.monotonic()
            quiet = now - self._last_batchable
            if (
                (quiet >= window and not self._incoming)
                or now >= deadline
                or self._others_waiting_locked(first.user, fifo)
            ):
                break
            # woken early by submit() and by incoming(-1)
            self._cv.wait(timeout=min(window - quiet if quiet < window else bound, deadline - now))
        cap = FAIR_BATCH_JOBS if self._others_waiting_locked(first.user, fifo) else MAX_BATCH_JOBS
        jobs, rest = [first], deque[Job]()
        while fifo:
            j = fifo.popleft()
            if j.batch_key == first.batch_key and len(jobs) < cap:
                jobs.append(j)
            else:
                rest.append(j)
        fifo.extend(rest)
        self.stats["batches"] += 1
        self.stats["batched_jobs"] += len(jobs)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(jobs))
        return jobs

    def _others_waiting_locked(self, user: str, fifo: deque[Job]) -> bool:
        """Whether a job of a user other than ``user`` waits in ``fifo`` (or, for the compute
        thread's FIFO, in a model's lane)."""
        if any(j.user != user for j in fifo):
            return True
        return fifo is self._fifo and any(
            j.user != user for lane in self._lanes.values() for j in lane.pending.values()
        )
