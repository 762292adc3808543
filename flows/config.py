"""Config pieces shared by every recipe: :class:`RecipeConfig` (the fields every recipe's config
has), which Tinker backend to use, the optimizer, and the default store root."""

from __future__ import annotations

import os
from datetime import UTC
from typing import Any, ClassVar

from pydantic import BaseModel, Field, model_validator

from prefect_tinker.recipes.evals.specs import EvalSpec
from prefect_tinker.recipes.pricing import TokenPrices
from prefect_tinker.recipes.schedule import LRScheduleFields

# The flows' default store root is the one `prefect-tinker sql/runs/checkpoints` read
# ($PREFECT_TINKER_STORE, else $PREFECT_TINKER_HOME/store, else ~/.prefect-tinker/store).
from tinker_blocks.store_io import default_store_root

__all__ = [
    "BackendConfig",
    "AdamConfig",
    "RecipeConfig",
    "resolve_credentials",
    "default_run_name",
    "default_store_root",
]


class BackendConfig(BaseModel):
    """Where training and sampling run.

    Precedence: a saved ``TinkerCredentials`` block (``credentials_block``), else ``base_url``
    (a self-hosted Tinker-compatible server, or the hosted service when it is the service URL; the
    API key comes from ``TINKER_API_KEY``), else the embedded local server (the default).
    """

    credentials_block: str | None = Field(default=None, description="Name of a saved TinkerCredentials block to load.")
    base_url: str | None = Field(default=None, description="URL of a Tinker-compatible server.")
    local_root: str | None = Field(
        default=None,
        description="Folder of the embedded local server (models, checkpoints); default ~/.prefect-tinker.",
    )
    local_sampler_workers: int = Field(
        default=0,
        ge=0,
        description=(
            "Embedded local server: sampling worker processes beside the trainer (tinker_local --sampler-workers), so "
            "streaming/async RL overlap rollouts with training."
        ),
    )
    request_deadline_s: float = Field(
        default=1800.0,
        gt=0,
        description=(
            "Longest wait for one request's result (seconds); a dead server is noticed sooner (its process and port "
            "are checked while waiting)."
        ),
    )

    def is_local(self) -> bool:
        """Whether this is the embedded local server (no block, no URL)."""
        return not self.credentials_block and not self.base_url

    def inspect_args(self) -> dict[str, Any]:
        """Provider args of the inspect ``tinker`` model for this backend (no secrets: a remote
        server's key comes from ``TINKER_API_KEY`` or the credentials block)."""
        if self.credentials_block:
            return {"credentials_block": self.credentials_block}
        if self.base_url:
            return {"base_url": self.base_url}
        return {"local_root": self.local_root} if self.local_root else {}


class AdamConfig(BaseModel):
    """``tinker.AdamParams`` besides the learning rate (Tinker's defaults, not torch's)."""

    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0)
    weight_decay: float = Field(default=0.0, ge=0, description="Decoupled weight decay.")
    grad_clip_norm: float = Field(default=0.0, ge=0, description="Global gradient-norm clip; 0 = off.")


def default_run_name(prefix: str, config: BaseModel) -> str:
    """A run name for a config without one: ``<prefix>-<UTC timestamp>``, or, inside a flow run of a
    deployment (``PREFECT__FLOW_RUN_ID`` set by the worker), ``<prefix>-<first 8 hex digits of the
    flow run id>-<4 hex digits of the config's hash>``: a retry of that flow run (``prefect flow-run
    retry``, the UI's Retry, the resume automation of ``flows/ops.py``) gets the same name and so
    resumes the run after its last checkpoint, while other flow runs and other configs get new names.
    """
    import hashlib
    from datetime import datetime

    flow_run_id = os.environ.get("PREFECT__FLOW_RUN_ID", "").replace("-", "")
    if flow_run_id:
        digest = hashlib.sha256(config.model_dump_json(exclude={"run_name"}).encode()).hexdigest()
        return f"{prefix}-{flow_run_id[:8]}-{digest[:4]}"
    return f"{prefix}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"


def latest_run_checkpoint(store: str, run_id: str, field: str, kind: str | None = None) -> str:
    """The ``tinker://`` path of the last checkpoint run ``run_id`` recorded in the training store
    at ``store``: its sampler weights when saved at that step, else its state (for ``field=run:<id>``
    settings such as a distillation teacher); with ``kind`` (``"state"`` or ``"sampler"``) the last
    checkpoint of that kind (an export starts from a state).

    Raises:
        ValueError: one line naming ``field``, the run and the store, and how to make the run
            (the store does not exist, or holds no checkpoint of that run).
    """
    from pathlib import Path

    from tinker_blocks.stores import TrainingStore

    make = f"train it first, e.g. prefect-tinker run sft --example tiny run_name={run_id} store={store}"
    if "://" not in store and not Path(store).expanduser().is_dir():
        raise ValueError(f"{field}=run:{run_id}: the training store {store} does not exist ({make})")
    rows = TrainingStore(root=store).query(
        "SELECT path FROM checkpoints WHERE run_id = ? AND (? IS NULL OR kind = ?) "
        "ORDER BY step DESC, kind = 'sampler' DESC, time DESC LIMIT 1",
        [run_id, kind, kind],
    )
    if not rows:
        what = f"{kind} checkpoint" if kind else "checkpoint"
        raise ValueError(f"{field}=run:{run_id}: the training store {store} has no {what} of run {run_id!r} ({make})")
    return str(rows[0]["path"])


def resolve_credentials(backend: BackendConfig) -> Any:
    """The ``TinkerCredentials`` block for ``backend`` (see :class:`BackendConfig` for precedence).

    Raises:
        ValueError: no block of that name exists.
    """
    from tinker_blocks import TinkerCredentials

    if backend.credentials_block:
        try:
            return TinkerCredentials.load(backend.credentials_block)
        except ValueError as exc:
            raise ValueError(
                f"backend.credentials_block: no TinkerCredentials block named {backend.credentials_block!r}"
            ) from exc
    if backend.base_url:
        return TinkerCredentials(
            base_url=backend.base_url,
            api_key=os.environ.get("TINKER_API_KEY"),
            request_deadline_s=backend.request_deadline_s,
        )
    return TinkerCredentials(
        local=True,
        local_root=backend.local_root,
        request_deadline_s=backend.request_deadline_s,
        local_sampler_workers=backend.local_sampler_workers,
    )


class RecipeConfig(LRScheduleFields):
    """The fields every recipe's config shares (each recipe's config subclasses it).

    Class attributes a recipe sets: ``recipe`` (its registry name), ``resume_fields`` (fields
    that must not change when a run resumes: they would silently alter the data position or the
    objective; :class:`~prefect_tinker.flows.session.RunSession` compares them with the stored
    run's config and refuses a change unless it is listed in ``allow_config_change``).
    """

    recipe: ClassVar[str] = ""
    resume_fields: ClassVar[tuple[str, ...]] = ("model", "tokenizer", "seed", "renderer", "lora_rank")

    model: str = Field(
        default="tiny", description="Base model: 'tiny', 'smollm2', a local HF directory, or a hosted model name."
    )
    tokenizer: str | None = Field(
        default=None,
        description=(
            "Tokenizer to load here instead of the one the backend names for the model (a local directory or a hub "
            "name): for a remote server naming a hub tokenizer this machine cannot download."
        ),
    )
    renderer: str = Field(
        default="auto",
        description="Renderer name; 'auto' resolves from the tokenizer (recorded with the run and its checkpoints).",
    )
    lora_rank: int = Field(default=32, ge=1, description="LoRA rank.")
    max_steps: int | None = Field(
        default=None, ge=1, description="Total optimizer steps of the run (counting earlier invocations)."
    )
    save_every: int = Field(default=20, ge=0, description="State checkpoint every n steps (0 = end only).")
    eval_every: int = Field(default=10, ge=0, description="Evaluators every n steps (0 = start and end only).")
    load_checkpoint_path: str | None = Field(
        default=None,
        description=(
            "Start from these weights (tinker://.../weights/..., e.g. an SFT checkpoint) with a fresh optimizer."
        ),
    )
    run_name: str | None = Field(
        default=None, description="Run id; re-running with the same name resumes after its last checkpoint."
    )
    store: str = Field(
        default_factory=default_store_root,
        description=(
            "Training store root: a folder or s3://bucket/prefix; default $PREFECT_TINKER_STORE, else "
            "~/.prefect-tinker/store (where prefect-tinker sql/runs look)."
        ),
    )
    seed: int = Field(default=0, description="Seed of data order, splits, sampling and LoRA init.")
    adam: AdamConfig = Field(default_factory=AdamConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)
    evaluators: list[EvalSpec] = Field(
        default_factory=list,
        description=(
            "Benchmarks run on the sampler weights at the start, every eval_every steps and at the end: built-in names"
            " (gsm8k), {benchmark: NAME, dataset: ..., limit: ...}, full benchmark specs or {kind: inspect, task: ...,"
            " name: ...}; results in the eval store and as eval/<name>/accuracy metrics."
        ),
    )
    prices: dict[str, TokenPrices] = Field(
        default_factory=dict,
        description="USD per million tokens by model name ({model: {prefill, prefill_cached, sample, train}}) for the "
        "cost/* metrics; a model without an entry costs 0 (the local server, unless priced).",
    )
    allow_config_change: list[str] = Field(
        default_factory=list,
        description=(
            "Fields allowed to differ from the stored run's config when resuming (e.g. [batch_size]); 'renderer' also "
            "allows starting from a checkpoint trained with another renderer."
        ),
    )

    def run_name_prefix(self) -> str:
        """Prefix of the default run name (``<prefix>-<timestamp>``): the recipe and the model name
        by default (``sft-tiny``)."""
        model = self.model.replace("/", "-")
        return f"{self.recipe}-{model}" if self.recipe else model

    def check_model(self) -> str:
        """The base model name to hand to the backend: for the embedded local server the name
        checked against what it can serve (an existing model directory becomes its absolute path,
        see :func:`~tinker_blocks.model_names.check_model_name`); other backends decide
        themselves (``model`` unchanged). Part of the run's preflight (reads the local root).

        Raises:
            UnknownModelName: one line naming the model and what the local server accepts.
        """
        if not self.backend.is_local():
            return self.model
        from tinker_blocks.model_names import check_model_name
        from tinker_local.launcher import default_root

        return check_model_name(self.model, self.backend.local_root or default_root())

    @model_validator(mode="after")
    def _default_run_name(self) -> RecipeConfig:
        if self.run_name is None:  # stable across retries of a deployment's flow run (resumes)
            self.run_name = default_run_name(self.run_name_prefix(), self)
        return self
