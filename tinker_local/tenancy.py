"""Users of a shared ``tinker_local`` server: who is calling, what they own, their limits, the audit log.

The HTTP layer authenticates every ``/api/v1`` request (``tinker_local.keys``) and sets
``CURRENT`` to the caller's ``Principal`` for the request's duration (a context variable: it
follows the request into ``asyncio.to_thread`` and into the service's submission code).  Without
keys the server has one user, ``LOCAL_USER``, and answers loopback callers only.

Ownership: a session belongs to the user who created it (``owner`` in its registry record); a
training model, its futures' request ids, its checkpoints (``tinker://<model_id>/...``), its
sampling sessions (``<session>:sample:<n>``) and its traces belong to the owner of its session.
Anything of another user answers exactly as an unknown id would (404 / a failed future with the
same message), so existence does not leak; a checkpoint its owner published
(``RestClient.publish_checkpoint_from_tinker_path``) may be loaded and sampled by every user, and
changed or deleted by its owner only.

Limits (``Limits``; None = unlimited): resident training models per user (live: in sessions not
finished; a finished session's models leave the server's memory) (403), queued requests per user
(429: the SDK retries it), stored checkpoint bytes per user (403 on the next save), compute seconds
per user in the last hour (429 with ``Retry-After``).  A record with no owner (a registry from
before owners were recorded, a run whose session record a killed server never wrote) belongs to
``LOCAL_USER``, the one user of a server without keys; the names the server uses itself
(``RESERVED_USERS``, ``LOCAL_USER`` among them) cannot be given to a key, so on a server with keys
such a record is nobody's.

Audit log: ``<root>/server/audit.jsonl``, one JSON object per line: ``timestamp`` (ISO-8601 UTC),
``event`` (``<resource>_<action>``, the SDK's ``AuditLogEntry.event`` convention), ``user`` and the
ids involved; never a key.  ``GET /api/v1/audit`` answers it to admin keys.
"""

from __future__ import annotations

import contextlib
import contextvars
import ipaddress
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any, Protocol

from .errors import HttpError

LOCAL_USER = "local"  # the one user of a server without keys
ORG_ID = "local"
RESERVED_USERS = frozenset({LOCAL_USER, ORG_ID})  # names no key may take (compared case-insensitively)
QUOTA_WINDOW_S = 3600.0  # the compute-seconds quota counts this many seconds back


class OwnedRecord(Protocol):
    """What :meth:`Tenancy.may_poll` reads of a future (``tinker_local.outcomes.FutureRecord``, which
    imports this module)."""

    user: str  # the user who made the request


@dataclass(frozen=True)
class Principal:
    """The authenticated caller: user ``name``; ``admin`` may read the audit log."""

    name: str
    admin: bool = False

    @property
    def urn(self) -> str:
        return f"tml:user:{self.name}"


LOCAL_PRINCIPAL = Principal(LOCAL_USER, admin=True)
CURRENT: contextvars.ContextVar[Principal] = contextvars.ContextVar("tinker_local_principal", default=LOCAL_PRINCIPAL)


def current_user() -> str:
    """Name of the user whose request is being handled (``LOCAL_USER`` outside a request)."""
    return CURRENT.get().name


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an IP address or ``localhost``) is a loopback address (127/8, ::1)."""
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Limits:
    """Per-user limits (None: unlimited): ``models`` resident training models (in sessions not
    finished), ``queued`` requests waiting or running, ``checkpoint_bytes`` bytes of stored
    checkpoints, ``compute_s_per_hour`` seconds of compute (trainer and sampler workers) used in
    the last ``QUOTA_WINDOW_S`` seconds."""

    models: int | None = None
    queued: int | None = None
    checkpoint_bytes: int | None = None
    compute_s_per_hour: float | None = None


def _split_model(model_id: str) -> str:
    return model_id.split(":train:", 1)[0]


class Tenancy:
    """Ownership checks, limits and the audit log over a ``Registry`` and a ``FutureStore``."""

    def __init__(self, registry: Any, store: Any, root: Path, limits: Limits | None = None):
        self.registry = registry
        self.store = store
        self.limits = limits or Limits()
        self.audit_path = Path(root) / "server" / "audit.jsonl"
        self._audit_lock = threading.Lock()

    # -- ownership ---------------------------------------------------------------------------------
    def session_owner(self, session_id: str) -> str | None:
        """Owner of a known session (None: unknown); one recorded without owner: ``LOCAL_USER``."""
        s = self.registry.sessions.get(session_id)
        return None if s is None else (s.get("owner") or LOCAL_USER)

    def model_owner(self, model_id: str) -> str | None:
        run = self.registry.runs.get(model_id)
        sid = (run.session_id if run is not None else None) or _split_model(model_id)
        owner = self.session_owner(sid)
        if owner is None and run is not None:
            return LOCAL_USER
        return owner

    @contextlib.contextmanager
    def acting_for_owner(self, model_id: str):
        """Run the block as the owner of ``model_id`` (a signed download URL: its signature, made
        for the owner, is the credential; the request carries no key)."""
        token = CURRENT.set(Principal(self.model_owner(model_id) or LOCAL_USER))
        try:
            yield
        finally:
            CURRENT.reset(token)

    def owns_session(self, session_id: str) -> bool:
        return self.session_owner(session_id) == current_user()

    def owns_model(self, model_id: str) -> bool:
        return self.model_owner(model_id) == current_user()

    def owns_sampler(self, sampler_id: str) -> bool:
        return self.session_owner(sampler_id.rsplit(":sample:", 1)[0]) == current_user()

    def may_read(self, ck: Any) -> bool:
        """Whether the caller may load / sample / inspect checkpoint record ``ck``."""
        return bool(ck.public) or self.owns_model(ck.model_id)

    def may_use_session(self, session_id: str) -> bool:
        """A session of the caller; an unknown session only on a server without keys (the SDK's
        requests after a server restart)."""
        owner = self.session_owner(session_id)
        return owner == current_user() if owner is not None else current_user() == LOCAL_USER

    def check_checkpoint_owner(self, model_id: str, checkpoint_id: str) -> None:
        """Changes to a checkpoint (TTL, publish flag, downloads, deletion) are its owner's: another
        user gets HttpError 404 as for an unknown one, or 403 for a checkpoint published to all."""
        if self.owns_model(model_id):
            return
        uri = f"tinker://{model_id}/{checkpoint_id}"
        ck = self.registry.checkpoints.get(uri)
        if ck is None or not ck.public:
            raise HttpError(404, f"unknown checkpoint {uri!r}: not saved on this server, or deleted")
        raise HttpError(
            403,
            f"tinker://{model_id}/{checkpoint_id} is published by another user: "
            "you may load and sample it, only its owner may change or delete it",
        )

    def may_poll(self, record: OwnedRecord) -> bool:
        """Whether the caller may read future ``record`` (a ``tinker_local.outcomes.FutureRecord``)."""
        return record.user == current_user()

    # -- limits ------------------------------------------------------------------------------------
    def live_models(self, user: str) -> int:
        n = 0
        for run in self.registry.runs.values():
            s = self.registry.sessions.get(run.session_id or "") or {}
            if run.trainable and s.get("finished") is None and self.model_owner(run.model_id) == user:
                n += 1
        return n

    def storage_bytes(self, user: str) -> int:
        return sum(
            ck.size_bytes or 0 for ck in self.registry.checkpoints.values() if self.model_owner(ck.model_id) == user
        )

    def check_new_model(self) -> None:
        """HttpError 403 when the caller already has ``limits.models`` live training models."""
        cap, user = self.limits.models, current_user()
        if cap is not None and self.live_models(user) >= cap:
            raise HttpError(
                403,
                f"limit reached: user {user!r} has {cap} resident training models "
                f"(serve --max-models-per-user {cap}); finish a session first",
            )

    def check_queue(self) -> None:
        """HttpError 429 when the caller has ``limits.queued`` requests queued or running."""
        cap, user = self.limits.queued, current_user()
        if cap is not None and self.store.queued_by(user) >= cap:
            raise HttpError(
                429,
                f"limit reached: user {user!r} has {cap} requests queued "
                f"(serve --max-queued-per-user {cap}); retry when some have finished",
            )

    def check_compute(self) -> None:
        """HttpError 429 (with ``Retry-After``: seconds until enough of the window has passed) when
        the caller used ``limits.compute_s_per_hour`` compute seconds or more in the last hour."""
        cap, user = self.limits.compute_s_per_hour, current_user()
        if cap is None:
            return
        used, retry_s = self.store.compute.usage(user, QUOTA_WINDOW_S, cap)
        if used >= cap:
            raise HttpError(
                429,
                f"quota reached: user {user!r} used {used:.1f} compute seconds in the last hour "
                f"(serve --compute-seconds-per-user-hour {cap:g}); retry in {retry_s:.0f} s",
                headers={"Retry-After": str(max(1, round(retry_s)))},
            )

    def counters(self, user: str) -> dict[str, Any]:
        """What ``GET /api/v1/local_stats`` shows ``user`` of their own use: compute (jobs,
        seconds since start and in the last hour), requests queued or running, resident training
        models, checkpoint bytes, and their limits (None: unlimited)."""
        used, _ = self.store.compute.usage(user, QUOTA_WINDOW_S, None)
        totals = self.store.compute.user_totals().get(user, {})
        return {
            "jobs": int(totals.get("jobs", 0)),
            "compute_s": round(float(totals.get("compute_s", 0.0)), 3),
            "compute_s_last_hour": round(used, 3),
            "queued": self.store.queued_by(user),
            "resident_models": self.live_models(user),
            "checkpoint_bytes": self.storage_bytes(user),
            "limits": {
                "models": self.limits.models,
                "queued": self.limits.queued,
                "checkpoint_bytes": self.limits.checkpoint_bytes,
                "compute_s_per_hour": self.limits.compute_s_per_hour,
            },
        }

    def check_storage(self) -> None:
        """HttpError 403 when the caller's checkpoints hold ``limits.checkpoint_bytes`` or more."""
        cap, user = self.limits.checkpoint_bytes, current_user()
        if cap is not None and self.storage_bytes(user) >= cap:
            raise HttpError(
                403,
                f"limit reached: user {user!r} stores {self.storage_bytes(user)} bytes "
                f"of checkpoints (serve --max-checkpoint-bytes-per-user {cap}); "
                "delete some first",
            )

    # -- request guard -----------------------------------------------------------------------------
    def guard(self, endpoint: str, body: dict[str, Any]) -> dict | None:
        """Check a JSON request of ``endpoint`` before the service sees it: raise HttpError
        (404 for another user's ids, as for unknown ones; 403/429 for limits), or return the
        answer to give instead (a request id whose future failed as for an unknown model), or
        None to go on.  A refused ordered request consumes its ``seq_id``."""
        mid, sid = body.get("model_id"), body.get("session_id")
        if endpoint in ("create_model", "create_sampling_session", "create_custom_loss") or (
            endpoint == "load_weights" and sid is not None
        ):
            if not self.may_use_session(str(sid)):
                raise HttpError(404, f"{endpoint}: unknown session {sid!r}")
            if endpoint in ("create_model", "load_weights"):
                self.check_new_model()
        elif isinstance(mid, str):
            if not self.owns_model(mid):
                msg = f"unknown model_id {mid!r}: create a training client first"
                if endpoint == "get_info":
                    raise HttpError(404, f"get_info: {msg}")
                return {"request_id": self.store.fail_now(endpoint, msg), "model_id": mid}
        sampler = body.get("sampling_session_id")
        if (
            endpoint in ("asample", "join_sampling_session")
            and sampler is not None
            and not self.owns_sampler(str(sampler))
        ):
            raise HttpError(404, f"{endpoint}: unknown sampling session {sampler!r}")
        if endpoint in (
            "optim_step",
            "asample",
            "save_weights",
            "save_weights_for_sampler",
            "save_weights_external",
            "load_weights",
            "create_model",
        ):
            self._burning(body, self.check_queue)
            self._burning(body, self.check_compute)
        if endpoint.startswith("save_weights"):
            self._burning(body, self.check_storage)
        return None

    def _burning(self, body: dict[str, Any], check: Callable[[], None]) -> None:
        try:
            check()
        except HttpError as e:
            mid, seq = body.get("model_id"), body.get("seq_id")
            if e.status != 429 and isinstance(mid, str) and isinstance(seq, int) and mid in self.registry.runs:
                self.store.burn(mid, seq, e.detail)  # a 429 is retried with the same seq_id
            raise

    # -- audit log ---------------------------------------------------------------------------------
    def audit(self, event: str, **details: Any) -> None:
        """Append ``event`` (``<resource>_<action>``) by the current user to the audit log."""
        row = {
            "timestamp": datetime.now(UTC).isoformat(),
            "event": event,
            "user": current_user(),
            **{k: v for k, v in details.items() if v is not None},
        }
        line = json.dumps(row, default=str) + "\n"
        with self._audit_lock:
            self.audit_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.audit_path, "a") as f:
                f.write(line)

    def audit_log(self, event_type: str = "all", day: str | None = None) -> dict[str, Any]:
        """``AuditLogResponse`` of the UTC day ``day`` (ISO date; default today): entries whose
        event's resource is ``event_type`` ("checkpoints" -> ``checkpoint_*``; "all": every one).
        HttpError 403 unless the caller's key is an admin key."""
        if not CURRENT.get().admin:
            raise HttpError(403, "the audit log needs an admin key (prefect-tinker local keys add NAME --admin)")
        try:
            want_day = date.fromisoformat(day) if day else datetime.now(UTC).date()
        except ValueError as e:
            raise HttpError(400, f"audit: day must be YYYY-MM-DD, got {day!r}") from e
        prefix = None if event_type == "all" else event_type.rstrip("s") + "_"
        entries = []
        try:
            lines = self.audit_path.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            row = json.loads(line)
            ts = datetime.fromisoformat(row["timestamp"])
            if ts.date() != want_day or (prefix is not None and not row["event"].startswith(prefix)):
                continue
            details = {k: v for k, v in row.items() if k not in ("timestamp", "event")}
            entries.append(
                {
                    "timestamp": row["timestamp"],
                    "event": row["event"],
                    "event_details": details,
                    "model_id": row.get("model_id"),
                    "tinker_path": row.get("tinker_path"),
                }
            )
        return {"entries": entries}
