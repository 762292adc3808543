"""Session endpoints of the local Tinker server (a part of ``LocalService``: its ``sessions``): list, get, search
(``SessionSearchRequest``), project assignment, the session trace export, and the refusals of
hosted-account features (billing usage events).

A session belongs to the user who created it (``tinker_local.tenancy``): another user's session
is answered as unknown and never listed.  A project is a label (``ServiceClient(project_id=...)``,
``assign_session_project``, ``copy_weights``) used to filter runs, sessions and storage usage.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from .errors import HttpError
from .registry import iso
from .service_base import ServiceState
from .signing import SignatureError
from .tenancy import current_user

DEFAULT_PROJECT = "default"
ACTIVE_HEARTBEAT_S = 60.0  # a session that heartbeated this recently is "active"
_SESSION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,199}$")

# hosted-account features: answered 403 with a message naming the feature
ACCOUNT_FEATURES = {
    "billing/usage/events": "billing usage (AdminClient/RestClient.get_billing_usage)",
}


class SessionEndpoints:
    """The session endpoints (see the module docstring), on the server's ``state``."""

    def __init__(self, state: ServiceState):
        self.state = state

    def _session(self, session_id: str) -> dict[str, Any]:
        s = self.state.registry.sessions.get(session_id)
        if s is None or not self.state.tenancy.owns_session(session_id):
            raise HttpError(404, f"unknown session {session_id!r}")
        return s

    def list_sessions(self, limit: int, offset: int) -> dict[str, Any]:
        """Session ids, newest first."""
        return {"sessions": [sid for sid, _ in self._sessions_newest_first()][offset : offset + limit]}

    def _sessions_newest_first(self) -> list[tuple[str, dict[str, Any]]]:
        return sorted(
            ((sid, s) for sid, s in self.state.registry.sessions.items() if self.state.tenancy.owns_session(sid)),
            key=lambda kv: (kv[1].get("created") or 0, kv[0]),
            reverse=True,
        )

    def get_session(self, session_id: str) -> dict[str, Any]:
        """The training runs and samplers a session created, its metadata and display name."""
        s = self._session(session_id)
        runs = [r.model_id for r in self.state.registry.runs.values() if r.session_id == session_id]
        samplers = [x for x in self.state.registry.samplers if x.startswith(f"{session_id}:")]
        return {
            "training_run_ids": runs,
            "sampler_ids": samplers,
            "user_metadata": _str_dict(s.get("user_metadata")),
            "display_name": s.get("display_name"),
        }

    def assign_session_project(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """Move a session (its runs and samplers) into project ``project_id``."""
        self._session(session_id)
        project = body.get("project_id")
        if not isinstance(project, str) or not project:
            raise HttpError(400, "assign_session_project: 'project_id' is required")
        self.state.registry.update_session(session_id, project_id=project)
        return {}

    # -- search -----------------------------------------------------------------------------------
    def _status(self, s: dict[str, Any]) -> dict[str, Any] | None:
        if s.get("finished") is not None:
            reason = s["finished"] if s["finished"] in ("success", "errored", "interrupted") else "success"
            return {"type": "client_finished", "reason": {"type": reason}}
        hb = s.get("heartbeat")
        if hb is not None and self.state.registry.clock() - hb < ACTIVE_HEARTBEAT_S:
            return {"type": "active"}
        return None

    def _summary(self, sid: str, s: dict[str, Any]) -> dict[str, Any]:
        run_ids = {r.model_id for r in self.state.registry.runs.values() if r.session_id == sid}
        cks = [c for c in self.state.registry.checkpoints.values() if c.model_id in run_ids]
        return {
            "session_id": sid,
            "created_at": iso(s.get("created") or 0),
            "owner": f"tml:user:{self.state.tenancy.session_owner(sid)}",
            "project_id": s.get("project_id") or DEFAULT_PROJECT,
            "status": self._status(s),
            "checkpoints_count": len(cks),
            "display_name": s.get("display_name"),
            "user_metadata": _str_dict(s.get("user_metadata")),
            "checkpoint_storage_bytes": sum(c.size_bytes or 0 for c in cks),
        }

    def search_sessions(self, body: dict[str, Any]) -> dict[str, Any]:
        """One page of ``SessionSearchRequest`` results, newest first (see the SDK type for the
        filters); ``next_cursor`` is set when more match."""
        limit = body.get("limit", 50)
        if not isinstance(limit, int) or not 1 <= limit <= 200:
            raise HttpError(400, f"search_sessions: limit must be 1..200, got {limit!r}")
        owner = body.get("owner") or {"type": "own"}
        if owner.get("type") == "user" and f"tml:user:{current_user()}" not in (owner.get("owner_urns") or []):
            return {"sessions": [], "next_cursor": None}
        cursor = body.get("cursor")
        after = None
        if cursor:
            try:
                after = (
                    datetime.fromisoformat(str(cursor["last_created_at"]).replace("Z", "+00:00")).timestamp(),
                    str(cursor["last_session_id"]),
                )
            except (KeyError, TypeError, ValueError) as e:
                raise HttpError(400, f"search_sessions: malformed cursor {cursor!r} ({e})") from e
        matched = []
        for sid, s in self._sessions_newest_first():
            key = (round(s.get("created") or 0, 6), sid)
            if after is not None and key >= (round(after[0], 6), after[1]):
                continue
            if self._matches(sid, s, body):
                matched.append((sid, s))
                if len(matched) > limit:
                    break
        page = matched[:limit]
        nxt = None
        if len(matched) > limit:
            last_sid, last = page[-1]
            nxt = {"last_created_at": iso(last.get("created") or 0), "last_session_id": last_sid}
        return {"sessions": [self._summary(sid, s) for sid, s in page], "next_cursor": nxt}

    def _matches(self, sid: str, s: dict[str, Any], q: dict[str, Any]) -> bool:
        want_id, name = q.get("session_id"), q.get("display_name")
        if want_id is not None or name is not None:
            by_id = want_id is not None and sid == want_id
            shown = (s.get("display_name") or "").lower()
            by_name = name is not None and all(w in shown for w in str(name).lower().split())
            if not (by_id or by_name):
                return False
        if q.get("project_ids") is not None and (s.get("project_id") or DEFAULT_PROJECT) not in q["project_ids"]:
            return False
        meta = _str_dict(s.get("user_metadata")) or {}
        if any(meta.get(k) != str(v) for k, v in (q.get("user_metadata") or {}).items()):
            return False
        statuses = q.get("statuses")
        if statuses is not None:
            st = self._status(s)
            if not any(_status_matches(st, want) for want in statuses):
                return False
        return True

    # -- trace export -----------------------------------------------------------------------------
    def trace_export(self, session_id: str, base_url: str) -> dict[str, Any]:
        """Write the session's Chrome trace (``tinker_local.trace``) to
        ``<root>/server/traces/<session>.trace.json`` and answer a signed URL to it."""
        self._session(session_id)
        if not _SESSION_ID.match(session_id):
            raise HttpError(400, f"trace_export: session id {session_id!r} cannot name a file")
        folder = self.state.root / "server" / "traces"
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{session_id}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.write_text(json.dumps(self.state.tracer.chrome_trace(session_id)))
        os.replace(tmp, folder / f"{session_id}.trace.json")
        file = f"{session_id}.trace.json"
        url = self.state.signer.url(base_url, "trace", session_id, file, self.state.signer.expiry(self.state.url_ttl_s))
        return {"status": "ready", "url": url}

    def trace_file(self, session_id: str, file: str) -> Path:
        """Path of an exported trace named by a (verified) download URL; HttpError 404 if gone."""
        path = self.state.root / "server" / "traces" / f"{session_id}.trace.json"
        if file != path.name or not _SESSION_ID.match(session_id) or not path.is_file():
            raise HttpError(404, f"no exported trace {file!r} for session {session_id!r}")
        return path

    def trace_download(self, session_id: str, file: str, expires: str | None, sig: str | None) -> Path:
        """The trace file a signed URL of ``trace_export`` names; HttpError 403 for a tampered or
        expired URL, 404 when the trace is gone."""
        try:
            self.state.signer.check("trace", session_id, file, expires, sig)
        except SignatureError as e:
            raise HttpError(403, str(e)) from e
        return self.trace_file(session_id, file)


def account_feature(route: str) -> HttpError:
    """The refusal of a hosted-account feature (HTTP 403 naming it)."""
    what = ACCOUNT_FEATURES[route]
    return HttpError(
        403, f"{what} is a feature of hosted Tinker accounts; tinker_local has no billing or organizations"
    )


def _status_matches(status: dict[str, Any] | None, want: dict[str, Any]) -> bool:
    kind = (want or {}).get("type")
    if status is None or status["type"] != kind:
        return False
    if kind == "client_finished" and want.get("reasons"):
        return status["reason"]["type"] in want["reasons"]
    return True


def _str_dict(meta: Any) -> dict[str, str] | None:
    if not isinstance(meta, dict):
        return None
    return {str(k): str(v) for k, v in meta.items()}
