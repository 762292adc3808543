"""``pairwise_preference``: RL from a pairwise reward model (the RL stage of RLHF).

Prompts are the shared prompts of a comparison dataset (``dataset``, read like DPO's data:
``env_options.format`` ``preference`` or ``dialogue`` for HH-RLHF, ``env_options.fields``);
prompts that do not end with a user turn, repeats, and prompts longer than ``max_prompt_tokens``
are left out. The policy writes one reply per group member; the group reward comes from the
reward model (``env_options.reward_model``: sampler weights of a ``reward_model`` run) over
matchups within the group, each scored in both orders
(:mod:`prefect_tinker.recipes.reward_model`): win-minus-loss per member, and ``-format_coef``
for a reply that did not end on a stop sequence. Metrics: ``env/win_minus_loss``,
``env/format_rate``.

Reward-model calls go through the reward model client the rollout task lends the builder
(``ctx.service(PAIR_PREFERENCES)``: the cached ``reward-label-logprobs`` task on the rollout
task's backend), one call per group (every matchup, both orders, both labels); this module
imports no Prefect. ``test_prompts`` prompts are held out for the win-rate evaluator (the task
layer's :class:`~prefect_tinker.tasks.reward_model.WinRateEvaluator`, lent as the
build-time service ``WIN_RATE_EVALUATOR``; ``eval/win_rate``) against
``win_rate_reference``, by default the run's step-0 sampler (the policy it started from, e.g.
the SFT model).

Source: the Tinker cookbook's ``PairwisePreferenceGroupBuilder`` (``rl/preference_envs.py``);
written anew, scoring with label probabilities instead of one sampled token.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from prefect_tinker.recipes.renderers.base import Termination
from prefect_tinker.recipes.reward_model import (
    DEFAULT_QUESTION,
    ComparisonFormat,
    group_rewards,
    label_token_ids,
    matchups,
    render_comparison,
    win_minus_loss,
)
from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.problem_env import ProblemDataset, freeze_messages, load_renderer
from prefect_tinker.recipes.rl.services import PAIR_PREFERENCES, WIN_RATE_EVALUATOR
from prefect_tinker.recipes.rl.types import Env, EnvGroupBuilder, RLDataset, RolloutContext, StepResult, Trajectory

__all__ = [
    "PairwisePreference",
    "PairwisePreferenceOptions",
    "PreferenceEnv",
    "PreferenceGroupBuilder",
    "PreferencePrompt",
    "RewardModelRef",
    "load_preference_prompts",
]


class PairwisePreferenceOptions(BaseModel):
    """``env_options`` of ``pairwise_preference``."""

    model_config = ConfigDict(extra="forbid")

    reward_model: str | None = Field(
        default=None,
        description="Reward model sampler weights: tinker://.../sampler_weights/... (a reward_model run) "
        "or base:<model>.",
    )
    matchup_size: int | None = Field(
        default=None, ge=2, description="Matchups within chunks of this many members (None: all pairs of the group)."
    )
    format: Literal["preference", "dialogue", "hh"] = Field(
        default="preference", description="Record format of the prompts' dataset."
    )
    fields: dict[str, str] = Field(
        default_factory=dict, description="Field mapping of the dataset (prompt, chosen, rejected)."
    )
    question: str = Field(default=DEFAULT_QUESTION, description="The question the reward model was trained with.")
    labels: tuple[str, str] = Field(default=("A", "B"), description="The labels the reward model was trained with.")
    reward_renderer: str | None = Field(
        default=None, description="Renderer of the reward model (default the policy's)."
    )
    reward_tokenizer: str | None = Field(
        default=None, description="Tokenizer of the reward model (default the policy's)."
    )
    max_prompt_tokens: int = Field(default=512, ge=8, description="Leave out prompts longer than this (policy tokens).")
    test_prompts: int = Field(
        default=16, ge=0, description="Prompts held out for the win-rate evaluator (0 = no evaluator)."
    )
    win_rate_reference: str | None = Field(
        default=None, description="Sampler weights the win rate is measured against (default the run's step-0 sampler)."
    )


@dataclass(frozen=True)
class PreferencePrompt:
    """One prompt (messages as nested tuples, see :func:`freeze_messages`) and where it came from."""

    messages: tuple[tuple[tuple[str, str], ...], ...]
    id: str = ""

    def as_messages(self) -> list[dict]:
        return [dict(m) for m in self.messages]


@dataclass(frozen=True)
class RewardModelRef:
    """Which reward model scores a group and how comparisons are put to it."""

    path: str
    renderer_name: str
    tokenizer_id: str
    question: str = DEFAULT_QUESTION
    labels: tuple[str, str] = ("A", "B")

    def format(self) -> ComparisonFormat:
        return ComparisonFormat(question=self.question, labels=self.labels)


class PreferenceEnv(Env):
    """One reply to the prompt; the reward is all group-level (step reward 0)."""

    def __init__(self, prompt: list[dict], renderer: Any):
        self.prompt, self.renderer = prompt, renderer

    def initial_observation(self):
        return self.renderer.build_generation_prompt(self.prompt).to_ints(), self.renderer.get_stop_sequences()

    def step(self, action: list[int]) -> StepResult:
        parsed = self.renderer.parse_response(action)
        return StepResult(
            reward=0.0,
            episode_done=True,
            logs={"response": parsed.message.get("content") or "", "termination": parsed.termination.value},
        )


@dataclass(frozen=True)
class PreferenceGroupBuilder(EnvGroupBuilder):
    """``group_size`` replies to one prompt, rewarded by the reward model ``reward`` (module
    docstring), scored by the reward model client of the rollout task
    (``ctx.service(PAIR_PREFERENCES)``, :mod:`prefect_tinker.recipes.rl.services`)."""

    prompt: PreferencePrompt
    group_size: int
    renderer_name: str
    tokenizer_id: str
    reward: RewardModelRef
    matchup_size: int | None = None
    format_coef: float = 0.1
    tags: tuple[str, ...] = ("pairwise_preference",)

    def make_envs(self) -> list[PreferenceEnv]:
        renderer = load_renderer(self.renderer_name, self.tokenizer_id)
        return [PreferenceEnv(self.prompt.as_messages(), renderer) for _ in range(self.group_size)]

    def replies(self, trajectories_G: list[Trajectory]) -> list[tuple[str, bool]]:
        """``(reply text, ended on a stop sequence)`` per trajectory."""
        renderer = load_renderer(self.renderer_name, self.tokenizer_id)
        out = []
        for traj in trajectories_G:
            parsed = renderer.parse_response(traj.transitions[0].action_tokens)
            out.append((parsed.message.get("content") or "", parsed.termination == Termination.STOP_SEQUENCE))
        return out

    def compute_group_rewards(self, trajectories_G):
        raise RuntimeError(
            "pairwise_preference: group rewards need a reward model client; they are computed in a "
            "rollout (compute_group_rewards_in, ctx.service(PAIR_PREFERENCES))"
        )

    def compute_group_rewards_in(self, ctx: RolloutContext, trajectories_G):
        replies = self.replies(list(trajectories_G))
        pairs = matchups(len(replies), self.matchup_size)
        rend = load_renderer(self.reward.renderer_name, self.reward.tokenizer_id)
        fmt, prompt = self.reward.format(), self.prompt.as_messages()
        labels = label_token_ids(rend, fmt.labels)
        rendered = [
            (
                render_comparison(rend, prompt, replies[i][0], replies[j][0], fmt, labels),
                render_comparison(rend, prompt, replies[j][0], replies[i][0], fmt, labels),
            )
            for i, j in pairs
        ]
        scores = [2.0 * p - 1.0 for p in ctx.service(PAIR_PREFERENCES)(self.reward.path, rendered)]
        return self.rewards_from_scores(replies, pairs, scores)

    def rewards_from_scores(
        self, replies: list[tuple[str, bool]], pairs: list[tuple[int, int]], scores: list[float]
    ) -> list[tuple[float, dict[str, float]]]:
        """Group rewards and metrics from the matchup scores (``d`` in [-1, 1] per pair ``(i, j)``,
        positive when ``j`` is better)."""
        wml = win_minus_loss(len(replies), pairs, scores)
        valid = [ok for _, ok in replies]
        rewards = group_rewards(wml, valid, self.format_coef)
        return [(r, {"win_minus_loss": w, "format": float(v)}) for r, w, v in zip(rewards, wml, valid, strict=True)]

    def logging_tags(self) -> list[str]:
        return list(self.tags)


def load_preference_prompts(
    dataset: str,
    *,
    format: str = "preference",
    fields: dict[str, str] | None = None,
    split: str = "train",
    max_records: int | None = None,
    system_prompt: str | None = None,
    renderer: Any = None,
    max_prompt_tokens: int | None = None,
) -> list[PreferencePrompt]:
    """The distinct shared prompts of a comparison dataset that end with a user turn (and, with
    ``renderer``, render to at most ``max_prompt_tokens`` tokens), in file order.

    Raises:
        FileNotFoundError: a missing local file.
        ValueError: a malformed record (names ``file:line`` and the field), or no prompt left.
    """
    from prefect_tinker.recipes.data_reading import SourceSpec, iter_records
    from prefect_tinker.recipes.data_sources import RecordError, pairs_from_record

    spec = SourceSpec(path=dataset, split=split, max_records=max_records)
    seen, out, left_out = set(), [], 0
    for raw in iter_records(spec):
        if raw.error is not None:
            raise ValueError(f"{raw.where}: {raw.error}")
        try:
            prompt, _, _ = pairs_from_record(raw.record, format, fields or {})
        except RecordError as exc:
            raise ValueError(f"{raw.where}: {exc}") from None
        if system_prompt:
            prompt = [{"role": "system", "content": system_prompt}] + prompt
        key = json.dumps(prompt, sort_keys=True)
        if not prompt or prompt[-1].get("role") != "user" or key in seen:
            left_out += 1
            continue
        if (
            renderer is not None
            and max_prompt_tokens
            and renderer.build_generation_prompt(prompt).length > max_prompt_tokens
        ):
            left_out += 1
            continue
        seen.add(key)
        out.append(PreferencePrompt(freeze_messages(prompt), raw.where))
    if not out:
        raise ValueError(
            f"{dataset}: no usable prompt ({left_out} left out: not ending with a user turn, repeated, "
            f"or longer than max_prompt_tokens={max_prompt_tokens})"
        )
    return out


@functools.lru_cache(maxsize=4)
def _split_prompts(spec_json: str, renderer_name: str, tokenizer_id: str, seed: int):
    from prefect_tinker.recipes.datasets import split_conversations

    s = json.loads(spec_json)
    opts = s["opts"]
    prompts = load_preference_prompts(
        s["dataset"],
        format=opts["format"],
        fields=opts["fields"],
        split=s["split"],
        max_records=s["max_problems"],
        system_prompt=s["system_prompt"],
        renderer=load_renderer(renderer_name, tokenizer_id),
        max_prompt_tokens=opts["max_prompt_tokens"],
    )
    n_test = opts["test_prompts"]
    if n_test and n_test >= len(prompts):
        raise ValueError(f"env_options.test_prompts={n_test} leaves no training prompt out of {len(prompts)}")
    return split_conversations(prompts, n_test, seed=seed) if n_test else (prompts, [])


@register_env
class PairwisePreference(Environment):
    name = "pairwise_preference"
    description = "RL from a pairwise reward model (env_options.reward_model) on the prompts of a comparison dataset."
    Options = PairwisePreferenceOptions

    @classmethod
    def check(cls, spec: EnvSpec) -> None:
        opts = cls.options(spec)
        ComparisonFormat(question=opts.question, labels=opts.labels)
        later = spec.run_settings().filled_by_pipeline  # the rlhf flow fills these in
        if not spec.dataset and not later:
            raise ValueError("env 'pairwise_preference' needs dataset=<comparisons JSONL or dataset id> (its prompts)")
        if opts.reward_model is None and not later:
            raise ValueError(
                "env 'pairwise_preference' needs env_options.reward_model=tinker://.../sampler_weights/... "
                "(the sampler weights of a reward_model run)"
            )
        path = opts.reward_model or ""
        if path and not (path.startswith("base:") or (path.startswith("tinker://") and "/sampler_weights/" in path)):
            raise ValueError(
                f"env_options.reward_model must be tinker://.../sampler_weights/... or base:<model>, got {path!r}"
            )

    @classmethod
    def preflight(cls, spec: EnvSpec) -> None:
        """Read the prompts' local records (no tokenizer, no server): a bad record fails before a
        run starts, naming file, line and field."""
        from pathlib import Path

        from prefect_tinker.recipes.builtin_datasets import resolve_source_path

        opts = cls.options(spec)
        if spec.dataset and Path(resolve_source_path(spec.dataset)).expanduser().exists():
            load_preference_prompts(
                spec.dataset,
                format=opts.format,
                fields=opts.fields,
                split=spec.split,
                max_records=spec.max_problems,
                system_prompt=spec.system_prompt,
            )

    @classmethod
    def _prompts(cls, spec, ctx: EnvContext):
        opts = cls.options(spec)
        if not spec.dataset or not opts.reward_model:
            raise ValueError("env 'pairwise_preference' needs dataset=... and env_options.reward_model=...")
        from prefect_tinker.recipes.data_reading import source_fingerprint

        body = {
            "dataset": spec.dataset,
            "content": source_fingerprint(spec.dataset),
            "split": spec.split,
            "max_problems": spec.max_problems,
            "system_prompt": spec.system_prompt,
            "opts": opts.model_dump(mode="json"),
        }
        return opts, _split_prompts(json.dumps(body, sort_keys=True), ctx.renderer_name, ctx.tokenizer_id, ctx.seed)

    @classmethod
    def reward_ref(cls, opts: PairwisePreferenceOptions, ctx: EnvContext) -> RewardModelRef:
        if opts.reward_model is None:
            raise ValueError("env 'pairwise_preference' needs env_options.reward_model=...")
        return RewardModelRef(
            opts.reward_model,
            opts.reward_renderer or ctx.renderer_name,
            opts.reward_tokenizer or ctx.tokenizer_id,
            opts.question,
            opts.labels,
        )

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        opts, (train, _) = cls._prompts(spec, ctx)
        make = partial(
            PreferenceGroupBuilder,
            group_size=ctx.group_size,
            renderer_name=ctx.renderer_name,
            tokenizer_id=ctx.tokenizer_id,
            reward=cls.reward_ref(opts, ctx),
            matchup_size=opts.matchup_size,
            format_coef=spec.format_coef,
        )
        return ProblemDataset(train, ctx.groups_per_batch, make, ctx.seed)

    @classmethod
    def evaluators(cls, spec: EnvSpec, ctx: EnvContext) -> list:
        opts, (_, test) = cls._prompts(spec, ctx)
        reference = opts.win_rate_reference or ctx.initial_sampler
        if not test or not reference or not ctx.services.has(WIN_RATE_EVALUATOR):
            return []
        ref = cls.reward_ref(opts, ctx)
        return [
            ctx.service(WIN_RATE_EVALUATOR)(
                [p.as_messages() for p in test],
                reference,
                ref.path,
                renderer_name=ctx.renderer_name,
                tokenizer_id=ctx.tokenizer_id,
                fmt=ref.format(),
                reward_renderer=ref.renderer_name,
                reward_tokenizer=ref.tokenizer_id,
                max_tokens=ctx.max_tokens,
                temperature=ctx.temperature,
                seed=ctx.seed,
            )
        ]
