"""The built-in recipes, registered in :data:`prefect_tinker.flows.registry.RECIPES` when it is
first read (its ``builtins``). Each flow is given by a function that imports and returns it: an
editor follows the import from the registration into the flow's module, and the flow is imported
only when its recipe runs (listing recipes imports none of them). Kept apart from the registry,
which the run session reads (curves), so that no import runs back from a flow to its registration.
"""

from __future__ import annotations

from typing import Any

from prefect_tinker.flows.registry import RECIPES, Recipe

__all__: list[str] = []


def _sft() -> Any:
    from prefect_tinker.flows.sft import sft_flow

    return sft_flow


def _rl() -> Any:
    from prefect_tinker.flows.rl import rl_flow

    return rl_flow


def _dpo() -> Any:
    from prefect_tinker.flows.dpo import dpo_flow

    return dpo_flow


def _distill() -> Any:
    from prefect_tinker.flows.distill import distill_flow

    return distill_flow


def _eval() -> Any:
    from prefect_tinker.flows.eval import eval_flow

    return eval_flow


def _export() -> Any:
    from prefect_tinker.flows.export import export_flow

    return export_flow


def _reward_model() -> Any:
    from prefect_tinker.flows.reward_model import reward_model_flow

    return reward_model_flow


def _rlhf() -> Any:
    from prefect_tinker.flows.rlhf import rlhf_flow

    return rlhf_flow


def _decisions() -> Any:
    from prefect_tinker.flows.decisions import decisions_flow

    return decisions_flow


def _promote() -> Any:
    from prefect_tinker.flows.promote import promote_flow

    return promote_flow


def _flywheel() -> Any:
    from prefect_tinker.flows.flywheel import flywheel_flow

    return flywheel_flow


for _recipe in (
    Recipe(
        "sft",
        _sft,
        "supervised fine-tuning on chat data (LoRA)",
        ("train/loss", "test/nll", "train/learning_rate"),
        ("tiny",),
    ),
    Recipe(
        "rl",
        _rl,
        "RL with verifiable rewards (GRPO-style group advantages)",
        ("env/reward_mean", "env/correct_rate", "train/entropy", "train/kl_sample_train_v1"),
        ("arithmetic",),
    ),
    Recipe(
        "dpo",
        _dpo,
        "preference learning: DPO / IPO / hinge on comparisons",
        ("train/dpo_loss", "train/accuracy", "train/margin", "test/accuracy"),
        ("tiny",),
    ),
    Recipe(
        "distill",
        _distill,
        "distillation: on-policy (teacher KL), off-policy (teacher samples / top-K), SDFT, prompt distillation",
        ("train/teacher_kl", "sdft/kl", "train/soft_ce", "train/loss", "eval/teacher_agreement"),
    ),
    Recipe(
        "eval",
        _eval,
        "benchmarks and inspect-ai tasks on base models, sampler paths or every checkpoint of a run (cached)",
        (),
        ("checkpoint",),
        tags={"checkpoint": ("consider-promotion",)},  # its evaluations may start a promotion (cli/automations.py)
    ),
    Recipe(
        "export",
        _export,
        "a checkpoint as a merged Hugging Face model or a PEFT adapter, verified by logprobs",
    ),
    Recipe(
        "reward_model",
        _reward_model,
        "pairwise reward model: which of two completions is better, scored by label probabilities",
        ("train/loss", "eval/rm_accuracy", "eval/rm_brier"),
    ),
    Recipe(
        "rlhf",
        _rlhf,
        "RLHF: SFT -> reward model -> RL from the reward model, one subflow (and run) per stage",
        (),
    ),
    Recipe(
        "decisions",
        _decisions,
        "a distribution over named choices from label-token probabilities; cross-entropy / KL, calibration",
        ("train/ce", "test/accuracy", "test/brier", "test/ece"),
    ),
    Recipe(
        "promote",
        _promote,
        "eval-gated promotion: candidate vs champion on the same items (paired bootstrap), alias moved if better",
        (),
        ("candidate",),
    ),
    Recipe(
        "flywheel",
        _flywheel,
        "captures -> dataset snapshot -> training from the champion -> gate -> promotion, on a schedule",
        (),
        ("tiny",),
        schedules={"tiny": ({"cron": "0 3 * * *", "timezone": "UTC"},)},  # each night: the last day's captures
    ),
):
    RECIPES.register(_recipe.name, _recipe)
