"""``prompts``: prompt-only episodes served from datasets -- the student answers, nothing is graded.

Each episode is one prompt record (:class:`~prefect_tinker.recipes.distill.prompts.PromptRecord`:
the conversation before the reply, an optional golden answer) rendered as a generation prompt;
the reply ends the episode with reward 0. The signal comes from elsewhere (the teacher's
logprobs in on-policy distillation and SDFT).

Options (``env_options``): ``format``, ``fields``, ``options`` (how ``dataset`` is read: any
record format, e.g. ``messages``, ``prompt_completion``, or ``prompt`` for one text field), or
``sources``: several sources with weights (each a full ``SourceSpec``); a batch then draws each
of its prompts from source ``i`` with probability proportional to its weight (with replacement,
seeded by (seed, batch)), and the record remembers ``i`` (the distill flow pairs each source with
its teacher). With one source, batches are seeded per-epoch permutations (as the problem envs), or
with ``shuffle=false`` the prompts in file order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from prefect_tinker.recipes.data_reading import SourceSpec
from prefect_tinker.recipes.distill.prompts import PromptRecord, load_prompts
from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.problem_env import ProblemDataset, load_renderer
from prefect_tinker.recipes.rl.types import Env, EnvGroupBuilder, RLDataset, StepResult

__all__ = ["PromptEnv", "PromptGroupBuilder", "Prompts", "PromptsOptions", "WeightedPrompts", "prompt_sources"]


class PromptsOptions(BaseModel):
    """``env_options`` of the ``prompts`` env."""

    model_config = ConfigDict(extra="forbid")

    format: str = Field(
        default="messages", description="Record format of `dataset` (messages, prompt, prompt_completion, ...)."
    )
    fields: dict[str, str] = Field(default_factory=dict, description="Field mapping of `dataset`.")
    options: dict[str, Any] = Field(default_factory=dict, description="Converter options of `dataset`.")
    sources: list[SourceSpec] = Field(
        default_factory=list, description="Several weighted sources instead of `dataset`."
    )
    shuffle: bool = Field(
        default=True,
        description="One source: batches from seeded per-epoch permutations (true) or the prompts in file order, "
        "every epoch (false: tinker-cookbook's PromptOnlyDataset).",
    )


class PromptEnv(Env):
    """One prompt; the reply ends the episode (reward 0, the reply text logged)."""

    def __init__(self, record: PromptRecord, renderer: Any, system_prompt: str | None = None):
        self.record, self.renderer, self.system_prompt = record, renderer, system_prompt

    def messages(self) -> list[dict[str, str]]:
        """The student's prompt: its system prompt (if any and the record has none), then the record."""
        msgs = self.record.message_list()
        if self.system_prompt and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def initial_observation(self):
        return self.renderer.build_generation_prompt(self.messages()).to_ints(), self.renderer.get_stop_sequences()

    def step(self, action: list[int]) -> StepResult:
        parsed = self.renderer.parse_response(action)
        return StepResult(
            reward=0.0,
            episode_done=True,
            metrics={"ended": float(parsed.ok)},
            logs={
                "response": parsed.message.get("content") or "",
                "problem_id": self.record.id,
                "reference": self.record.answer or "",
            },
        )


@dataclass(frozen=True)
class PromptGroupBuilder(EnvGroupBuilder):
    """``group_size`` :class:`PromptEnv` s of one record (plain values: picklable, stable repr)."""

    record: PromptRecord
    group_size: int
    renderer_name: str
    tokenizer_id: str
    system_prompt: str | None = None
    tags: tuple[str, ...] = field(default=())

    def make_envs(self) -> list[PromptEnv]:
        renderer = load_renderer(self.renderer_name, self.tokenizer_id)
        return [PromptEnv(self.record, renderer, self.system_prompt) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return list(self.tags)


class WeightedPrompts(RLDataset):
    """Batches drawn from several record lists by weight (see the module docstring)."""

    def __init__(
        self,
        records: list[list[PromptRecord]],
        weights: list[float],
        groups_per_batch: int,
        make_builder,
        seed: int = 0,
    ):
        self.records, self.groups_per_batch, self.make_builder, self.seed = (
            records,
            groups_per_batch,
            make_builder,
            seed,
        )
        w = np.asarray(weights, dtype=np.float64)
        self.p = w / w.sum()

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        rng = np.random.default_rng([self.seed, index, 7])
        out = []
        for _ in range(self.groups_per_batch):
            src = int(rng.choice(len(self.records), p=self.p))
            out.append(self.make_builder(self.records[src][int(rng.integers(len(self.records[src])))]))
        return out


def prompt_sources(spec: Any) -> list[SourceSpec]:
    """The sources of a spec's prompts: ``env_options.sources``, else ``dataset`` read as
    ``env_options.format`` / ``fields`` / ``options``.

    Raises:
        ValueError: neither is given.
    """
    opts = Prompts.options(spec)
    if opts.sources:
        return list(opts.sources)
    if not spec.dataset:
        raise ValueError("env 'prompts' needs dataset=<JSONL path or dataset id> (or env_options.sources)")
    return [
        SourceSpec(
            path=spec.dataset,
            format=opts.format,
            fields=opts.fields,
            options=opts.options,
            split=spec.split,
            config_name=spec.dataset_config,
            max_records=spec.max_problems,
        )
    ]


@register_env
class Prompts(Environment):
    name = "prompts"
    description = (
        "Prompt-only episodes from datasets (reward 0): the student answers for a teacher to score (distillation)."
    )
    Options = PromptsOptions

    @classmethod
    def check(cls, spec: EnvSpec) -> None:
        prompt_sources(spec)

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        sources = prompt_sources(spec)
        records = [load_prompts(s, source=i) for i, s in enumerate(sources)]
        make = partial(
            PromptGroupBuilder,
            group_size=ctx.group_size,
            renderer_name=ctx.renderer_name,
            tokenizer_id=ctx.tokenizer_id,
            system_prompt=spec.system_prompt,
            tags=(cls.name,),
        )
        if len(records) == 1:
            return ProblemDataset(records[0], ctx.groups_per_batch, make, ctx.seed, shuffle=cls.options(spec).shuffle)
        return WeightedPrompts(records, [s.weight for s in sources], ctx.groups_per_batch, make, ctx.seed)
