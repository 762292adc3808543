"""The state and shared lookups of the local Tinker server's request handling.

``ServiceState`` holds what every endpoint group works on (engine, future store, registry, clock,
tracer, URL signer, tenancy, limits and the server's flags), all set in its ``__init__``; its
methods are what several groups use: the lookups of training runs and checkpoints (checkpoints
whose TTL has passed are deleted first, see ``tinker_local.rest``), the names handed to SDK
clients, and the submission of a model's ordered work to the future store with its trace span
(``tinker_local.trace``).  ``tinker_local.service.LocalService`` is this state plus the training
endpoints, and holds the other groups as parts built on it (``RestEndpoints``,
``SessionEndpoints``, ``SamplingEndpoints``, ``ExportEndpoints``, ``CustomLosses``), each keeping
its own state in its own ``__init__``.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import protocol as P
from .allowed_models import ModelAllowList
from .auth import JwtIssuer
from .errors import HttpError
from .futures import FutureStore
from .loss_limits import GraphLimits
from .outcomes import UserError
from .registry import CheckpointRecord, Registry, RunRecord, iso
from .request_limits import RequestLimits
from .request_log import ContentSeeds, RequestLog
from .signing import DEFAULT_URL_TTL_S, UrlSigner, load_secret
from .tenancy import Tenancy
from .tinker_paths import parse_tinker_path
from .trace import Tracer, session_of

logger = logging.getLogger("tinker_local.rest")


def remove_files(path: str | Path) -> None:
    """Delete a checkpoint's folder (or file) at ``path``; a missing one is no error."""
    p = Path(path)
    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _engine_datum_cls() -> type:
    try:
        from .engine import Datum

        return Datum
    except Exception:  # engine not importable: a field-compatible stand-in
        return P.WireDatum


class ServiceState:
    """What every endpoint group of ``LocalService`` works on; see the module docstring.

    ``engine`` follows the ``tinker_local.engine.Engine`` interface; ``root`` holds the registry;
    ``models``: base models preloaded at start; ``gap_timeout_s``: how long a model's request
    waits for a missing earlier ``seq_id``; ``datum_cls``: the datum class requests are parsed
    into; ``url_ttl_s``: how long signed download URLs stay valid; ``clock``: the time source
    (Unix seconds) of checkpoint expiry, signed URLs and traces (tests move it)."""

    def __init__(
        self,
        engine: Any,
        root: Path,
        *,
        models: list[str] | None = None,
        gap_timeout_s: float = 30.0,
        datum_cls: type | None = None,
        url_ttl_s: float = DEFAULT_URL_TTL_S,
        clock: Callable[[], float] = time.time,
    ):
        self.engine = engine
        self.root = Path(root)
        self.models = list(models or [])
        self.store = FutureStore(gap_timeout_s=gap_timeout_s)
        self.clock = clock
        self.registry = Registry(self.root, clock=lambda: self.clock())
        self.tracer = Tracer(clock=lambda: self.clock())
        self.signer = UrlSigner(load_secret(self.root), clock=lambda: self.clock())
        self.url_ttl_s = float(url_ttl_s)
        self.datum_cls: type = datum_cls or _engine_datum_cls()
        self.request_counts: dict[str, int] = {}  # HTTP route -> requests seen (GET local_stats)
        self.jwt: JwtIssuer | None = None  # set when JWT auth is on (create_app(jwt_auth=True))
        self.tenancy = Tenancy(self.registry, self.store, self.root)  # owners, limits, audit log
        self.request_limits = RequestLimits()  # sizes of one request (tinker_local.request_limits)
        self.graph_limits = GraphLimits()  # bounds of uploaded custom losses (tinker_local.loss_limits)
        # base models that may be loaded (enforced by create_app on a server with keys)
        self.model_allow = ModelAllowList(self.root, self.models, enforced=lambda: False)
        # client config flag (serve --client-side-custom-losses: off)
        self.custom_loss_server_side = True
        # serve --record-requests / --sampling-seed content / --lora-seed (set by create_app)
        self.request_log: RequestLog | None = None  # None: nothing recorded
        self.content_seeds: ContentSeeds | None = None  # None: the request's seed (random when unset)
        self.default_lora_seed: int | None = None  # LoRA init seed of a create_model that gives none
        self._client_names: dict[str, str] = {}  # base model -> name handed to SDK clients
        self._expired: dict[str, float] = {}  # tinker path -> when it expired (clearer 404s)

    def log_request(self, session_id: str | None, entry: dict[str, Any]) -> None:
        """Append ``entry`` to the session's request log (``serve --record-requests``)."""
        if self.request_log is not None:
            self.request_log.write(session_id, entry)

    # -- runs and sessions --------------------------------------------------------------------------
    def run_record(self, model_id: str) -> RunRecord:
        """The run of ``model_id`` (marked as used); UserError when unknown (inside a job)."""
        run = self.registry.runs.get(model_id)
        if run is None:
            raise UserError(f"unknown model_id {model_id!r}: create a training client first")
        self.registry.touch(model_id)
        return run

    def session_of_model(self, model_id: str) -> str | None:
        run = self.registry.runs.get(model_id)
        return (run.session_id if run is not None else None) or session_of(model_id)

    def project_of(self, run: RunRecord) -> str | None:
        """A run's project: its own (copies) or its session's."""
        if run.project_id is not None:
            return run.project_id
        return (self.registry.sessions.get(run.session_id or "") or {}).get("project_id")

    def client_model_name(self, base_model: str) -> str:
        """The base-model name handed to SDK clients (``get_info``'s ``model_data.model_name``,
        ``GET samplers/{id}``): ``SamplingClient.get_tokenizer()`` loads
        ``AutoTokenizer.from_pretrained`` of it, so presets ("tiny", "smollm2") are named by
        their local tokenizer directory (which the engine accepts as the same base model)."""
        name = self._client_names.get(base_model)
        if name is None:
            try:
                from .models import loadable_name

                name = loadable_name(base_model, self.root / "models")
            except Exception:  # unknown model: the name as given
                name = base_model
            self._client_names[base_model] = name
        return name

    # -- checkpoints --------------------------------------------------------------------------------
    def sweep_expired(self) -> int:
        """Delete the checkpoints whose TTL has passed (records and files); returns how many."""
        gone = self.registry.pop_expired()
        for ck in gone:
            remove_files(ck.path)
            if ck.expires_at is not None:  # always: only checkpoints with an expiry expire
                self._expired[ck.uri] = ck.expires_at
                logger.info("checkpoint %s expired at %s: deleted", ck.uri, iso(ck.expires_at))
        return len(gone)

    def checkpoint_record(self, uri: str, status: int = 404) -> CheckpointRecord:
        """The checkpoint ``uri`` names, when the caller may read it; HttpError 422 for a malformed
        path, ``status`` for an unknown, expired or another user's unpublished checkpoint."""
        try:
            parse_tinker_path(uri)
        except P.ProtocolError as e:
            raise HttpError(422, str(e)) from e
        self.sweep_expired()
        ck = self.registry.checkpoints.get(uri)
        if ck is not None and not self.tenancy.may_read(ck):  # another user's: as if unknown
            ck = None
        if ck is None:
            if uri in self._expired:
                raise HttpError(
                    status, f"checkpoint {uri!r} expired at {iso(self._expired[uri])} (its TTL passed) and was deleted"
                )
            raise HttpError(
                status, f"unknown checkpoint {uri!r}: not saved on this server (root {self.root}), or deleted"
            )
        return ck

    def checkpoint_record_of(self, model_id: str, checkpoint_id: str) -> CheckpointRecord:
        """``checkpoint_record`` of ``tinker://<model_id>/<checkpoint_id>``."""
        return self.checkpoint_record(f"tinker://{model_id}/{checkpoint_id}")

    # -- submission ---------------------------------------------------------------------------------
    def submit_ordered(self, kind: str, work: Any, model_id: str, seq: int | None, **trace_args: Any) -> str:
        """Submit ``work`` of ``model_id`` in its seq_id lane (``seq``; None: in arrival order),
        traced; returns the request id."""
        if seq is None:
            return self.submit_traced(kind, work, model_id, None, **trace_args)
        return self.submit_traced(kind, work, model_id, seq, model_id=model_id, seq_id=seq, **trace_args)

    def submit_traced(
        self,
        kind: str,
        work: Any,
        track: str,
        seq: int | None,
        *,
        model_id: str | None = None,
        seq_id: int | None = None,
        dedupe_key: tuple[str, int] | None = None,
        **args: Any,
    ) -> str:
        """Submit ``work`` to the store, recorded in its session's trace (``tinker_local.trace``)
        on track ``track`` (the model id); a repeated submission is recorded once."""
        key = dedupe_key or ((model_id, seq_id) if model_id is not None and seq_id is not None else None)
        span = None
        if key is None or self.store.lookup_seq(*key) is None:
            work, span = self.tracer.wrap(
                self.session_of_model(track), kind, track, work, **({"seq_id": seq} if seq is not None else {}), **args
            )
        rid = self.store.submit(kind, work, model_id=model_id, seq_id=seq_id, dedupe_key=dedupe_key)
        self.tracer.bind(span, rid)
        return rid
