"""The RL flow's configuration (its single parameter)."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from prefect_tinker.flows.config import RecipeConfig
from prefect_tinker.recipes.data_reading import source_fingerprint
from prefect_tinker.recipes.registry import Registry
from prefect_tinker.recipes.resume_marker import RESUME
from prefect_tinker.recipes.rl.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator
from prefect_tinker.recipes.rl.envs import EnvContext, EnvSpec, RunSettings
from prefect_tinker.recipes.rl.losses import LOSSES, ClipThresholds, RLLoss
from prefect_tinker.tasks.rollouts import RolloutPolicy
from prefect_tinker.tasks.runners import TaskRunnerFields
from prefect_tinker.tasks.services import register_builtin_services

register_builtin_services()  # the providers environments ask for by key (judge, sampler, ...)

__all__ = ["SCHEDULES", "RLConfig", "RLStepFields", "RLTrainingConfig"]

# RL schedules by name: subclasses of prefect_tinker.flows.rl_schedules.Schedule (that module imports this
# one for RLStepFields, so the registry is typed loosely here). The built-ins register themselves when their
# module is imported; a plugin adds one through the entry-point group ``prefect_tinker.schedules``.
SCHEDULES: Registry[Any] = Registry("RL schedule", "prefect_tinker.schedules", ["prefect_tinker.flows.rl_schedules"])


class RLStepFields(BaseModel):
    """The settings of the RL loop's step, shared by every config trained by it (:class:`RLConfig`,
    :class:`~prefect_tinker.flows.distill_config.DistillConfig`): a *step* is one batch of
    ``groups_per_batch`` groups of ``group_size`` rollouts (sampled with ``max_tokens`` and
    ``temperature``), turned into advantages (``advantage_estimator``), trained with ``loss_fn``
    in ``num_substeps`` optimizer steps, in the order the RL ``schedule`` gives; plus the
    defaults of the RL loop's learning rate, steps and checkpoints. The schedules
    (:mod:`prefect_tinker.flows.rl_schedules`) read and check these fields only.
    """

    group_size: Annotated[int, RESUME] = Field(
        default=4, ge=2, description="Rollouts per problem (advantages are centred within a group)."
    )
    groups_per_batch: Annotated[int, RESUME] = Field(default=8, ge=1, description="Problems per step.")
    learning_rate: float = Field(default=1e-4, gt=0, description="Adam learning rate.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="Decay over max_steps."
    )
    max_tokens: int = Field(default=16, ge=1, description="Most sampled tokens per action.")
    temperature: float = Field(
        default=1.0, gt=0, description="Sampling temperature (1.0 keeps importance ratios unbiased)."
    )
    max_steps: int = Field(
        default=20, ge=1, description="Steps (batches) of the run, counting those of earlier invocations."
    )
    eval_every: int = Field(default=0, ge=0, description="Evaluators every n steps (0 = start and end only).")
    loss_fn: Annotated[str, RESUME] = Field(
        default="importance_sampling",
        description=(
            "Policy-gradient loss, a registered RL loss: importance_sampling, ppo, cispo, gspo, dro, "
            "stable_reinforce (plugins add more)."
        ),
    )
    loss_options: Annotated[dict[str, Any], RESUME] = Field(
        default_factory=dict, description="Options of the loss (its own fields)."
    )
    advantage_estimator: Annotated[str, RESUME] = Field(
        default="group_mean",
        description=(
            "Registered advantage estimator: group_mean (R - group mean), leave_one_out (RLOO); plugins add more."
        ),
    )
    clip_low_threshold: Annotated[float | None, RESUME] = Field(
        default=0.8,
        gt=0,
        description="ppo/cispo/gspo: lower bound of the importance ratio (null: not sent, the server's default).",
    )
    clip_high_threshold: Annotated[float | None, RESUME] = Field(
        default=1.2,
        gt=0,
        description="ppo/cispo/gspo: upper bound of the importance ratio (null: not sent, the server's default).",
    )
    sampler_kind: Literal["snapshot", "inflight"] = Field(
        default="snapshot",
        description="async: 'snapshot' samplers keep the weights they were saved with; 'inflight' samplers "
        "(save_weights_and_get_sampling_client(kind='inflight')) move to each newer save, so rollouts "
        "in flight continue on new weights without restarting.",
    )
    kl_penalty_coef: Annotated[float, RESUME] = Field(
        default=0.0, ge=0, description="Per-token KL penalty against the reference model (0 = off)."
    )
    kl_reference: Annotated[str | None, RESUME] = Field(
        default=None,
        description="Reference weights: a tinker:// sampler path or 'base:<model>'; default the run's initial weights.",
    )
    remove_constant_reward_groups: Annotated[bool, RESUME] = Field(
        default=True, description="Drop groups whose rollouts all got the same reward."
    )
    normalize_advantages_std: Annotated[bool, RESUME] = Field(
        default=False, description="Divide centred advantages by the group's std (original GRPO)."
    )
    num_substeps: Annotated[int, RESUME] = Field(
        default=1, ge=1, description="Optimizer steps per batch (the batch split by groups)."
    )
    schedule: str = Field(
        default="sync",
        description="RL schedule by name (registry SCHEDULES): sync on-policy, streaming minibatches, async "
        "off-policy, or a plugin's.",
    )
    num_minibatches: int | None = Field(
        default=None,
        ge=1,
        description="streaming and async: forward/backward passes per optimizer step, each on the groups that "
        "arrived (the cookbook's stream_minibatch_config); None: 2 for streaming, 1 for async (the whole batch "
        "once it is there).",
    )
    max_steps_off_policy: int = Field(
        default=1, ge=0, description="async: most steps (batches) a group's sampler may lag the trainer."
    )
    stale_groups: Literal["requeue", "drop"] = Field(
        default="requeue", description="async: what happens to groups older than max_steps_off_policy."
    )
    rollout: RolloutPolicy = Field(default_factory=RolloutPolicy, description="Failed-rollout strategy.")
    save_every: int = Field(default=5, ge=0, description="State checkpoint every n steps (0 = end only).")
    log_trajectories: int = Field(
        default=4, ge=0, description="Trajectories per step written to the store's trajectories table."
    )

    @model_validator(mode="after")
    def _check(self) -> RLStepFields:
        self.loss().objective_inputs()  # an unknown loss, a bad loss option or objective input fails here
        ADVANTAGE_ESTIMATORS.get_or_raise(self.advantage_estimator)
        low, high = self.clip_low_threshold, self.clip_high_threshold
        if low is not None and high is not None and low >= high:
            raise ValueError(
                f"clip_low_threshold ({self.clip_low_threshold}) must be below "
                f"clip_high_threshold ({self.clip_high_threshold})"
            )
        if self.num_substeps > self.groups_per_batch:
            raise ValueError(
                f"num_substeps ({self.num_substeps}) cannot exceed groups_per_batch ({self.groups_per_batch})"
            )
        schedule = SCHEDULES.get_or_raise(self.schedule)
        schedule.check_config(self)
        if self.sampler_kind == "inflight" and not schedule.off_policy:
            raise ValueError(
                f"sampler_kind='inflight' needs an off-policy schedule such as 'async' (got schedule="
                f"{self.schedule!r}): on-policy schedules wait for every rollout before training"
            )
        if self.rollout.min_group_size > self.group_size:
            raise ValueError(
                f"rollout.min_group_size ({self.rollout.min_group_size}) exceeds group_size ({self.group_size})"
            )
        return self

    def loss(self) -> RLLoss:
        """The registered loss ``loss_fn`` with its ``loss_options``.

        Raises:
            ValueError: an unknown loss (lists the registered ones) or a bad option.
        """
        return LOSSES.get_or_raise(self.loss_fn).from_options(self.loss_options)

    def loss_fn_config(self) -> dict[str, float] | None:
        """``loss_fn_config`` for the server (e.g. clip thresholds for ppo/cispo; None: its defaults)."""
        return self.loss().loss_fn_config(ClipThresholds(self.clip_low_threshold, self.clip_high_threshold))

    def estimator(self) -> AdvantageEstimator:
        """The registered advantage estimator ``advantage_estimator``."""
        return ADVANTAGE_ESTIMATORS.get_or_raise(self.advantage_estimator)(self.normalize_advantages_std)

    @property
    def provenance(self) -> bool:
        """Whether rollouts record stability information and datums carry provenance spans
        (losses that need them, e.g. ``stable_reinforce``)."""
        return self.loss().provenance


class RLTrainingConfig(RLStepFields, EnvSpec, TaskRunnerFields, RecipeConfig):
    """A recipe's config trained by the RL loop (:class:`~prefect_tinker.flows.rl.RLLoop`): the step
    settings (:class:`RLStepFields`), the environment and problems
    (:class:`~prefect_tinker.recipes.rl.envs.EnvSpec`), where rollout tasks run
    (:class:`~prefect_tinker.tasks.runners.TaskRunnerFields`) and the fields every recipe shares
    (:class:`~prefect_tinker.flows.config.RecipeConfig`). It is no recipe itself: :class:`RLConfig`
    and :class:`~prefect_tinker.flows.distill_config.DistillConfig` each add their own part of the
    recipe protocol."""

    def run_settings(self) -> RunSettings:
        """The group size and policy model the environment's config check may need."""
        return RunSettings(group_size=self.group_size, model=self.model)

    def preflight(self) -> None:
        """Read and validate the environment's problems before the run starts (see
        :meth:`~prefect_tinker.recipes.rl.envs.Environment.preflight`)."""
        from prefect_tinker.recipes.rl.envs import get_env

        get_env(self.env).preflight(self)

    def data_fingerprint(self, renderer: str) -> str:
        """``sha256:<hex>`` of what the environment's problems are: the env settings and the
        content of its dataset (recorded with the run; a resumed run must match it)."""
        body = {k: getattr(self, k) for k in EnvSpec.model_fields}
        body["env_options"] = self.env_options.model_dump(mode="json")  # the options in force, defaults too
        body["dataset"] = source_fingerprint(self.dataset) if self.dataset else None
        body["renderer"] = renderer
        return "sha256:" + hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()

    def rl_run_name_prefix(self) -> str:
        """``rl-<env>-<model>``: the RL run-name prefix."""
        return f"rl-{self.env}-{self.model.replace('/', '-')}"


class RLConfig(RLTrainingConfig):
    """Parameters of an RL-with-verifiable-rewards run.

    The environment fields (``env``, ``dataset``, ``question_field``, ``answer_field``, ...) come
    from :class:`prefect_tinker.recipes.rl.envs.EnvSpec`. A *step* is one batch of ``groups_per_batch`` groups of
    ``group_size`` rollouts, trained with ``num_substeps`` optimizer steps. ``task_runner``
    (:class:`~prefect_tinker.tasks.runners.TaskRunnerFields`) says where the rollout tasks run.
    """

    recipe: ClassVar[str] = "rl"

    def run_name_prefix(self) -> str:
        return self.rl_run_name_prefix()

    def env_context(self, renderer: str, tokenizer_id: str) -> EnvContext:
        """The environment context of a run of this config on the resolved ``renderer`` and
        ``tokenizer_id`` (group and batch sizes, seed, rollout ``max_tokens`` and ``temperature``;
        build-time services such as the win-rate evaluator are resolved by key from the providers the
        task layer registers); built once by the run session."""
        return EnvContext(
            renderer_name=renderer,
            tokenizer_id=tokenizer_id,
            group_size=self.group_size,
            groups_per_batch=self.groups_per_batch,
            seed=self.seed,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
        )
