"""Per-session request timeline of the local Tinker server, exported as a Chrome trace.

Every queued request (training, sampling, checkpoint saves, custom losses) is recorded with its
submission, start and end times; synchronous session events (created, finished, sampling
session created) are instants.  ``chrome_trace(session_id)`` renders them in the Trace Event
Format (the JSON of ``chrome://tracing``, which https://ui.perfetto.dev opens too):

- one process per session, one thread (track) per training run or sampling session;
- a complete event (``"ph": "X"``, ``ts``/``dur`` in microseconds since the Unix epoch) per
  request for the time it computed, with ``args``: request_id, queue_ms, run_ms, status
  ("ok" | "user error" | "server error") and the request's own fields (seq_id, datums, ...);
- an async span (``"ph": "b"``/``"e"``, category ``queue``) for the time it waited in the queue.

Source of the format: "Trace Event Format" (Google, docs.google.com/document/d/
1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU).  Events are kept in memory, at most
``MAX_EVENTS_PER_SESSION`` per session (oldest dropped first) for the ``MAX_SESSIONS`` sessions
that started last.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .outcomes import Outcome

MAX_EVENTS_PER_SESSION = 100_000
MAX_SESSIONS = 1000  # the timelines of the most recently started sessions are kept


@dataclass(eq=False, slots=True)
class Span:
    """One request: times in Unix seconds (``start``/``end`` None while queued/running)."""

    name: str
    track: str
    request_id: str
    submitted: float
    start: float | None = None
    end: float | None = None
    status: str = "pending"
    args: dict[str, Any] = field(default_factory=dict)


def session_of(entity_id: str | None) -> str | None:
    """The session id inside a model id ``<session>:train:<n>``, a sampler id
    ``<session>:sample:<n>`` or a loss id ``<session>:loss:<n>``; None for anything else."""
    if not entity_id:
        return None
    for marker in (":train:", ":sample:", ":loss:"):
        if marker in entity_id:
            return entity_id.split(marker, 1)[0]
    return None


class Tracer:
    """Thread-safe store of spans and instants by session.  ``clock``: Unix seconds."""

    def __init__(self, clock: Callable[[], float] = time.time):
        self.clock = clock
        self._lock = threading.Lock()
        self._events: dict[str, deque] = {}

    def _add(self, session_id: str, item: Any) -> None:
        with self._lock:
            q = self._events.get(session_id)
            if q is None:
                if len(self._events) >= MAX_SESSIONS:
                    del self._events[next(iter(self._events))]  # the oldest timeline
                q = self._events[session_id] = deque(maxlen=MAX_EVENTS_PER_SESSION)
            q.append(item)

    def instant(self, session_id: str | None, name: str, track: str = "session", /, **args: Any) -> None:
        """Record a synchronous event now (no-op without a session)."""
        if session_id:
            self._add(session_id, ("instant", name, track, self.clock(), args))

    def wrap(
        self, session_id: str | None, name: str, track: str, fn: Callable[[], Any], /, **args: Any
    ) -> tuple[Callable[[], Any], Span | None]:
        """``fn`` wrapped to record its start and end; returns (wrapped fn, span).  Set
        ``span.request_id`` once the request id is known.  Without a session: ``fn`` unchanged."""
        if not session_id:
            return fn, None
        span = Span(name, track, "", self.clock(), args=args)
        self._add(session_id, span)

        def run() -> Any:
            span.start = self.clock()
            try:
                result = fn()
            except Exception as e:
                span.status = _status_of_exception(e)
                raise
            else:
                if isinstance(result, Outcome) and result.error is not None:  # else a dict or bytes: done
                    span.status = f"{result.category} error"
                else:
                    span.status = "ok"
                return result
            finally:
                span.end = self.clock()

        return run, span

    @staticmethod
    def bind(span: Span | None, request_id: str) -> None:
        """Name ``span`` by the request id its submission got."""
        if span is not None:
            span.request_id = request_id

    def open_span(self, session_id: str | None, name: str, track: str, /, **args: Any) -> Span | None:
        """A span whose start/end the caller sets (batched sampling)."""
        if not session_id:
            return None
        span = Span(name, track, "", self.clock(), args=args)
        self._add(session_id, span)
        return span

    def sessions(self) -> list[str]:
        with self._lock:
            return list(self._events)

    def chrome_trace(self, session_id: str) -> dict[str, Any]:
        """The session's events as a Trace Event Format object (``{"traceEvents": [...]}``)."""
        with self._lock:
            items = list(self._events.get(session_id, ()))
        tracks: dict[str, int] = {"session": 1}
        events: list[dict[str, Any]] = []

        def tid(track: str) -> int:
            if track not in tracks:
                tracks[track] = len(tracks) + 1
            return tracks[track]

        for it in items:
            if isinstance(it, Span):
                t = tid(it.track)
                args = {"request_id": it.request_id, "status": it.status, **it.args}
                if it.start is not None:
                    end = it.end if it.end is not None else self.clock()
                    args.update(
                        queue_ms=round((it.start - it.submitted) * 1e3, 3), run_ms=round((end - it.start) * 1e3, 3)
                    )
                    events.append(
                        {
                            "name": it.name,
                            "cat": "request",
                            "ph": "X",
                            "pid": 1,
                            "tid": t,
                            "ts": _us(it.start),
                            "dur": max(_us(end) - _us(it.start), 0),
                            "args": args,
                        }
                    )
                qend = it.start if it.start is not None else self.clock()
                qid = it.request_id or f"span-{id(it)}"
                events.append(
                    {
                        "name": f"queued {it.name}",
                        "cat": "queue",
                        "ph": "b",
                        "id": qid,
                        "pid": 1,
                        "tid": t,
                        "ts": _us(it.submitted),
                        "args": {"request_id": it.request_id},
                    }
                )
                events.append(
                    {
                        "name": f"queued {it.name}",
                        "cat": "queue",
                        "ph": "e",
                        "id": qid,
                        "pid": 1,
                        "tid": t,
                        "ts": _us(qend),
                    }
                )
            else:
                _, name, track, ts, args = it
                events.append(
                    {
                        "name": name,
                        "cat": "session",
                        "ph": "i",
                        "s": "t",
                        "pid": 1,
                        "tid": tid(track),
                        "ts": _us(ts),
                        "args": args,
                    }
                )
        meta = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": 1,
                "tid": 0,
                "args": {"name": f"tinker_local session {session_id}"},
            }
        ]
        meta += [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": n, "args": {"name": track}}
            for track, n in tracks.items()
        ]
        events.sort(key=lambda e: e["ts"])
        return {
            "traceEvents": meta + events,
            "displayTimeUnit": "ms",
            "otherData": {"session_id": session_id, "exporter": "tinker_local"},
        }


def _us(t: float) -> int:
    return int(round(t * 1e6))


def _status_of_exception(e: BaseException) -> str:
    from .outcomes import is_user_error

    return "user error" if is_user_error(e) else "server error"
