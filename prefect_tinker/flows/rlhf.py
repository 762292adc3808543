"""RLHF as one Prefect flow of three subflows: SFT -> reward model -> RL from the reward model.

One config (:class:`RLHFConfig`) holds what the stages share (model, renderer, LoRA rank, seed,
run name, store, backend) and a section per stage: ``sft`` (an
:class:`~prefect_tinker.flows.sft.SFTConfig`; default data: the bundled example chats), ``rm``
(a :class:`~prefect_tinker.flows.reward_model.RewardModelConfig`: comparisons, e.g. HH-RLHF) and
``rl`` (an :class:`~prefect_tinker.flows.rl_config.RLConfig` on the ``pairwise_preference``
environment; its prompts default to the reward model's comparisons).

Each stage is its own run in the stores -- ``<run_name>-sft``, ``<run_name>-rm``,
``<run_name>-rl`` -- and its own subflow run. The RL stage starts from the SFT stage's last state
(``load_checkpoint_path``), is rewarded by the reward model's final sampler weights
(``env_options.reward_model``, with the reward model's question and labels), and its win-rate
evaluator (``eval/win_rate``) judges the policy against its step-0 sampler -- the SFT model --
with the reward model.

Re-running the flow (:mod:`prefect_tinker.flows.rlhf_stages`): a stage whose run completed with
the same config and data is skipped (read from the training store); a stage that failed or was
killed resumes after its last checkpoint; a summary artifact covers the three stages. The reward
model trains from the base model (it does not depend on the SFT stage), as in the Tinker
cookbook's ``recipes/preference/rlhf/rlhf_pipeline.py``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

from prefect import get_run_logger
from pydantic import BaseModel, Field, model_validator

from prefect_tinker.flows.config import BackendConfig, PreflightChecks, default_run_name, default_store_root
from prefect_tinker.flows.interrupts import recipe_flow
from prefect_tinker.flows.reward_model import RewardModelConfig, reward_model_flow
from prefect_tinker.flows.rl import rl_flow
from prefect_tinker.flows.rl_config import RLConfig
from prefect_tinker.flows.rlhf_stages import StageResult, check_upstream, run_stage, stage_summary_artifact
from prefect_tinker.flows.sft import SFTConfig, sft_flow
from prefect_tinker.recipes.rl.envs import RunSettings

__all__ = ["RLHFConfig", "RLStageConfig", "rlhf_flow"]

#: Fields every stage takes from the top level of :class:`RLHFConfig`.
SHARED = ("model", "renderer", "lora_rank", "seed", "store", "backend")
#: Fields of the RL section the flow fills in from the earlier stages.
FILLED = ("load_checkpoint_path",)
FILLED_OPTIONS = ("reward_model", "question", "labels")


class RLStageConfig(RLConfig):
    """The ``rl`` section: an RL config on ``pairwise_preference`` whose starting weights, reward
    model and (by default) prompts come from the earlier stages."""

    env: str = Field(default="pairwise_preference", description="RL environment (pairwise_preference).")
    max_tokens: int = Field(default=64, ge=1, description="Most sampled tokens per reply.")
    format_coef: float = Field(
        default=1.0, ge=0, description="Reward penalty for a reply that did not end on a stop sequence."
    )

    def run_settings(self) -> RunSettings:
        """As an RL config's, and the env's check leaves dataset and reward model to the flow."""
        return replace(super().run_settings(), filled_by_pipeline=True)


class RLHFConfig(PreflightChecks, BaseModel):
    """Parameters of an RLHF pipeline run (the flow's single parameter); see the module docstring."""

    model: str = Field(
        default="tiny",
        description="Base model of every stage: 'tiny', 'smollm2', a local HF directory, or a hosted model name.",
    )
    renderer: str = Field(default="auto", description="Renderer of every stage; 'auto' resolves from the tokenizer.")
    lora_rank: int = Field(default=32, ge=1, description="LoRA rank of every stage.")
    seed: int = Field(default=0, description="Seed of every stage.")
    run_name: str | None = Field(
        default=None,
        description=(
            "Pipeline run id; the stages are <run_name>-sft, -rm and -rl. Re-running with the same name skips "
            "completed stages and resumes the others."
        ),
    )
    store: str = Field(
        default_factory=default_store_root,
        description="Training store root shared by the stages (a folder or s3://bucket/prefix).",
    )
    backend: BackendConfig = Field(default_factory=BackendConfig)
    sft: SFTConfig = Field(
        default_factory=SFTConfig, description="The SFT stage (default data: the bundled example chats)."
    )
    rm: RewardModelConfig = Field(
        default_factory=RewardModelConfig,
        description="The reward-model stage (comparisons: dataset=..., format=dialogue for HH-RLHF).",
    )
    rl: RLStageConfig = Field(
        default_factory=RLStageConfig, description="The RL stage (pairwise_preference; prompts default to rm.dataset)."
    )

    def checked_sections(self) -> dict[str, PreflightChecks]:
        return {"sft": self.sft, "rm": self.rm, "rl": self.rl}

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, data: Any) -> Any:
        """A section may not set what the top level shares or what the pipeline fills in."""
        if not isinstance(data, dict):
            return data
        problems = []
        for name in ("sft", "rm", "rl"):
            section = data.get(name)
            given = (
                set(section)
                if isinstance(section, dict)
                else (section.model_fields_set - {"run_name"} if isinstance(section, BaseModel) else set())
            )
            problems += [
                f"{name}.{f}: set {f} at the top level (shared by every stage)"
                for f in (*SHARED, "run_name")
                if f in given
            ]
        rl = data.get("rl")
        rl = rl if isinstance(rl, dict) else (rl.model_dump(exclude_unset=True) if isinstance(rl, BaseModel) else {})
        problems += [f"rl.{f}: filled in by the pipeline (the SFT stage's last state)" for f in FILLED if f in rl]
        problems += [
            f"rl.env_options.{f}: filled in by the pipeline (from the rm stage)"
            for f in FILLED_OPTIONS
            if f in (rl.get("env_options") or {})
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return data

    @model_validator(mode="after")
    def _check(self) -> RLHFConfig:
        if self.rl.env != "pairwise_preference":
            raise ValueError(f"rl.env={self.rl.env!r}: the RL stage of RLHF uses env pairwise_preference")
        if self.rm.dataset is None and not self.rm.sources:
            raise ValueError("rm.dataset: required (comparisons, e.g. HH-RLHF with rm.format=dialogue)")
        if self.run_name is None:
            self.run_name = default_run_name(f"rlhf-{self.model.replace('/', '-')}", self)
        return self

    def _shared(self, stage: str) -> dict[str, Any]:
        out = {f: getattr(self, f) for f in SHARED}
        out["backend"] = self.backend.model_dump(mode="json")
        return {**out, "run_name": f"{self.run_name}-{stage}"}

    def sft_config(self) -> SFTConfig:
        return SFTConfig.model_validate({**self.sft.model_dump(mode="json"), **self._shared("sft")})

    def rm_config(self) -> RewardModelConfig:
        return RewardModelConfig.model_validate({**self.rm.model_dump(mode="json"), **self._shared("rm")})

    def rl_config(self, sft_state: str, reward_model: str) -> RLConfig:
        """The RL stage's config: starts from ``sft_state``, rewarded by ``reward_model`` (the
        reward model's sampler weights, asked with its question and labels)."""
        data = self.rl.model_dump(mode="json")
        opts = dict(data["env_options"])
        if not data.get("dataset"):  # the prompts of the reward model's (first source of) comparisons
            src = self.rm.source_specs()[0]
            data["dataset"] = src.path
            if data.get("max_problems") is None:
                data["max_problems"] = src.max_records
            opts.setdefault("format", src.format if src.format in ("preference", "dialogue") else "dialogue")
            opts.setdefault("fields", dict(src.fields))
        opts.update(reward_model=reward_model, question=self.rm.question, labels=list(self.rm.labels))
        return RLConfig.model_validate(
            {**data, **self._shared("rl"), "env_options": opts, "load_checkpoint_path": sft_state}
        )


@recipe_flow("rlhf", "rlhf-{config.run_name}")
def rlhf_flow(config: RLHFConfig) -> dict[str, Any]:
    """SFT -> reward model -> RL (see the module docstring); returns each stage's run, status
    (``ran`` / ``skipped``), steps, final weights and final metrics, and the RL policy's win rate
    against the SFT model."""
    log = get_run_logger()
    sft_cfg, rm_cfg = config.sft_config(), config.rm_config()
    results: list[StageResult] = [
        run_stage("sft", sft_flow, sft_cfg, lambda r: sft_cfg.dataset_builder(r).fingerprint()),
        run_stage("rm", reward_model_flow, rm_cfg, lambda r: rm_cfg.dataset_builder(r).fingerprint()),
    ]
    sft, rm = results
    if rm.sampler_path is None:
        raise RuntimeError(f"stage rm: run {rm.run_name!r} recorded no sampler weights at its last step {rm.steps}")
    rl_cfg = config.rl_config(sft.state_path, rm.sampler_path)
    check_upstream("rl", rl_cfg, ("load_checkpoint_path", "env_options.reward_model"))
    results.append(run_stage("rl", rl_flow, rl_cfg, rl_cfg.data_fingerprint))
    rl = results[-1]
    win = rl.metrics.get("eval/win_rate", (None, None))
    extra = {
        "policy (RL sampler weights)": f"`{rl.sampler_path}`",
        "reward model": f"`{rm.sampler_path}`",
        "SFT state": f"`{sft.state_path}`",
        "win rate vs SFT (first, last)": win,
    }
    stage_summary_artifact(cast(str, config.run_name), results, extra)  # the validator set it
    log.info("RLHF %s: %s", config.run_name, ", ".join(f"{r.stage} {'ran' if r.ran else 'skipped'}" for r in results))
    return {
        "run_name": config.run_name,
        "stages": {r.stage: r.as_dict() for r in results},
        "policy": rl.sampler_path,
        "reward_model": rm.sampler_path,
        "sft_state": sft.state_path,
        "first_win_rate": win[0],
        "last_win_rate": win[1],
        "store": config.store,
    }
