"""Request handling of the local Tinker server, independent of the web framework.

``LocalService`` maps the JSON / protobuf requests of the tinker 0.38 SDK onto an ``Engine``
(see /work/INTERFACES.md). Mutating calls return ``{"request_id": ...}`` at once and queue
their work on the single compute thread of a ``FutureStore``; synchronous calls return their
answer directly. Input the caller got wrong raises ``HttpError`` (4xx) when it is found at
submission, or fails the request's future with category "user" when found while running.
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from . import protocol as P
from .errors import HttpError, int_field, required_field
from .outcomes import UserError
from .registry import CheckpointRecord, RunRecord, SamplerRecord, dir_size
from .request_limits import check_training
from .request_log import datum_record
from .rest import RestEndpoints, check_ttl
from .rest_sessions import SessionEndpoints
from .service_base import ServiceState
from .service_export import ExportEndpoints
from .service_losses import CustomLosses
from .service_sampling import SamplingEndpoints
from .tenancy import current_user
from .tinker_paths import KIND_SEGMENT, TinkerPath, check_checkpoint_name, engine_id

__all__ = ["LocalService", "HttpError"]

logger = logging.getLogger("tinker_local.service")


def _burns_seq(handler):
    """Decorator for the JSON handlers of a model's ordered requests: when the request is refused
    (``HttpError``, 4xx) its ``seq_id`` is consumed, so the model's next request need not wait
    for it (the SDK moves on after a failed request)."""

    @functools.wraps(handler)
    def wrapper(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            return handler(self, body)
        except HttpError as e:
            mid, seq = body.get("model_id"), body.get("seq_id")
            if isinstance(mid, str) and isinstance(seq, int) and mid in self.registry.runs:
                self.store.burn(mid, seq, e.detail)
            raise

    return wrapper


class LocalService(ServiceState):
    """The endpoint logic of the local Tinker server: its state (``ServiceState``, whose
    arguments it takes) with the training endpoints (sessions, models, forward/backward, optimizer
    steps, saves and loads), and the other endpoint groups as parts built on that state:

    - ``rest``: training runs and checkpoints (``tinker_local.rest.RestEndpoints``);
    - ``sessions``: session listing, search, projects and traces (``rest_sessions.SessionEndpoints``);
    - ``sampling``: sampling sessions and ``asample`` (``service_sampling.SamplingEndpoints``);
    - ``export``: external weights (``service_export.ExportEndpoints``);
    - ``losses``: uploaded custom losses (``service_losses.CustomLosses``)."""

    def __init__(self, engine: Any, root: Path, **options: Any):
        super().__init__(engine, root, **options)  # ServiceState's keyword options
        self._info: dict[str, dict[str, Any]] = {}  # model_id -> engine.get_info(), cached
        self.rest = RestEndpoints(self)
        self.sessions = SessionEndpoints(self)
        self.sampling = SamplingEndpoints(self)
        self.export = ExportEndpoints(self)
        self.losses = CustomLosses(self)

    @_burns_seq
    def save_weights_external(self, body: dict[str, Any]) -> dict[str, Any]:
        """``ExportEndpoints.save_weights_external``; a refused request consumes its ``seq_id``."""
        return self.export.save_weights_external(body)

    def json_routes(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        """The JSON routes (``POST /api/v1/<name>``) and the handler answering each."""
        return {
            "optim_step": self.optim_step,
            "save_weights": self.save_weights,
            "save_weights_for_sampler": self.save_weights_for_sampler,
            "load_weights": self.load_weights,
            "create_sampling_session": self.sampling.create_sampling_session,
            "join_sampling_session": self.sampling.join_sampling_session,
            "asample": self.sampling.asample,
            "weights_info": self.rest.weights_info,
            "save_weights_external": self.save_weights_external,
            "create_custom_loss": self.losses.create_custom_loss,
        }

    # -- sessions ---------------------------------------------------------------------------------
    def create_session(self, body: dict[str, Any]) -> dict[str, Any]:
        sid = f"local-{uuid.uuid4().hex[:12]}"
        self.registry.add_session(
            sid,
            {
                "tags": body.get("tags") or [],
                "sdk_version": body.get("sdk_version"),
                "user_metadata": P.as_str_dict(body.get("user_metadata")),
                "project_id": body.get("project_id"),
                "display_name": body.get("display_name"),
                "owner": current_user(),
            },
        )
        self.tracer.instant(sid, "create_session", sdk_version=body.get("sdk_version"))
        logger.info("session %s created (sdk %s)", sid, body.get("sdk_version"))
        return {"type": "create_session", "session_id": sid}

    def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        state = self.registry.heartbeat(str(required_field(body, "session_id", "session_heartbeat")))
        if state == "finished":
            raise HttpError(410, "session has finished")
        return {"type": "session_heartbeat"}

    def finish_session(self, session_id: str, body: dict[str, Any]) -> dict[str, Any]:
        """Mark the session finished; its training models then leave the engine's memory (a job
        queued after their pending work, so what the client sent before finishing still runs);
        their checkpoints stay."""
        reason = (body.get("reason") or {}).get("type") if isinstance(body.get("reason"), dict) else None
        self.registry.finish_session(session_id, reason)
        self.tracer.instant(session_id, "finish_session", reason=reason)
        logger.info("session %s finished (%s) %s", session_id, reason, body.get("detail") or "")
        models = [r.model_id for r in self.registry.runs.values() if r.session_id == session_id]
        if models:

            def release() -> dict[str, Any]:
                held = set(self.engine.list_models())
                for model_id in models:
                    if engine_id(model_id) in held:
                        self.engine.delete_model(engine_id(model_id))
                return {"released": len(models)}

            self.store.submit("release_models", release)
        return {}

    # -- training models --------------------------------------------------------------------------
    def _check_optimizer(self, cfg: Any, endpoint: str) -> None:
        if isinstance(cfg, dict) and cfg.get("type", "adamw") == "dimuon":
            raise HttpError(
                422,
                f"{endpoint}: optimizer 'dimuon' (DimuonOptimizerConfig / DimuonParams) is not "
                "implemented by tinker_local: its update (a damped row/column preconditioner and a "
                "matrix-sign iteration with internal constants) is not published in enough detail "
                "to reproduce; use AdamOptimizerConfig / AdamParams",
            )
        if isinstance(cfg, dict) and cfg.get("type", "adamw") != "adamw":
            raise HttpError(
                422, f"{endpoint}: optimizer {cfg.get('type')!r} is not supported by tinker_local (only 'adamw')"
            )

    def create_model(self, body: dict[str, Any]) -> dict[str, Any]:
        ep = "create_model"
        session_id = str(required_field(body, "session_id", ep))
        seq = int_field(body, "model_seq_id", ep)
        if seq is None:
            raise HttpError(422, f"{ep}: field 'model_seq_id' is required")
        base_model = str(required_field(body, "base_model", ep))
        self.model_allow.check(base_model, ep)
        self._check_optimizer(body.get("optimizer_config"), ep)
        lora = body.get("lora_config") or {}
        rank = int_field(lora, "rank", ep, 32)
        if rank < 1:
            raise HttpError(422, f"{ep}: lora_config.rank must be >= 1, got {rank}")
        model_id = f"{session_id}:train:{seq}"
        run = RunRecord(
            model_id=model_id,
            base_model=base_model,
            lora_rank=rank,
            seed=lora.get("seed") if lora.get("seed") is not None else self.default_lora_seed,
            train_mlp=bool(lora.get("train_mlp", True)),
            train_attn=bool(lora.get("train_attn", True)),
            train_unembed=bool(lora.get("train_unembed", True)),
            session_id=session_id,
            user_metadata=P.as_str_dict(body.get("user_metadata")),
        )

        def work() -> dict[str, Any]:
            self.engine.create_model(
                engine_id(model_id),
                base_model,
                rank,
                seed=run.seed,
                train_mlp=run.train_mlp,
                train_attn=run.train_attn,
                train_unembed=run.train_unembed,
            )
            self._info[model_id] = self.engine.get_info(engine_id(model_id))
            self.registry.add_run(run)
            self.log_request(
                session_id,
                {"op": ep, "model": model_id, "base_model": base_model, "lora_rank": rank, "seed": run.seed},
            )
            return {"type": "create_model", "model_id": model_id}

        self.store.register_model(model_id, next_seq=1)
        rid = self.submit_traced(
            "create_model", work, model_id, None, dedupe_key=(model_id, 0), base_model=base_model, lora_rank=rank
        )
        return {"request_id": rid, "model_id": model_id}

    def get_info(self, body: dict[str, Any]) -> dict[str, Any]:
        model_id = str(required_field(body, "model_id", "get_info"))
        run = self.registry.runs.get(model_id)
        info = self._info.get(model_id)
        if info is None:
            try:
                info = self.engine.get_info(engine_id(model_id))
            except Exception as e:
                raise HttpError(404, f"get_info: unknown model_id {model_id!r}: {e}") from e
        base = info.get("base_model") or (run.base_model if run else None)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": info.get("arch"),
                "model_name": self.client_model_name(base) if base else base,
                "tokenizer_id": info.get("tokenizer_id"),
            },
            "is_lora": True,
            "lora_rank": info.get("lora_rank", run.lora_rank if run else None),
            "model_name": base,
        }

    def forward_backward(self, raw: bytes, content_encoding: str | None, forward_only: bool) -> dict[str, Any]:
        try:
            msg = P.parse_forward_backward(raw, content_encoding, self.request_limits.body_bytes)
        except P.ProtocolError as e:
            raise HttpError(422, str(e)) from e
        except P.BodyTooLarge as e:
            raise HttpError(413, f"request limit: {e} (serve --max-body-bytes)") from e
        model_id, seq = msg.model_id, int(msg.seq_id)
        forward_only = forward_only or msg.forward_only
        kind = "forward" if forward_only else "forward_backward"
        if model_id not in self.registry.runs or not self.tenancy.owns_model(model_id):
            return {"request_id": self.store.fail_now(kind, f"unknown model_id {model_id!r}"), "model_id": model_id}
        try:
            check_training(self.request_limits, kind, len(msg.data), P.count_tokens(msg))
            self.sampling.stability.check_provenance(
                msg, model_id, self.session_of_model(model_id)
            )  # service_stability: 400s
            self.tenancy.check_queue()
            self.tenancy.check_compute()
        except HttpError as e:
            if e.status != 429:  # a 429 is retried with the same seq_id
                self.store.burn(model_id, seq, e.detail)
            raise

        def work() -> bytes:
            self.run_record(model_id)
            datums = P.datums_from_proto(msg, self.datum_cls)
            if not datums:
                raise UserError(f"{kind}: no datums in the request")
            cfg = P.loss_fn_config_from_proto(msg)
            fn = self.engine.forward if forward_only else self.engine.forward_backward
            if msg.loss_fn == "custom":  # an uploaded loss (ServiceClient.create_custom_loss)
                bound = self.losses.bound_custom_loss(model_id, cfg, len(datums))
                res = fn(engine_id(model_id), datums, bound, None)
                res.metrics.update(bound.metrics())
            else:
                res = fn(engine_id(model_id), datums, msg.loss_fn, cfg)
            if self.request_log is not None:
                self.log_request(
                    self.session_of_model(model_id),
                    {
                        "op": kind,
                        "model": model_id,
                        "seq_id": seq,
                        "loss_fn": msg.loss_fn,
                        "loss_fn_config": cfg,
                        "datums": [datum_record(d) for d in datums],
                        "metrics": {k: float(v) for k, v in res.metrics.items()},
                        "logprobs": [np.asarray(o.get("logprobs")).reshape(-1).tolist() for o in res.outputs],
                    },
                )
            return P.forward_backward_output_to_proto(res.outputs, res.metrics)

        return {
            "request_id": self.submit_ordered(kind, work, model_id, seq, loss_fn=msg.loss_fn, datums=len(msg.data)),
            "model_id": model_id,
        }

    @_burns_seq
    def optim_step(self, body: dict[str, Any]) -> dict[str, Any]:
        ep = "optim_step"
        model_id = str(required_field(body, "model_id", ep))
        params = body.get("adam_params") or body.get("optim_params") or body.get("optimizer_params")
        if not isinstance(params, dict):
            raise HttpError(422, f"{ep}: 'adam_params' is required")
        self._check_optimizer(params, ep)
        try:
            kw = {
                k: float(params[k])
                for k in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
                if params.get(k) is not None
            }
        except (TypeError, ValueError) as e:
            raise HttpError(422, f"{ep}: adam_params must be numbers ({e})") from e

        seq = int_field(body, "seq_id", ep)

        def work() -> dict[str, Any]:
            self.run_record(model_id)
            metrics = self.engine.optim_step(engine_id(model_id), **kw) or {}
            out = {k: float(v) for k, v in metrics.items()}
            self.log_request(
                self.session_of_model(model_id),
                {"op": ep, "model": model_id, "seq_id": seq, "adam_params": kw, "metrics": out},
            )
            return {"metrics": out}

        return {
            "request_id": self.submit_ordered(ep, work, model_id, seq),
            "model_id": model_id,
        }

    def _save(self, model_id: str, kind: str, name: str, meta: Any, ttl: int | None = None) -> CheckpointRecord:
        run = self.run_record(model_id)
        if kind == "state":
            path = Path(self.engine.save_state(engine_id(model_id), name))
        else:
            path = Path(self.engine.save_sampler_weights(engine_id(model_id), name))
        uri = TinkerPath(run.model_id, kind, name).uri
        if uri in self.registry.checkpoints:
            logger.info("overwriting checkpoint %s", uri)
        ck = CheckpointRecord(
            uri=uri,
            model_id=model_id,
            kind=kind,
            name=name,
            path=str(path),
            size_bytes=dir_size(path),
            user_metadata=P.as_str_dict(meta),
            expires_at=None if ttl is None else self.registry.clock() + ttl,
        )
        self.registry.add_checkpoint(ck)
        self.log_request(
            self.session_of_model(model_id),
            {
                "op": "save_weights" if kind == "state" else "save_weights_for_sampler",
                "model": model_id,
                "name": name,
                "path": str(path),
            },
        )
        return ck

    @_burns_seq
    def save_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        ep = "save_weights"
        model_id = str(required_field(body, "model_id", ep))
        seq = int_field(body, "seq_id", ep)
        name = body.get("path") or f"state-{seq if seq is not None else int(time.time())}"
        try:
            check_checkpoint_name(name)
        except P.ProtocolError as e:
            raise HttpError(422, f"{ep}: {e}") from e
        ttl = check_ttl(body.get("ttl_seconds"), ep)

        def work() -> dict[str, Any]:
            ck = self._save(model_id, "state", name, body.get("user_metadata"), ttl)
            return {"type": "save_weights", "path": ck.uri}

        return {"request_id": self.submit_ordered(ep, work, model_id, seq), "model_id": model_id}

    @_burns_seq
    def save_weights_for_sampler(self, body: dict[str, Any]) -> dict[str, Any]:
        ep = "save_weights_for_sampler"
        model_id = str(required_field(body, "model_id", ep))
        seq = int_field(body, "seq_id", ep)
        ss_seq = int_field(body, "sampling_session_seq_id", ep)
        name = body.get("path") or (
            f"ephemeral-{ss_seq}" if ss_seq is not None else f"sampler-{seq if seq is not None else int(time.time())}"
        )
        try:
            check_checkpoint_name(name)
        except P.ProtocolError as e:
            raise HttpError(422, f"{ep}: {e}") from e
        ttl = check_ttl(body.get("ttl_seconds"), ep)
        kind = body.get("kind") or "snapshot"
        if kind not in ("snapshot", "inflight"):
            raise HttpError(422, f"{ep}: kind must be 'snapshot' or 'inflight', got {kind!r}")

        def work() -> dict[str, Any]:
            ck = self._save(model_id, "sampler", name, body.get("user_metadata"), ttl)
            out: dict[str, Any] = {"type": "save_weights_for_sampler", "path": ck.uri}
            sid = None
            if ss_seq is not None:
                run = self.registry.runs[model_id]
                sid = f"{run.session_id or model_id}:sample:{ss_seq}"
                self.registry.add_sampler(SamplerRecord(sid, run.base_model, ck.uri, ck.path))
                out["sampling_session_id"] = sid
            if kind == "inflight":  # service_sampling: every inflight client of the model moves here
                self.sampling.inflight.publish(model_id, ck.path, sid)
            return out

        return {"request_id": self.submit_ordered(ep, work, model_id, seq), "model_id": model_id}

    @_burns_seq
    def load_weights(self, body: dict[str, Any]) -> dict[str, Any]:
        ep = "load_weights"
        uri = str(required_field(body, "path", ep))
        with_opt = bool(body.get("optimizer", False))
        ck = self.checkpoint_record(uri)
        if ck.kind != "state":
            raise HttpError(
                422,
                f"{ep}: {uri} is a {KIND_SEGMENT[ck.kind]} checkpoint; load a "
                "tinker://<model_id>/weights/<name> state checkpoint",
            )
        src = self.registry.runs.get(ck.model_id)
        if src is None:
            raise HttpError(404, f"{ep}: the training run {ck.model_id!r} of {uri} is unknown")
        if body.get("session_id") is not None:  # create-via-load: the model's first request
            if with_opt is False:
                self._check_optimizer(body.get("optimizer_config"), ep)
            seq = int_field(body, "model_seq_id", ep)
            if seq is None:
                raise HttpError(422, f"{ep}: 'model_seq_id' is required with 'session_id'")
            session_id = str(body["session_id"])
            model_id = f"{session_id}:train:{seq}"
            self.model_allow.check(body.get("base_model") or src.base_model, ep)
            run = RunRecord(
                model_id=model_id,
                base_model=body.get("base_model") or src.base_model,
                lora_rank=src.lora_rank,
                seed=src.seed,
                train_mlp=src.train_mlp,
                train_attn=src.train_attn,
                train_unembed=src.train_unembed,
                session_id=session_id,
                user_metadata=P.as_str_dict(body.get("user_metadata")),
            )

            def create_and_load() -> dict[str, Any]:
                self.engine.create_model(
                    engine_id(model_id),
                    run.base_model,
                    run.lora_rank,
                    seed=run.seed,
                    train_mlp=run.train_mlp,
                    train_attn=run.train_attn,
                    train_unembed=run.train_unembed,
                )
                self.engine.load_state(engine_id(model_id), Path(ck.path), with_optimizer=with_opt)
                self._info[model_id] = self.engine.get_info(engine_id(model_id))
                self.registry.add_run(run)
                return {"type": "load_weights", "path": uri, "model_id": model_id}

            self.store.register_model(model_id, next_seq=1)
            rid = self.submit_traced(ep, create_and_load, model_id, None, dedupe_key=(model_id, 0), path=uri)
            return {"request_id": rid, "model_id": model_id}

        model_id = str(required_field(body, "model_id", ep))

        def load() -> dict[str, Any]:
            self.run_record(model_id)
            self.engine.load_state(engine_id(model_id), Path(ck.path), with_optimizer=with_opt)
            return {"type": "load_weights", "path": uri, "model_id": model_id}

        return {
            "request_id": self.submit_ordered(ep, load, model_id, int_field(body, "seq_id", ep)),
            "model_id": model_id,
        }
