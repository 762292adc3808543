"""Config pieces shared by every recipe: :class:`RecipeConfig` (the fields every recipe's config
has), which Tinker backend to use, the optimizer, and the default store root."""

from __future__ import annotations

import os
from datetime import UTC
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import BaseModel, Field, model_validator

from prefect_tinker.recipes.evals.specs import EvalSpec
from prefect_tinker.recipes.pricing import TokenPrices
from prefect_tinker.recipes.resume_marker import RESUME, resume_fields
from prefect_tinker.recipes.schedule import LRScheduleFields
from tinker_blocks.model_registry import Weights, WeightsRefError, is_weights_ref

# The flows' default store root is the one `prefect-tinker sql/runs/checkpoints` read
# ($PREFECT_TINKER_STORE, else $PREFECT_TINKER_HOME/store, else ~/.prefect-tinker/store).
from tinker_blocks.store_config import default_store_root

if TYPE_CHECKING:
    from prefect_tinker.recipes.builders import DatasetBuilder
    from prefect_tinker.recipes.rl.envs import EnvContext

__all__ = [
    "BackendConfig",
    "AdamConfig",
    "RecipeConfig",
    "resolve_credentials",
    "default_run_name",
    "default_store_root",
    "weights_ref",
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
    retry``, the UI's Retry, the resume automation of ``cli/automations.py``) gets the same name and so
    resumes the run after its last checkpoint, while other flow runs and other configs get new names.
    """
    import hashlib
    from datetime import datetime

    flow_run_id = os.environ.get("PREFECT__FLOW_RUN_ID", "").replace("-", "")
    if flow_run_id:
        digest = hashlib.sha256(config.model_dump_json(exclude={"run_name"}).encode()).hexdigest()
        return f"{prefix}-{flow_run_id[:8]}-{digest[:4]}"
    return f"{prefix}-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"


def weights_ref(store: str, ref: str, field: str) -> Weights:
    """What the weights reference ``ref`` names now, read from the training store at ``store``:
    ``alias:LINE@ALIAS``, ``run:RUN``, a ``tinker://`` path or a base model name
    (:func:`tinker_blocks.model_registry.resolve_weights`, the one resolver of every ``model=``,
    ``teacher=``, ``checkpoint=`` and ``load_checkpoint_path=`` setting).

    Raises:
        WeightsRefError: one line naming ``field``, the reference and the store (an alias never
            set, a run without checkpoints, a store that does not exist).
    """
    from tinker_blocks.model_registry import resolve_weights
    from tinker_blocks.stores import TrainingStore

    return resolve_weights(TrainingStore(root=store), ref, field)


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


class PreflightChecks:
    """The checks a config's inputs get before anything starts (no Prefect flow run, no server, no
    store row): ``prefect-tinker run`` calls them before it starts the flow
    (``prefect_tinker.cli.flows.check_data``), and the flow's :class:`~prefect_tinker.flows.session.RunSession`
    calls :meth:`preflight` again when it opens. Configs of every recipe derive from it
    (:class:`RecipeConfig` and the recipe-less flows' configs: eval, export, RLHF)."""

    def preflight(self) -> None:
        """Read and validate the run's inputs that need no server (RL problems, benchmark files,
        checkpoint names). Default: nothing to check.

        Raises:
            ValueError / FileNotFoundError / KeyError / pydantic.ValidationError: naming the file,
                line, field or value of the first bad input.
        """

    def dataset_builder(self, renderer: str) -> DatasetBuilder | None:
        """The recipe's dataset builder for ``renderer``, whose ``check()`` reads every record; None
        for a config without a dataset (an RL environment, an evaluation). Default: None."""
        return None

    def checked_sections(self) -> dict[str, PreflightChecks]:
        """Nested configs whose checks run with this one's, by field name (RLHF's stages). Default: none."""
        return {}


class RecipeConfig(PreflightChecks, LRScheduleFields):
    """The fields every recipe's config shares (each recipe's config subclasses it).

    A recipe's config sets the class attribute ``recipe`` (its registry name) and marks the
    fields that must not change when a run resumes (they would silently alter the data position or
    the objective) with :data:`~prefect_tinker.recipes.resume_marker.RESUME`
    (``batch_size: Annotated[int, RESUME] = Field(...)``): :class:`~prefect_tinker.flows.session.RunSession`
    compares them with the stored run's config and refuses a change unless it is listed in
    ``allow_config_change`` (:meth:`resume_fields` lists them).
    """

    recipe: ClassVar[str] = ""

    model: Annotated[str, RESUME] = Field(
        default="tiny",
        description=(
            "Base model: 'tiny', 'smollm2', a local HF directory or a hosted model name; or weights to start from: "
            "alias:LINE@ALIAS (e.g. alias:assistant@champion) or run:RUN (that run's base model and last state)."
        ),
    )
    tokenizer: Annotated[str | None, RESUME] = Field(
        default=None,
        description=(
            "Tokenizer to load here instead of the one the backend names for the model (a local directory or a hub "
            "name): for a remote server naming a hub tokenizer this machine cannot download."
        ),
    )
    renderer: Annotated[str, RESUME] = Field(
        default="auto",
        description="Renderer name; 'auto' resolves from the tokenizer (recorded with the run and its checkpoints).",
    )
    lora_rank: Annotated[int, RESUME] = Field(default=32, ge=1, description="LoRA rank.")
    max_steps: int | None = Field(
        default=None, ge=1, description="Total optimizer steps of the run (counting earlier invocations)."
    )
    save_every: int = Field(default=20, ge=0, description="State checkpoint every n steps (0 = end only).")
    eval_every: int = Field(default=10, ge=0, description="Evaluators every n steps (0 = start and end only).")
    load_checkpoint_path: str | None = Field(
        default=None,
        description=(
            "Start from these weights with a fresh optimizer: tinker://.../weights/... (e.g. an SFT checkpoint), "
            "run:RUN or alias:LINE@ALIAS (their state checkpoint)."
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
    seed: Annotated[int, RESUME] = Field(default=0, description="Seed of data order, splits, sampling and LoRA init.")
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

    def data_fingerprint(self, renderer: str) -> str | None:
        """The identity of the run's data (``sha256:<hex>``) for the resolved ``renderer`` when
        :meth:`dataset_builder` gives no builder (whose own fingerprint is used): an RL
        environment's settings and problems. Recorded with the run; a resumed run must match it.
        Default: None (nothing recorded or compared)."""
        return None

    def env_context(self, renderer: str, tokenizer_id: str) -> EnvContext | None:
        """The RL environment context of a run of this config on the resolved ``renderer`` and
        ``tokenizer_id`` (built once by the run session: ``RunContext.env``). Default: None (a
        recipe without an environment)."""
        return None

    @classmethod
    def resume_fields(cls) -> tuple[str, ...]:
        """The fields a resumed run must keep: those marked
        :data:`~prefect_tinker.recipes.resume_marker.RESUME`, in field order (here ``model``,
        ``tokenizer``, ``renderer``, ``lora_rank``, ``seed``; a recipe's config adds its own)."""
        return resume_fields(cls)

    def run_name_prefix(self) -> str:
        """Prefix of the default run name (``<prefix>-<timestamp>``): the recipe and the model name
        by default (``sft-tiny``; a weights reference gives its line or run name:
        ``alias:assistant@champion`` -> ``sft-assistant``)."""
        name = self.model.split(":", 1)[1].split("@", 1)[0] if is_weights_ref(self.model) else self.model
        name = name.replace("/", "-")
        return f"{self.recipe}-{name}" if self.recipe else name

    def start_weights(self) -> tuple[str, str | None, Weights | None]:
        """Where the run starts: ``(base model, state checkpoint to start from or None, the
        resolved reference or None)``. ``model`` and ``load_checkpoint_path`` may be weights
        references (``alias:LINE@ALIAS``, ``run:RUN``), read from the training store now: a
        reference in ``model`` names the base model (the store's record of those weights) and the
        state to start from (none when the reference holds a base model).

        Raises:
            WeightsRefError: a reference names nothing, names sampler weights with no state
                checkpoint recorded beside them, or both fields are references.
        """
        model, init, ref = self.model, self.load_checkpoint_path, None
        if is_weights_ref(model):
            if init:
                raise WeightsRefError(
                    f"model={model} names the weights to start from: leave load_checkpoint_path ({init}) unset"
                )
            ref = weights_ref(self.store, model, "model")
            if ref.base_model is None:
                raise WeightsRefError(f"model={model}: the store does not record the base model of {ref.checkpoint}")
            model, init = ref.base_model, None if ref.is_base else ref.state_path
            if not ref.is_base and init is None:
                raise WeightsRefError(
                    f"model={self.model}: {ref.checkpoint} has no state checkpoint recorded beside it to train from"
                )
        elif init and is_weights_ref(init):
            ref = weights_ref(self.store, init, "load_checkpoint_path")
            if ref.state_path is None:
                raise WeightsRefError(
                    f"load_checkpoint_path={init}: {ref.checkpoint} has no state checkpoint to start from"
                )
            init = ref.state_path
        return model, init, ref

    def check_model(self, model: str | None = None) -> str:
        """The base model name to hand to the backend (``model``, default the base model of
        :meth:`start_weights`): for the embedded local server the name checked against what it
        can serve (an existing model directory becomes its absolute path, see
        :func:`~tinker_blocks.model_names.check_model_name`); other backends decide themselves
        (the name unchanged). Part of the run's preflight (reads the local root and, for a weights
        reference, the training store).

        Raises:
            UnknownModelName: one line naming the model and what the local server accepts.
            WeightsRefError: ``model`` is a reference that names nothing.
        """
        name = model if model is not None else self.start_weights()[0]
        if not self.backend.is_local():
            return name
        from tinker_blocks.model_names import check_model_name
        from tinker_local.launcher import default_root

        return check_model_name(name, self.backend.local_root or default_root())

    @model_validator(mode="after")
    def _default_run_name(self) -> RecipeConfig:
        if self.run_name is None:  # stable across retries of a deployment's flow run (resumes)
            self.run_name = default_run_name(self.run_name_prefix(), self)
        return self
