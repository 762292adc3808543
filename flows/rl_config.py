"""The RL flow's configuration (its single parameter)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from prefect_tinker.flows.config import AdamConfig, BackendConfig, default_run_name, default_store_root
from prefect_tinker.recipes.rl.envs import EnvSpec
from prefect_tinker.tasks.rollouts import RolloutPolicy

__all__ = ["RLConfig"]


class RLConfig(EnvSpec):
    """Parameters of an RL-with-verifiable-rewards run.

    The environment fields (``env``, ``dataset``, ``question_field``, ``answer_field``, ...) come
    from :class:`prefect_tinker.recipes.rl.envs.EnvSpec`. A *step* is one batch of ``groups_per_batch`` groups of
    ``group_size`` rollouts, trained with ``num_substeps`` optimizer steps.
    """

    model: str = Field(default="tiny", description="Base model: 'tiny', 'smollm2', a local HF directory, or a hosted model name.")
    renderer: str = Field(default="auto", description="Renderer name ('auto' guesses from the tokenizer's chat template).")
    group_size: int = Field(default=4, ge=2, description="Rollouts per problem (advantages are centred within a group).")
    groups_per_batch: int = Field(default=8, ge=1, description="Problems per step.")
    learning_rate: float = Field(default=1e-4, gt=0, description="Adam learning rate.")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(default="constant", description="Decay over max_steps.")
    max_tokens: int = Field(default=16, ge=1, description="Most sampled tokens per action.")
    temperature: float = Field(default=1.0, gt=0, description="Sampling temperature (1.0 keeps importance ratios unbiased).")
    max_steps: int = Field(default=20, ge=1, description="Steps (batches) of the run, counting those of earlier invocations.")
    loss_fn: Literal["importance_sampling", "ppo", "cispo"] = Field(default="importance_sampling", description="Policy-gradient loss.")
    clip_low_threshold: float = Field(default=0.8, gt=0, description="ppo/cispo: lower bound of the importance ratio.")
    clip_high_threshold: float = Field(default=1.2, gt=0, description="ppo/cispo: upper bound of the importance ratio.")
    kl_penalty_coef: float = Field(default=0.0, ge=0, description="Per-token KL penalty against the reference model (0 = off).")
    kl_reference: str | None = Field(default=None, description="Reference weights: a tinker:// sampler path or 'base:<model>'; default the run's initial weights.")
    remove_constant_reward_groups: bool = Field(default=True, description="Drop groups whose rollouts all got the same reward.")
    normalize_advantages_std: bool = Field(default=False, description="Divide centred advantages by the group's std (original GRPO).")
    num_substeps: int = Field(default=1, ge=1, description="Optimizer steps per batch (the batch split by groups).")
    schedule: Literal["sync", "streaming", "async"] = Field(default="sync", description="sync on-policy, streaming minibatches, or async off-policy.")
    num_minibatches: int = Field(default=2, ge=1, description="streaming: forward/backward passes per optimizer step, each on the groups that arrived.")
    max_steps_off_policy: int = Field(default=1, ge=0, description="async: most steps (batches) a group's sampler may lag the trainer.")
    stale_groups: Literal["requeue", "drop"] = Field(default="requeue", description="async: what happens to groups older than max_steps_off_policy.")
    rollout: RolloutPolicy = Field(default_factory=RolloutPolicy, description="Failed-rollout strategy.")
    lora_rank: int = Field(default=32, ge=1)
    save_every: int = Field(default=5, ge=0, description="State checkpoint every n steps (0 = end only).")
    load_checkpoint_path: str | None = Field(default=None, description="Start from these weights (tinker://.../weights/..., e.g. an SFT checkpoint); fresh optimizer.")
    log_trajectories: int = Field(default=4, ge=0, description="Trajectories per step written to the store's trajectories table.")
    run_name: str | None = Field(default=None, description="Run id; re-running with the same name resumes.")
    store: str = Field(default_factory=default_store_root, description="Training store root: a folder or s3://bucket/prefix; default $PREFECT_TINKER_STORE, else ~/.prefect-tinker/store (where prefect-tinker sql/runs look).")
    seed: int = 0
    adam: AdamConfig = Field(default_factory=AdamConfig)
    backend: BackendConfig = Field(default_factory=BackendConfig)

    @model_validator(mode="after")
    def _check(self) -> "RLConfig":
        if self.run_name is None:  # stable across retries of a deployment's flow run (resumes)
            self.run_name = default_run_name(f"{self.env}-{self.model.replace('/', '-')}", self)
        if self.clip_low_threshold >= self.clip_high_threshold:
            raise ValueError(f"clip_low_threshold ({self.clip_low_threshold}) must be below clip_high_threshold ({self.clip_high_threshold})")
        if self.num_substeps > self.groups_per_batch:
            raise ValueError(f"num_substeps ({self.num_substeps}) cannot exceed groups_per_batch ({self.groups_per_batch})")
        if self.schedule == "streaming" and self.num_minibatches * self.num_substeps > self.groups_per_batch:
            raise ValueError(f"streaming needs groups_per_batch >= num_minibatches x num_substeps "
                             f"({self.num_minibatches} x {self.num_substeps} > {self.groups_per_batch})")
        if self.env == "math" and not self.dataset:
            raise ValueError("env 'math' needs dataset=<JSONL path or dataset id>")
        if self.rollout.min_group_size > self.group_size:
            raise ValueError(f"rollout.min_group_size ({self.rollout.min_group_size}) exceeds group_size ({self.group_size})")
        return self

    def loss_fn_config(self) -> dict[str, float] | None:
        """``loss_fn_config`` for the server: clip thresholds for ppo/cispo, None otherwise."""
        if self.loss_fn in ("ppo", "cispo"):
            return {"clip_low_threshold": self.clip_low_threshold, "clip_high_threshold": self.clip_high_threshold}
        return None
