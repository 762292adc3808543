"""``twenty_questions``: the policy asks yes/no questions to find a secret word; the answerer is
another model (a base model or a checkpoint) sampled through its own sampling client.

Each reply of the policy is one question. When it names the secret word (a whole word, plural
allowed) the game is won (reward 1); otherwise the answerer -- prompted with the secret and the
question, sampled from ``env_options.answerer`` (``base:<model>`` or a
``tinker://.../sampler_weights/...`` path; default ``base:<the run's model>``) through the rollout
task's client registry and rendered for ``answerer_tokenizer`` (default the policy's) -- says
``Yes.``, ``No.`` or ``I don't know.`` (anything but a leading yes or
no). After ``max_turns`` questions the game is lost (reward 0). Metrics per episode:
``env/correct_rate`` (won), ``env/questions``, ``env/answerer_unsure`` (answers that were neither).

The secret is a pure function of the run's seed and the group's place; all members of a group
play the same word. Source: the Tinker cookbook's twenty-questions multi-agent recipe (the game
and the answerer-as-model setting); written anew.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import tinker
from pydantic import Field, field_validator

from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.message_env import (
    EpisodeLimits,
    GeneratedDataset,
    MessageEnv,
    MessageEnvOptions,
    MessageGroupBuilder,
    Reaction,
    problem_rng,
)
from prefect_tinker.recipes.rl.problem_env import load_renderer
from prefect_tinker.recipes.rl.services import SAMPLER
from prefect_tinker.recipes.rl.types import RLDataset, RolloutContext

__all__ = [
    "Answerer",
    "TwentyQuestions",
    "TwentyQuestionsBuilder",
    "TwentyQuestionsEnv",
    "TwentyQuestionsOptions",
    "WORDS",
    "names_word",
]

#: Default secret words: common concrete things.
WORDS = (
    "apple",
    "banana",
    "carrot",
    "bread",
    "cheese",
    "dog",
    "cat",
    "horse",
    "cow",
    "fish",
    "bird",
    "elephant",
    "chair",
    "table",
    "bed",
    "lamp",
    "door",
    "window",
    "book",
    "pencil",
    "phone",
    "clock",
    "car",
    "bicycle",
    "train",
    "boat",
    "airplane",
    "tree",
    "flower",
    "river",
    "mountain",
    "sun",
    "moon",
    "shoe",
    "hat",
    "ball",
    "guitar",
    "piano",
    "cup",
    "spoon",
)

ANSWERER_SYSTEM = (
    'You are the answerer in a game of twenty questions. The secret word is "{word}". Answer the '
    "player's question about it truthfully with Yes or No only."
)


def names_word(text: str, word: str) -> bool:
    """Whether ``text`` names ``word`` as a whole word (case-insensitive; plural ``-s``/``-es`` too)."""
    return re.search(rf"\b{re.escape(word.lower())}(?:s|es)?\b", (text or "").lower()) is not None


class TwentyQuestionsOptions(MessageEnvOptions):
    max_turns: int = Field(default=20, ge=1, le=32, description="Questions allowed.")
    words: list[str] = Field(
        default_factory=lambda: list(WORDS), min_length=1, description="Secret words to draw from."
    )
    answerer: str | None = Field(
        default=None,
        description="Answerer weights: 'base:<model>' or a tinker:// sampler path; default base:<the run's model>.",
    )
    answerer_renderer: str = Field(
        default="auto", description="Renderer of the answerer's prompts ('auto': from its tokenizer)."
    )
    answerer_tokenizer: str | None = Field(
        default=None,
        description="The answerer's tokenizer (a local directory or hub id); default the policy's "
        "(an answerer of the same family).",
    )
    answerer_max_tokens: int = Field(default=8, ge=1, description="Most tokens of an answer.")
    answerer_temperature: float = Field(default=0.0, ge=0, description="Answerer sampling temperature (0: greedy).")

    @field_validator("words")
    @classmethod
    def _words(cls, v: list[str]) -> list[str]:
        bad = [w for w in v if not re.fullmatch(r"[A-Za-z][A-Za-z -]*", w or "")]
        if bad:
            raise ValueError(f"words must be letters (spaces and hyphens allowed), got {bad[:3]}")
        return [w.strip().lower() for w in v]


class Answerer:
    """The answering model: a sampling client (the SDK's ``sample``) and the renderer of its
    prompts (for the answerer's own tokenizer)."""

    def __init__(self, client: Any, renderer: Any, *, max_tokens: int = 8, temperature: float = 0.0):
        self.client, self.renderer = client, renderer
        self.max_tokens, self.temperature = int(max_tokens), float(temperature)

    def answer(self, word: str, question: str, seed: int) -> str:
        """``"Yes."``, ``"No."`` or ``"I don't know."`` for ``question`` about ``word``."""
        msgs = [{"role": "system", "content": ANSWERER_SYSTEM.format(word=word)}, {"role": "user", "content": question}]
        prompt = self.renderer.build_generation_prompt(msgs)
        params = tinker.SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            seed=int(seed),
            stop=self.renderer.get_stop_sequences(),
        )
        resp = self.client.sample(prompt=prompt, num_samples=1, sampling_params=params).result()
        text = self.renderer.parse_response(list(resp.sequences[0].tokens)).message.get("content") or ""
        first = re.findall(r"[a-z]+", text.lower())[:1]
        return {"yes": "Yes.", "no": "No."}.get(first[0] if first else "", "I don't know.")


class TwentyQuestionsEnv(MessageEnv):
    """One game against ``answerer`` (see the module docstring)."""

    outcome_metrics = ("correct",)

    def __init__(self, renderer: Any, word: str, answerer: Answerer, *, seed: int = 0, **kw: Any):
        limits = kw["limits"]
        intro = (
            "Let's play twenty questions. I am thinking of a thing (an object, an animal, a food or a place). "
            "Ask me one yes/no question per reply to find it. When you think you know it, ask 'Is it a <thing>?'. "
            f"You have {limits.max_turns} questions."
        )
        super().__init__(renderer, [{"role": "user", "content": intro}], **kw)
        self.word, self.answerer, self.seed, self.unsure = word, answerer, int(seed), 0

    def react(self, reply: dict) -> Reaction:
        question = reply.get("content") or ""
        if names_word(question, self.word):
            return self._result(True)
        if self.turns >= self.limits.max_turns:
            return self._result(False)
        answer = self.answerer.answer(self.word, question, self.seed + self.turns)
        self.unsure += int(answer.startswith("I don't"))
        return Reaction([{"role": "user", "content": answer}])

    def _result(self, won: bool) -> Reaction:
        return Reaction(
            done=True,
            reward=float(won),
            metrics={
                "correct": float(won),
                "questions": float(self.turns),
                "answerer_unsure": float(self.unsure),
                "max_turns_reached": float(not won),
            },
            logs={"reference": self.word, "end": "won" if won else "max_turns"},
        )


@dataclass(frozen=True, kw_only=True)
class TwentyQuestionsBuilder(MessageGroupBuilder):
    """One secret word's group; the answerer's weights are named by ``answerer`` and its client
    is taken from the rollout task (:meth:`make_envs_in`)."""

    limits: EpisodeLimits = EpisodeLimits(max_turns=20)
    word: str
    answerer: str
    answerer_renderer: str = "auto"
    answerer_tokenizer: str | None = None
    answerer_max_tokens: int = 8
    answerer_temperature: float = 0.0

    def make_envs(self) -> list[MessageEnv]:
        raise RuntimeError(
            "twenty_questions envs need the answerer's sampling client: make them with make_envs_in(ctx)"
        )

    def make_envs_in(self, ctx: RolloutContext) -> list[MessageEnv]:
        renderer = load_renderer(self.renderer_name, self.tokenizer_id)
        answerer_renderer = load_renderer(self.answerer_renderer, self.answerer_tokenizer or self.tokenizer_id)
        answerer = Answerer(
            ctx.service(SAMPLER)(self.answerer),
            answerer_renderer,
            max_tokens=self.answerer_max_tokens,
            temperature=self.answerer_temperature,
        )
        return [
            TwentyQuestionsEnv(renderer, self.word, answerer, seed=ctx.seed + 1000 * i, limits=self.limits)
            for i in range(self.group_size)
        ]


@register_env
class TwentyQuestions(Environment):
    name = "twenty_questions"
    description = "Multi-agent: ask yes/no questions to find a secret word; another model (base or checkpoint) answers."
    Options = TwentyQuestionsOptions

    @classmethod
    def check(cls, spec: EnvSpec) -> None:
        if cls.options(spec).answerer is None and not spec.run_settings().model:
            raise ValueError(
                "env 'twenty_questions' needs env_options.answerer ('base:<model>' or a tinker:// sampler path)"
            )

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        opts = cls.options(spec)
        answerer = opts.answerer or f"base:{spec.run_settings().model}"

        def make(batch: int, group: int) -> TwentyQuestionsBuilder:
            word = opts.words[int(problem_rng(ctx.seed, batch, group).integers(len(opts.words)))]
            return TwentyQuestionsBuilder(
                word=word,
                answerer=answerer,
                answerer_renderer=opts.answerer_renderer,
                answerer_tokenizer=opts.answerer_tokenizer,
                answerer_max_tokens=opts.answerer_max_tokens,
                answerer_temperature=opts.answerer_temperature,
                group_size=ctx.group_size,
                renderer_name=ctx.renderer_name,
                tokenizer_id=ctx.tokenizer_id,
                limits=opts.limits(),
                tags=(cls.name,),
            )

        return GeneratedDataset(ctx.groups_per_batch, make)
