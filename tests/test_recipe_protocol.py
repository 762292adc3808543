"""The recipe protocol: the resume fields read from the ``RESUME`` field marker are the ones the
configs listed by hand before (``resume_fields`` tuples, computed from the code before the marker
replaced them and written out here), and the hooks every config answers."""

from __future__ import annotations

import pytest

from prefect_tinker.cli.flows import resolve_flow

BASE = ("model", "tokenizer", "seed", "renderer", "lora_rank")
ENV = ("env", "env_options", "few_shot", "system_prompt", "format_coef", "format_needs_stop")
RL = (
    *BASE,
    *ENV,
    "group_size",
    "groups_per_batch",
    "loss_fn",
    "loss_options",
    "advantage_estimator",
    "clip_low_threshold",
    "clip_high_threshold",
    "kl_penalty_coef",
    "kl_reference",
    "remove_constant_reward_groups",
    "normalize_advantages_std",
    "num_substeps",
)
# the tuples of the configs at commit e61e3ab (before the marker), one per recipe
BEFORE = {
    "sft": (
        *BASE,
        "batch_size",
        "train_on_what",
        "max_length",
        "test_size",
        "format",
        "fields",
        "sources",
        "messages_field",
        "on_too_long",
        "reduction",
        "data_order",
    ),
    "dpo": (
        *BASE,
        "batch_size",
        "max_length",
        "test_size",
        "max_test",
        "format",
        "fields",
        "sources",
        "dpo_loss",
        "beta",
        "label_smoothing",
        "reference",
        "reference_via",
        "data_order",
    ),
    "reward_model": (
        *BASE,
        "batch_size",
        "max_length",
        "test_size",
        "format",
        "fields",
        "sources",
        "orders",
        "question",
        "labels",
    ),
    "decisions": (
        *BASE,
        "batch_size",
        "max_length",
        "test_size",
        "choices",
        "prompt_field",
        "label_field",
        "probs_field",
        "instruction",
    ),
    "rl": RL,
    "distill": (
        *RL,
        "mode",
        "teacher",
        "teachers",
        "kl_discount_factor",
        "topk",
        "skip_first_tokens",
        "reverse",
        "soft_targets",
        "sequences",
        "teacher_max_tokens",
        "teacher_temperature",
        "samples_per_prompt",
        "keep_truncated",
        "batch_size",
        "test_size",
        "max_length",
    ),
}


# The one difference: decisions reads its records through the shared data fields
# (SourceFields), whose format/fields/sources are marked for every recipe that uses them; before,
# decisions alone left them out of its tuple.
ADDED = {"decisions": {"format", "fields", "sources"}}


@pytest.mark.parametrize("recipe", sorted(BEFORE))
def test_marked_resume_fields_are_the_listed_ones(recipe: str) -> None:
    _, model = resolve_flow(recipe)
    fields = model.resume_fields()
    assert len(fields) == len(set(fields))
    assert set(fields) == set(BEFORE[recipe]) | ADDED.get(recipe, set())


def test_env_spec_marks_every_field_but_the_problem_source() -> None:
    from prefect_tinker.recipes.resume_marker import resume_fields
    from prefect_tinker.recipes.rl.envs import EnvSpec

    assert set(resume_fields(EnvSpec)) == set(ENV)
    assert set(EnvSpec.model_fields) - set(ENV) == {"dataset", "dataset_config", "split", "max_problems"}


def test_rlhf_rl_stage_keeps_the_rl_fields() -> None:
    from prefect_tinker.flows.rlhf import RLStageConfig

    assert set(RLStageConfig.resume_fields()) == set(RL)


def test_protocol_defaults_and_overrides() -> None:
    """Each hook's default, and the recipes that override it (what RunSession and the CLI call)."""
    from prefect_tinker.flows.dpo import DPOConfig
    from prefect_tinker.flows.rl_config import RLConfig
    from prefect_tinker.flows.sft import SFTConfig

    sft = SFTConfig(model="tiny")
    assert sft.data_fingerprint("role_colon") is None and sft.env_context("role_colon", "tok") is None
    assert sft.dataset_builder("role_colon") is not None and DPOConfig(model="tiny").dataset_builder("x") is not None
    rl = RLConfig(model="tiny")
    assert rl.dataset_builder("role_colon") is None
    fp = rl.data_fingerprint("role_colon")
    assert fp.startswith("sha256:") and fp != rl.data_fingerprint("llama3")  # the renderer is part of it
    ctx = rl.env_context("role_colon", "tok")
    assert ctx is not None and (ctx.group_size, ctx.groups_per_batch) == (rl.group_size, rl.groups_per_batch)


def test_distillation_is_composed_of_the_rl_parts_not_an_rl_config() -> None:
    from prefect_tinker.flows.distill_config import DistillConfig
    from prefect_tinker.flows.rl_config import RLConfig, RLStepFields, RLTrainingConfig

    d = DistillConfig(model="tiny", teacher="tiny")
    assert not isinstance(d, RLConfig) and isinstance(d, RLStepFields) and isinstance(d, RLTrainingConfig)
    # the RL defaults of the shared step fields, the run-name prefix and the env's checks as before
    rl = RLConfig(model="tiny")
    shared = set(RLStepFields.model_fields) - set(DistillConfig.__annotations__)
    assert {f: getattr(d, f) for f in shared} == {f: getattr(rl, f) for f in shared}
    assert d.run_name and d.run_name.startswith("distill-on_policy-rl-prompts-tiny-")
    assert d.env_context("role_colon", "tok") is None  # no RL env context for the distillation session
    # the schedules check a distillation config through the shared step fields
    with pytest.raises(ValueError, match="streaming needs groups_per_batch"):
        DistillConfig(model="tiny", teacher="tiny", schedule="streaming", groups_per_batch=2, num_minibatches=4)
    # off-policy sequences: the builder once with_sequences gave them, none before
    from prefect_tinker.recipes.data_reading import SourceSpec
    from prefect_tinker.recipes.builtin_datasets import EXAMPLE_CHAT_PATH

    off = DistillConfig(model="tiny", teacher="tiny", mode="off_policy")
    assert off.dataset_builder("role_colon") is None
    b = off.with_sequences([SourceSpec(path=EXAMPLE_CHAT_PATH)], 2).dataset_builder("role_colon")
    assert b is not None and b.test_size == 2 and b.max_length == off.max_length
    assert off._sequences is None  # the copy carries them, the config stays as given
