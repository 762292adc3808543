"""REST (synchronous) endpoints of the local Tinker server: capabilities, training runs,
checkpoints (listing, deletion, TTL, publish flag, copies, storage usage), weights info.  A part of
``tinker_local.service.LocalService`` (its ``rest``); every method returns the JSON answer or raises
``HttpError`` (404 for unknown ids / paths, 400 for a TTL out of range, 422 for a malformed
``tinker://`` path).  Response shapes follow ``tinker.types`` of SDK 0.38 (``TrainingRun``,
``Checkpoint``, ``CopyWeightsResponse``, ...).

Expiry: a checkpoint with a TTL (``ttl_seconds`` of a save, ``set_checkpoint_ttl``, or a copy)
is deleted, files included, once ``expires_at`` has passed: every lookup and listing sweeps
first (and the server sweeps once a minute), so an expired checkpoint is never listed, loaded
or sampled from (404 naming the expiry).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from .errors import HttpError
from .registry import CheckpointRecord, RunRecord, dir_size
from .service_base import ServiceState, remove_files
from .tenancy import current_user
from .tinker_paths import KIND_SEGMENT, TinkerPath, engine_id

logger = logging.getLogger("tinker_local.rest")

MIN_TTL_S = 3600  # the hosted service's bounds: 1 hour to 10 years
MAX_TTL_S = int(10 * 365.25 * 86400)


def check_ttl(ttl: Any, what: str) -> int | None:
    """``ttl_seconds`` as an int in [3600, 10 years], or None; HttpError 400 otherwise."""
    if ttl is None:
        return None
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or int(ttl) != ttl:
        raise HttpError(400, f"{what}: ttl_seconds must be an integer number of seconds, got {ttl!r}")
    if not MIN_TTL_S <= int(ttl) <= MAX_TTL_S:
        raise HttpError(
            400, f"{what}: ttl_seconds must be between {MIN_TTL_S} (1 hour) and {MAX_TTL_S} (10 years), got {ttl}"
        )
    return int(ttl)


class RestEndpoints:
    """The REST endpoints (see the module docstring), on the server's ``state``."""

    def __init__(self, state: ServiceState):
        self.state = state
        self.copies: dict[str, dict[str, Any]] = {}  # copy_weights idempotency key -> answer

    def capabilities(self) -> dict[str, Any]:
        """The base models preloaded at start plus those of the caller's runs, with their contexts."""
        names = list(
            dict.fromkeys(
                self.state.models
                + [r.base_model for r in self.state.registry.runs.values() if self.state.tenancy.owns_model(r.model_id)]
            )
        )
        out = []
        for m in names:
            entry: dict[str, Any] = {"model_name": m, "trainable": True, "sampleable": True}
            ctx = self._context_of(m)
            if ctx is not None:
                entry["max_context_length"] = ctx
            out.append(entry)
        return {"supported_models": out}

    def _context_of(self, base_model: str) -> int | None:
        try:
            from .models import resolve_model

            return int(resolve_model(base_model, self.state.root / "models").max_context)
        except Exception:  # capabilities never fail because of one model
            return None

    # -- runs ---------------------------------------------------------------------------------
    def run_to_rest(self, run: RunRecord) -> dict[str, Any]:
        """``TrainingRun`` of ``run``, its ``model_owner`` the user who created it."""
        return {**self.state.registry.run_to_rest(run), "model_owner": self.state.tenancy.model_owner(run.model_id)}

    def training_runs(self, limit: int, offset: int, project_id: str | None = None) -> dict[str, Any]:
        runs = sorted(
            (r for r in self.state.registry.runs.values() if self.state.tenancy.owns_model(r.model_id)),
            key=lambda r: r.created,
            reverse=True,
        )
        if project_id is not None:
            runs = [r for r in runs if self.state.project_of(r) == project_id]
        self.state.sweep_expired()
        page = runs[offset : offset + limit]
        return {
            "training_runs": [self.run_to_rest(r) for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
        }

    def training_run(self, model_id: str) -> dict[str, Any]:
        run = self.state.registry.runs.get(model_id)
        if run is None or not self.state.tenancy.owns_model(model_id):
            raise HttpError(404, f"unknown training run {model_id!r}")
        self.state.sweep_expired()
        return self.run_to_rest(run)

    # -- checkpoints ----------------------------------------------------------------------------
    def checkpoints(self, model_id: str | None, limit: int | None = None, offset: int = 0) -> dict[str, Any]:
        if model_id is not None and (
            model_id not in self.state.registry.runs or not self.state.tenancy.owns_model(model_id)
        ):
            raise HttpError(404, f"unknown training run {model_id!r}")
        self.state.sweep_expired()
        cks = [c for c in self.state.registry.checkpoints_of(model_id) if self.state.tenancy.owns_model(c.model_id)]
        if model_id is None:
            cks = cks[::-1]  # list_user_checkpoints: newest first
        page = cks[offset : offset + limit] if limit is not None else cks
        out: dict[str, Any] = {"checkpoints": [c.to_rest() for c in page]}
        if limit is not None:
            out["cursor"] = {"offset": offset, "limit": limit, "total_count": len(cks)}
        return out

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> dict[str, Any]:
        """Forget ``tinker://<model_id>/<checkpoint_id>`` and delete its files."""
        ck = self.state.registry.delete_checkpoint(self.state.checkpoint_record_of(model_id, checkpoint_id).uri)
        if ck is not None:
            remove_files(ck.path)
        return {}

    def set_checkpoint_ttl(self, model_id: str, checkpoint_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """``ttl_seconds`` from now (3600 s .. 10 years), or None to remove the expiry."""
        ck = self.state.checkpoint_record_of(model_id, checkpoint_id)
        ttl = check_ttl(body.get("ttl_seconds"), "set_checkpoint_ttl")
        self.state.registry.update_checkpoint(
            ck.uri, expires_at=None if ttl is None else self.state.registry.clock() + ttl
        )
        return {}

    def set_published(self, model_id: str, checkpoint_id: str, public: bool) -> dict[str, Any]:
        """Set the publish flag: a published checkpoint may be loaded and sampled by every user."""
        ck = self.state.checkpoint_record_of(model_id, checkpoint_id)
        if ck.public != public:
            self.state.registry.update_checkpoint(ck.uri, public=public)
        return {}

    def weights_info(self, body: dict[str, Any]) -> dict[str, Any]:
        path = body.get("tinker_path")
        if not path:
            raise HttpError(422, "weights_info: field 'tinker_path' is required")
        ck = self.state.checkpoint_record(str(path))
        run = self.state.registry.runs.get(ck.model_id)
        if run is None:
            raise HttpError(404, f"weights_info: training run {ck.model_id!r} is unknown")
        return {
            "base_model": run.base_model,
            "is_lora": True,
            "lora_rank": run.lora_rank,
            "train_unembed": run.train_unembed,
            "train_mlp": run.train_mlp,
            "train_attn": run.train_attn,
        }

    # -- copies ---------------------------------------------------------------------------------
    def copy_weights(self, body: dict[str, Any], idempotency_key: str | None) -> dict[str, Any]:
        """Copy a checkpoint into a new, untrainable training run (``CopyWeightsRequest``): in
        session ``session_id`` as run ``model_seq_id``, or in a new session of project
        ``destination_project_id``.  Files are hard links (no bytes duplicated; each copy has its
        own lifetime).  A repeated ``X-Idempotency-Key`` returns the first copy."""
        ep = "copy_weights"
        if idempotency_key and idempotency_key in self.copies:
            return self.copies[idempotency_key]
        src = self.state.checkpoint_record(str(body.get("source_path") or ""))
        src_run = self.state.registry.runs.get(src.model_id)
        if src_run is None:
            raise HttpError(404, f"{ep}: training run {src.model_id!r} of {src.uri} is unknown")
        ttl = check_ttl(body.get("ttl_seconds"), ep)
        session_id, project = body.get("session_id"), body.get("destination_project_id")
        if session_id is not None:
            if body.get("model_seq_id") is None:
                raise HttpError(400, f"{ep}: 'model_seq_id' is required with 'session_id'")
            if session_id not in self.state.registry.sessions or not self.state.tenancy.owns_session(session_id):
                raise HttpError(404, f"{ep}: unknown session {session_id!r}")
            project = self.state.registry.sessions[session_id].get("project_id")
            model_id = f"{session_id}:train:{int(body['model_seq_id'])}"
            if model_id in self.state.registry.runs:
                raise HttpError(400, f"{ep}: training run {model_id!r} already exists")
        elif project:
            session_id = f"copy-{uuid.uuid4().hex[:12]}"
            self.state.registry.add_session(
                session_id,
                {
                    "tags": ["copy_weights"],
                    "project_id": str(project),
                    "display_name": f"copy of {src.uri}",
                    "owner": current_user(),
                },
            )
            self.state.registry.finish_session(session_id, "success")
            model_id = f"{session_id}:train:0"
        else:
            raise HttpError(400, f"{ep}: give destination_project_id, or session_id and model_seq_id")
        run = RunRecord(
            model_id=model_id,
            base_model=src_run.base_model,
            lora_rank=src_run.lora_rank,
            seed=src_run.seed,
            train_mlp=src_run.train_mlp,
            train_attn=src_run.train_attn,
            train_unembed=src_run.train_unembed,
            session_id=session_id,
            user_metadata=src_run.user_metadata,
            project_id=project,
            trainable=False,
            copied_from=src.uri,
        )
        dest = self.state.root / "checkpoints" / engine_id(model_id) / KIND_SEGMENT[src.kind] / src.name
        _link_tree(Path(src.path), dest)
        ck = CheckpointRecord(
            uri=TinkerPath(model_id, src.kind, src.name).uri,
            model_id=model_id,
            kind=src.kind,
            name=src.name,
            path=str(dest),
            size_bytes=dir_size(dest),
            user_metadata=src.user_metadata,
            expires_at=None if ttl is None else self.state.registry.clock() + ttl,
        )
        self.state.registry.add_run(run)
        self.state.registry.add_checkpoint(ck)
        out = {"tinker_path": ck.uri}
        if idempotency_key:
            self.copies[idempotency_key] = out
        return out

    def storage_usage(self, project_id: str | None) -> dict[str, Any]:
        """Bytes and count of the caller's live checkpoints, by project
        (``CurrentCheckpointStorageUsageResponse``; no rate or cost: tinker_local bills nothing)."""
        self.state.sweep_expired()
        user = current_user()
        groups: dict[Any, list[CheckpointRecord]] = {}
        for ck in self.state.registry.checkpoints_of(None):
            if not self.state.tenancy.owns_model(ck.model_id):
                continue
            run = self.state.registry.runs.get(ck.model_id)
            proj = self.state.project_of(run) if run is not None else None
            if project_id is None or proj == project_id:
                groups.setdefault(proj, []).append(ck)
        data = []
        for proj, cks in groups.items():
            size = sum(c.size_bytes or 0 for c in cks)
            data.append(
                {
                    "project_id": proj,
                    "org_user_urn": f"tml:org_user:{user}",
                    "user_name": user,
                    "checkpoint_count": len(cks),
                    "size_bytes": size,
                    "size_gigabytes": size / 1e9,
                    "estimated_monthly_cost_usd": None,
                }
            )
        return {"effective_rate_usd_per_gigabyte_month": None, "data": data}


def _link_tree(src: Path, dest: Path) -> None:
    """Hard-link every file of ``src`` (a checkpoint folder) under ``dest`` (copied when the
    filesystem refuses links), through a temporary folder renamed into place."""
    if not src.is_dir():
        raise HttpError(404, f"copy_weights: the files of {src} are missing")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.copy-{uuid.uuid4().hex[:8]}"
    try:
        for dirpath, _dirs, files in os.walk(src):
            rel = Path(dirpath).relative_to(src)
            (tmp / rel).mkdir(parents=True, exist_ok=True)
            for f in files:
                try:
                    os.link(Path(dirpath) / f, tmp / rel / f)
                except OSError:
                    shutil.copy2(Path(dirpath) / f, tmp / rel / f)
        if dest.exists():
            remove_files(dest)
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
