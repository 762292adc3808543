"""Bookkeeping of the local Tinker server: sessions, training runs, checkpoints, samplers.

Sessions, training runs and checkpoints (with their TTL and publish flag) are persisted as an
append-only JSON-lines log at ``<root>/server/registry.jsonl`` so that ``tinker://`` paths stay
resolvable after a server restart (resume from a checkpoint with
``create_training_client_from_state_with_optimizer``).  Heartbeats and sampling sessions live in
memory only.  Times are Unix seconds from ``Registry.clock`` (``time.time``; tests move it).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger("tinker_local.registry")


def iso(ts: float) -> str:
    """Unix seconds -> ISO 8601 UTC string (what the REST types parse as datetime)."""
    return datetime.fromtimestamp(ts, tz=UTC).isoformat()


@dataclass
class RunRecord:
    """A training model (Tinker 'training run'); ``model_id`` is ``<session>:train:<n>``."""

    model_id: str
    base_model: str
    lora_rank: int
    seed: int | None = None
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    session_id: str | None = None
    user_metadata: dict[str, str] | None = None
    created: float = field(default_factory=time.time)
    last_request: float = field(default_factory=time.time)
    project_id: str | None = None
    trainable: bool = True  # False for a copy (``copy_weights``): it holds checkpoints only
    copied_from: str | None = None  # tinker:// path a copy was made from


_SEGMENT = {"state": "weights", "sampler": "sampler_weights", "external": "external_weights"}
_REST_TYPE = {"state": "training", "sampler": "sampler", "external": "external"}


@dataclass
class CheckpointRecord:
    """A saved checkpoint: ``kind`` is "state" (weights + optimizer), "sampler" (adapter) or
    "external" (PEFT export, ``save_weights_external``).  ``expires_at``: Unix seconds after
    which it is deleted (None: never); ``public``: the publish flag."""

    uri: str
    model_id: str
    kind: str
    name: str
    path: str
    time: float = field(default_factory=time.time)
    size_bytes: int | None = None
    user_metadata: dict[str, str] | None = None
    public: bool = False
    expires_at: float | None = None

    @property
    def checkpoint_id(self) -> str:
        return f"{_SEGMENT[self.kind]}/{self.name}"

    def to_rest(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id,
            "checkpoint_type": _REST_TYPE[self.kind],
            "time": iso(self.time),
            "tinker_path": self.uri,
            "size_bytes": self.size_bytes,
            "public": self.public,
            "user_metadata": self.user_metadata,
            "expires_at": iso(self.expires_at) if self.expires_at is not None else None,
        }


@dataclass
class SamplerRecord:
    """A sampling session: a base model plus optional sampler weights."""

    sampler_id: str
    base_model: str
    model_path: str | None = None
    weights_path: str | None = None
    clients: int = 0


def dir_size(path: Path) -> int | None:
    """Total bytes of the files under ``path`` (a file or folder); None if missing."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    if not p.exists():
        return None
    total = 0
    for dirpath, _dirs, files in os.walk(p):
        for f in files:
            try:
                total += (Path(dirpath) / f).stat().st_size
            except OSError:
                pass
    return total


# session fields persisted in the log (heartbeats are not)
_SESSION_FIELDS = ("created", "finished", "tags", "sdk_version", "user_metadata", "project_id", "display_name")
_CHECKPOINT_UPDATABLE = ("public", "expires_at")


class Registry:
    """Thread-safe registry; ``root`` is the server root folder (log under root/server/).
    ``clock``: the time source (Unix seconds) for creation times and expiry."""

    def __init__(self, root: Path, clock=time.time):
        self.root = Path(root)
        self.clock = clock
        self.log_path = self.root / "server" / "registry.jsonl"
        self._lock = threading.RLock()
        self.sessions: dict[str, dict[str, Any]] = {}
        self.runs: dict[str, RunRecord] = {}
        self.checkpoints: dict[str, CheckpointRecord] = {}
        self.samplers: dict[str, SamplerRecord] = {}
        self._load()

    # -- persistence -----------------------------------------------------------------------------
    def _load(self) -> None:
        if not self.log_path.exists():
            return
        for lineno, line in enumerate(self.log_path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
                kind = ev.pop("event")
                if kind == "run":
                    self.runs[ev["model_id"]] = RunRecord(**ev)
                elif kind == "checkpoint":
                    self.checkpoints[ev["uri"]] = CheckpointRecord(**ev)
                elif kind == "delete_checkpoint":
                    self.checkpoints.pop(ev["uri"], None)
                elif kind == "checkpoint_update":
                    ck = self.checkpoints.get(ev.pop("uri"))
                    for k, v in ev.items():
                        if ck is not None and k in _CHECKPOINT_UPDATABLE:
                            setattr(ck, k, v)
                elif kind == "session":
                    sid = ev.pop("session_id")
                    self.sessions.setdefault(sid, {"heartbeat": None}).update(ev)
            except Exception as e:  # a torn last line after a crash must not stop the server
                logger.warning("%s:%d: skipping unreadable registry line: %s", self.log_path, lineno, e)

    def _append(self, event: str, payload: dict[str, Any]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"event": event, **payload}) + "\n")

    # -- sessions --------------------------------------------------------------------------------
    def add_session(self, session_id: str, meta: dict[str, Any]) -> None:
        """Record a new session; ``meta``: tags, sdk_version, user_metadata, project_id,
        display_name."""
        with self._lock:
            now = self.clock()
            s = self.sessions[session_id] = {"created": now, "heartbeat": now, "finished": None, **meta}
            self._append("session", {"session_id": session_id, **{k: s.get(k) for k in _SESSION_FIELDS}})

    def update_session(self, session_id: str, **fields: Any) -> None:
        """Change persisted fields of a known session (e.g. ``project_id``)."""
        with self._lock:
            self.sessions[session_id].update(fields)
            self._append("session", {"session_id": session_id, **fields})

    def heartbeat(self, session_id: str) -> str:
        """'ok', 'finished' or 'unknown'."""
        with self._lock:
            s = self.sessions.get(session_id)
            if s is None:
                return "unknown"
            if s.get("finished") is not None:
                return "finished"
            s["heartbeat"] = self.clock()
            return "ok"

    def finish_session(self, session_id: str, reason: Any) -> None:
        with self._lock:
            s = self.sessions.get(session_id)
            if s is None:
                self.add_session(session_id, {})
                s = self.sessions[session_id]
            if s.get("finished") is None:  # first reason wins
                s["finished"] = reason or "success"
                self._append("session", {"session_id": session_id, "finished": s["finished"]})

    # -- runs and checkpoints --------------------------------------------------------------------
    def add_run(self, run: RunRecord) -> None:
        with self._lock:
            self.runs[run.model_id] = run
            self._append("run", asdict(run))

    def touch(self, model_id: str) -> None:
        with self._lock:
            if model_id in self.runs:
                self.runs[model_id].last_request = self.clock()

    def add_checkpoint(self, ck: CheckpointRecord) -> None:
        with self._lock:
            self.checkpoints[ck.uri] = ck
            self._append("checkpoint", asdict(ck))

    def update_checkpoint(self, uri: str, **fields: Any) -> None:
        """Set ``public`` / ``expires_at`` of a known checkpoint (persisted)."""
        with self._lock:
            ck = self.checkpoints[uri]
            for k, v in fields.items():
                if k not in _CHECKPOINT_UPDATABLE:
                    raise ValueError(f"checkpoint field {k!r} cannot be updated")
                setattr(ck, k, v)
            self._append("checkpoint_update", {"uri": uri, **fields})

    def pop_expired(self) -> list[CheckpointRecord]:
        """Forget (persisted) every checkpoint whose ``expires_at`` has passed; returns them so
        that the caller deletes their files."""
        with self._lock:
            now = self.clock()
            gone = [c for c in self.checkpoints.values() if c.expires_at is not None and c.expires_at <= now]
            for c in gone:
                self.delete_checkpoint(c.uri)
            return gone

    def delete_checkpoint(self, uri: str) -> CheckpointRecord | None:
        with self._lock:
            ck = self.checkpoints.pop(uri, None)
            if ck is not None:
                self._append("delete_checkpoint", {"uri": uri})
            return ck

    def checkpoints_of(self, model_id: str | None = None) -> list[CheckpointRecord]:
        with self._lock:
            cks = [c for c in self.checkpoints.values() if model_id is None or c.model_id == model_id]
        return sorted(cks, key=lambda c: c.time)

    def run_to_rest(self, run: RunRecord) -> dict[str, Any]:
        cks = self.checkpoints_of(run.model_id)
        last_state = next((c for c in reversed(cks) if c.kind == "state"), None)  # "training"
        last_sampler = next((c for c in reversed(cks) if c.kind == "sampler"), None)
        return {
            "training_run_id": run.model_id,
            "base_model": run.base_model,
            "model_owner": "local",
            "is_lora": True,
            "corrupted": False,
            "lora_rank": run.lora_rank,
            "last_request_time": iso(run.last_request),
            "last_checkpoint": last_state.to_rest() if last_state else None,
            "last_sampler_checkpoint": last_sampler.to_rest() if last_sampler else None,
            "user_metadata": run.user_metadata,
        }

    # -- samplers --------------------------------------------------------------------------------
    def add_sampler(self, rec: SamplerRecord) -> None:
        with self._lock:
            self.samplers.setdefault(rec.sampler_id, rec)

    def join_sampler(self, sampler_id: str) -> int | None:
        with self._lock:
            rec = self.samplers.get(sampler_id)
            if rec is None:
                return None
            rec.clients += 1
            return rec.clients
