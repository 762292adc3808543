"""REST (synchronous) endpoints of the local Tinker server: capabilities, training runs,
checkpoints, sessions, weights info.  A mixin of ``tinker_local.service.LocalService``; every
method returns the JSON answer or raises ``HttpError`` (404 for unknown ids / paths, 422 for a
malformed ``tinker://`` path).  Response shapes follow ``tinker.types`` of SDK 0.38
(``TrainingRun``, ``Checkpoint``, ``GetSessionResponse``, ...)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from . import protocol as P
from .errors import HttpError
from .registry import CheckpointRecord


class RestMixin:
    """Needs ``self.registry``, ``self.models``, ``self.root`` and ``self.engine``."""

    def capabilities(self) -> dict[str, Any]:
        """The base models preloaded at start plus those of known runs, with their contexts."""
        names = list(dict.fromkeys(self.models + [r.base_model for r in self.registry.runs.values()]))
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

            return int(resolve_model(base_model, self.root / "models").max_context)
        except Exception:  # capabilities never fail because of one model
            return None

    def training_runs(self, limit: int, offset: int) -> dict[str, Any]:
        runs = sorted(self.registry.runs.values(), key=lambda r: r.created, reverse=True)
        page = runs[offset: offset + limit]
        return {"training_runs": [self.registry.run_to_rest(r) for r in page],
                "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}}

    def training_run(self, model_id: str) -> dict[str, Any]:
        run = self.registry.runs.get(model_id)
        if run is None:
            raise HttpError(404, f"unknown training run {model_id!r}")
        return self.registry.run_to_rest(run)

    def checkpoints(self, model_id: str | None, limit: int | None = None, offset: int = 0) -> dict[str, Any]:
        if model_id is not None and model_id not in self.registry.runs:
            raise HttpError(404, f"unknown training run {model_id!r}")
        cks = self.registry.checkpoints_of(model_id)
        page = cks[offset: offset + limit] if limit is not None else cks
        out: dict[str, Any] = {"checkpoints": [c.to_rest() for c in page]}
        if limit is not None:
            out["cursor"] = {"offset": offset, "limit": limit, "total_count": len(cks)}
        return out

    def _checkpoint(self, uri: str, status: int = 404) -> CheckpointRecord:
        try:
            P.parse_tinker_path(uri)
        except P.ProtocolError as e:
            raise HttpError(422, str(e)) from e
        ck = self.registry.checkpoints.get(uri)
        if ck is None:
            raise HttpError(status, f"unknown checkpoint {uri!r}: not saved on this server "
                                    f"(root {self.root}), or deleted")
        return ck

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> dict[str, Any]:
        """Forget ``tinker://<model_id>/<checkpoint_id>`` and delete its files."""
        ck = self.registry.delete_checkpoint(self._checkpoint(f"tinker://{model_id}/{checkpoint_id}").uri)
        if ck is not None:
            p = Path(ck.path)
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return {}

    def weights_info(self, body: dict[str, Any]) -> dict[str, Any]:
        path = body.get("tinker_path")
        if not path:
            raise HttpError(422, "weights_info: field 'tinker_path' is required")
        ck = self._checkpoint(str(path))
        run = self.registry.runs.get(ck.model_id)
        if run is None:
            raise HttpError(404, f"weights_info: training run {ck.model_id!r} is unknown")
        return {"base_model": run.base_model, "is_lora": True, "lora_rank": run.lora_rank,
                "train_unembed": run.train_unembed, "train_mlp": run.train_mlp,
                "train_attn": run.train_attn}

    def list_sessions(self, limit: int, offset: int) -> dict[str, Any]:
        """Session ids of this server's lifetime, newest first."""
        ids = sorted(self.registry.sessions, key=lambda s: self.registry.sessions[s].get("created", 0),
                     reverse=True)
        return {"sessions": ids[offset: offset + limit]}

    def get_session(self, session_id: str) -> dict[str, Any]:
        """The training runs and samplers a session created."""
        if session_id not in self.registry.sessions:
            raise HttpError(404, f"unknown session {session_id!r}")
        runs = [r.model_id for r in self.registry.runs.values() if r.session_id == session_id]
        samplers = [s for s in self.registry.samplers if s.startswith(f"{session_id}:")]
        return {"training_run_ids": runs, "sampler_ids": samplers}
