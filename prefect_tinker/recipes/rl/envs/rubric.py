"""``rubric``: replies to any prompt dataset, rewarded by an LLM judge grading them against a rubric.

Records (``dataset``, JSONL or a dataset): the prompt is ``env_options.prompt_field`` (a string,
asked as one user message, or a list of messages), or else the record's ``messages`` up to its
last user turn (so a chat SFT set works as is). The rubric is the record's ``rubric_field`` when
present (a string, one criterion per non-empty line, or a list of strings), else
``env_options.criteria`` (the same rubric for every item); a record with neither is an error
naming file and line.

Each reply is graded by the judge (``env_options.judge``: ``base:<model>`` or
``tinker://.../sampler_weights/...``, with its own ``judge_renderer``/``judge_tokenizer``) through
the rollout task's cached ``judge-reply`` task (:mod:`prefect_tinker.tasks.judge`), with the prompt
and parsing of :mod:`prefect_tinker.recipes.rl.judge`:

    reward = mean_k(score_k / max_score) - format_coef * (reply cut off before a stop sequence)

where an unparsed criterion counts as ``env_options.fallback`` (default 0.5). Metrics:
``env/judge_score`` (the judge's part of the reward), ``env/judge_unparsed`` (fraction of
criteria the judge's answer did not score: watch it; a judge that cannot follow the format gives
no signal), ``env/format_rate``. Works with every schedule (sync, streaming, async): the judge is
called inside the rollout task of each group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from prefect_tinker.recipes.renderers.base import Termination
from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.judge import JudgeRequest, parse_scores, rubric_reward
from prefect_tinker.recipes.rl.problem_env import ProblemDataset, load_renderer
from prefect_tinker.recipes.rl.services import JUDGE
from prefect_tinker.recipes.rl.types import Env, EnvGroupBuilder, RLDataset, RolloutContext, StepResult

__all__ = [
    "JudgeSettings",
    "Rubric",
    "RubricEnv",
    "RubricGroupBuilder",
    "RubricItem",
    "RubricOptions",
    "load_rubric_items",
]


class RubricOptions(BaseModel):
    """``env_options`` of ``rubric``."""

    model_config = ConfigDict(extra="forbid")

    judge: str = Field(description="Judge weights: base:<model> or tinker://.../sampler_weights/....")
    judge_renderer: str | None = Field(default=None, description="Renderer of the judge (default the policy's).")
    judge_tokenizer: str | None = Field(default=None, description="Tokenizer of the judge (default the policy's).")
    criteria: list[str] = Field(
        default_factory=list,
        description="Rubric for every item (one text per criterion), used where a record has none.",
    )
    prompt_field: str = Field(
        default="prompt",
        description="Record field holding the prompt (string or messages); else the record's messages.",
    )
    rubric_field: str = Field(
        default="rubric",
        description="Record field holding the item's own rubric (string: one criterion per line, or list).",
    )
    max_score: int = Field(default=10, ge=1, description="Top of each criterion's integer scale.")
    fallback: float = Field(
        default=0.5, ge=0, le=1, description="Score (0..1) of a criterion the judge's answer does not score."
    )
    judge_max_tokens: int = Field(default=64, ge=1, description="Most tokens of the judge's answer.")
    judge_temperature: float = Field(default=0.0, ge=0, description="Judge sampling temperature (0 = greedy).")

    @field_validator("judge")
    @classmethod
    def _weights(cls, v: str) -> str:
        if not (v.startswith("base:") or (v.startswith("tinker://") and "/sampler_weights/" in v)):
            raise ValueError(f"must be base:<model> or tinker://.../sampler_weights/..., got {v!r}")
        return v


@dataclass(frozen=True)
class RubricItem:
    """One prompt (``((role, content), ...)``), its rubric (criteria texts) and where it came from."""

    prompt: tuple[tuple[str, str], ...]
    criteria: tuple[str, ...]
    id: str = ""

    def messages(self) -> list[dict]:
        return [{"role": r, "content": c} for r, c in self.prompt]


def _criteria(value: Any, where: str, field: str) -> tuple[str, ...]:
    items = value.splitlines() if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(c, str) for c in items):
        raise ValueError(f"{where}: field {field!r} must be a string or a list of strings, got {value!r:.60}")
    out = tuple(c.strip() for c in items if c.strip())
    if not out:
        raise ValueError(f"{where}: field {field!r} holds no criterion")
    return out


def _prompt(record: dict, field: str, where: str) -> tuple[tuple[str, str], ...]:
    if field in record:
        value = record[field]
        msgs = [{"role": "user", "content": value}] if isinstance(value, str) else value
    elif isinstance(record.get("messages"), list):
        msgs = list(record["messages"])
        users = [i for i, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "user"]
        msgs = msgs[: users[-1] + 1] if users else []
    else:
        raise ValueError(
            f"{where}: no field {field!r} and no 'messages' (record has: {', '.join(record) or 'no fields'})"
        )
    if (
        not isinstance(msgs, list)
        or not msgs
        or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs
        )
    ):
        raise ValueError(
            f"{where}: field {field!r}: the prompt must be a non-empty string or a list of "
            f"{{role, content}} messages ending with a user turn"
        )
    if msgs[-1]["role"] != "user" or not msgs[-1]["content"].strip():
        raise ValueError(f"{where}: the prompt must end with a non-empty user turn")
    return tuple((m["role"], m["content"]) for m in msgs)


def load_rubric_items(
    source: str,
    opts: RubricOptions,
    *,
    split: str = "train",
    system_prompt: str | None = None,
    max_records: int | None = None,
) -> list[RubricItem]:
    """The items (prompt and rubric) of ``source`` in file order (module docstring).

    Raises:
        FileNotFoundError: a missing local file.
        ValueError: a malformed record, no prompt, a record without a rubric while
            ``opts.criteria`` is empty; the message names ``file:line`` and the field. No record.
    """
    from prefect_tinker.recipes.data_reading import SourceSpec, iter_records

    out = []
    for raw in iter_records(SourceSpec(path=source, split=split, max_records=max_records)):
        if raw.error:
            raise ValueError(f"{raw.where}: {raw.error}")
        record = raw.record
        prompt = _prompt(record, opts.prompt_field, raw.where)
        if system_prompt:
            prompt = (("system", system_prompt),) + prompt
        if opts.rubric_field in record:
            criteria = _criteria(record[opts.rubric_field], raw.where, opts.rubric_field)
        elif opts.criteria:
            criteria = _criteria(list(opts.criteria), raw.where, "env_options.criteria")
        else:
            raise ValueError(
                f"{raw.where}: no field {opts.rubric_field!r} and no env_options.criteria: the item has no rubric"
            )
        out.append(RubricItem(prompt, criteria, raw.where))
    if not out:
        raise ValueError(f"no records in {source!r}")
    return out


@dataclass(frozen=True)
class JudgeSettings:
    """How the judge is asked (the parts of a :class:`JudgeRequest` shared by every item)."""

    judge: str
    renderer_name: str
    tokenizer_id: str
    max_score: int = 10
    fallback: float = 0.5
    max_tokens: int = 64
    temperature: float = 0.0


class RubricEnv(Env):
    """One reply to ``item``'s prompt, graded by ``judge`` (``JudgeRequest -> answer text``)."""

    def __init__(self, item: RubricItem, renderer: Any, judge: Any, settings: JudgeSettings, format_coef: float):
        self.item, self.renderer, self.judge, self.settings = item, renderer, judge, settings
        self.format_coef = float(format_coef)

    def initial_observation(self):
        return self.renderer.build_generation_prompt(self.item.messages()).to_ints(), self.renderer.get_stop_sequences()

    def step(self, action: list[int]) -> StepResult:
        parsed = self.renderer.parse_response(action)
        reply = parsed.message.get("content") or ""
        s = self.settings
        answer = self.judge(
            JudgeRequest(
                judge=s.judge,
                renderer_name=s.renderer_name,
                tokenizer_id=s.tokenizer_id,
                criteria=self.item.criteria,
                prompt=self.item.prompt,
                reply=reply,
                max_score=s.max_score,
                max_tokens=s.max_tokens,
                temperature=s.temperature,
            )
        )
        scores = parse_scores(answer, len(self.item.criteria), s.max_score)
        score, unparsed = rubric_reward(scores, s.max_score, s.fallback)
        ended = parsed.termination == Termination.STOP_SEQUENCE
        return StepResult(
            reward=score - (0.0 if ended else self.format_coef),
            episode_done=True,
            metrics={"judge_score": score, "judge_unparsed": unparsed, "format": float(ended)},
            logs={"response": reply, "judge_answer": answer[:500], "problem_id": self.item.id},
        )


@dataclass(frozen=True)
class RubricGroupBuilder(EnvGroupBuilder):
    """``group_size`` replies to one item, graded by the judge the rollout task lends."""

    item: RubricItem
    group_size: int
    renderer_name: str
    tokenizer_id: str
    settings: JudgeSettings
    format_coef: float = 0.1

    def make_envs(self) -> list[RubricEnv]:
        raise RuntimeError("rubric envs need the rollout task's judge: make them with make_envs_in(ctx)")

    def make_envs_in(self, ctx: RolloutContext) -> list[RubricEnv]:
        renderer = load_renderer(self.renderer_name, self.tokenizer_id)
        judge = ctx.service(JUDGE)
        return [RubricEnv(self.item, renderer, judge, self.settings, self.format_coef) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["rubric"]


@register_env
class Rubric(Environment):
    name = "rubric"
    description = "Replies to any prompt dataset graded by an LLM judge (env_options.judge) against a rubric."
    Options = RubricOptions

    @classmethod
    def check(cls, spec: EnvSpec) -> None:
        if not spec.dataset:
            raise ValueError("env 'rubric' needs dataset=<JSONL of prompts (and rubrics) or dataset id>")

    @classmethod
    def _items(cls, spec) -> list[RubricItem]:
        return load_rubric_items(
            spec.dataset,
            cls.options(spec),
            split=spec.split,
            system_prompt=spec.system_prompt,
            max_records=spec.max_problems,
        )

    @classmethod
    def preflight(cls, spec: EnvSpec) -> None:
        from prefect_tinker.recipes.data_reading import looks_local

        if spec.dataset and looks_local(spec.dataset):
            cls._items(spec)

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        opts = cls.options(spec)
        settings = JudgeSettings(
            opts.judge,
            opts.judge_renderer or ctx.renderer_name,
            opts.judge_tokenizer or ctx.tokenizer_id,
            opts.max_score,
            opts.fallback,
            opts.judge_max_tokens,
            opts.judge_temperature,
        )
        make = partial(
            RubricGroupBuilder,
            group_size=ctx.group_size,
            renderer_name=ctx.renderer_name,
            tokenizer_id=ctx.tokenizer_id,
            settings=settings,
            format_coef=spec.format_coef,
        )
        return ProblemDataset(cls._items(spec), ctx.groups_per_batch, make, ctx.seed)
