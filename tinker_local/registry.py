"""Bookkeeping of the local Tinker server: sessions, training runs, checkpoints, samplers.

Training runs and checkpoints are persisted as an append-only JSON-lines log at
``<root>/server/registry.jsonl`` so that ``tinker://`` paths stay resolvable after a server
restart (resume from a checkpoint with ``create_training_client_from_state_with_optimizer``).
Sessions and sampling sessions live in memory only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

logger = logging.getLogger("tinker_local.registry")


def iso(ts: float) -> str:
    """Unix seconds -> ISO 8601 UTC string (what the REST types parse as datetime)."""
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


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


@dataclass
class CheckpointRecord:
    """A saved checkpoint: ``kind`` is "state" (weights + optimizer) or "sampler"."""

    uri: str
    model_id: str
    kind: str
    name: str
    path: str
    time: float = field(default_factory=time.time)
    size_bytes: int | None = None
    user_metadata: dict[str, str] | None = None

    def to_rest(self) -> dict[str, Any]:
        segment = "weights" if self.kind == "state" else "sampler_weights"
        return {
            "checkpoint_id": f"{segment}/{self.name}",
            "checkpoint_type": "training" if self.kind == "state" else "sampler",
            "time": iso(self.time),
            "tinker_path": self.uri,
            "size_bytes": self.size_bytes,
            "public": False,
            "user_metadata": self.user_metadata,
            "expires_at": None,
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


class Registry:
    """Thread-safe registry; ``root`` is the server root folder (log under root/server/)."""

    def __init__(self, root: Path):
        self.root = Path(root)
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
            except Exception as e:  # a torn last line after a crash must not stop the server
                logger.warning("%s:%d: skipping unreadable registry line: %s", self.log_path, lineno, e)

    def _append(self, event: str, payload: dict[str, Any]) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as f:
            f.write(json.dumps({"event": event, **payload}) + "\n")

    # -- sessions --------------------------------------------------------------------------------
    def add_session(self, session_id: str, meta: dict[str, Any]) -> None:
        with self._lock:
            self.sessions[session_id] = {"created": time.time(), "heartbeat": time.time(),
                                         "finished": None, **meta}

    def heartbeat(self, session_id: str) -> str:
        """'ok', 'finished' or 'unknown'."""
        with self._lock:
            s = self.sessions.get(session_id)
            if s is None:
                return "unknown"
            if s["finished"] is not None:
                return "finished"
            s["heartbeat"] = time.time()
            return "ok"

    def finish_session(self, session_id: str, reason: Any) -> None:
        with self._lock:
            s = self.sessions.setdefault(session_id, {"created": time.time(), "finished": None})
            if s.get("finished") is None:  # first reason wins
                s["finished"] = reason or "success"

    # -- runs and checkpoints --------------------------------------------------------------------
    def add_run(self, run: RunRecord) -> None:
        with self._lock:
            self.runs[run.model_id] = run
            self._append("run", asdict(run))

    def touch(self, model_id: str) -> None:
        with self._lock:
            if model_id in self.runs:
                self.runs[model_id].last_request = time.time()

    def add_checkpoint(self, ck: CheckpointRecord) -> None:
        with self._lock:
            self.checkpoints[ck.uri] = ck
            self._append("checkpoint", asdict(ck))

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
        last_state = next((c for c in reversed(cks) if c.kind == "state"), None)
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
