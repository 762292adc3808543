"""``guess_number``: one agent against an environment over several turns.

The environment thinks of an integer in ``[low, high]``; each reply of the agent is a guess (its
last integer) and the environment answers ``Higher.``, ``Lower.`` or ends the game when it is
right. Reward 1 for finding the number within ``max_turns`` guesses, else 0; a reply without a
number is answered with a reminder and counts as a guess (``env/invalid_guesses``). Metrics per
episode: ``env/correct_rate`` (found), ``env/guesses``.

Secrets are a pure function of the run's seed and the group's place (batch, group): every member
of a group plays the same secret, so group-centred advantages compare strategies on one game.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import Field, model_validator

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
from prefect_tinker.recipes.rl.types import RLDataset

__all__ = ["GuessNumber", "GuessNumberBuilder", "GuessNumberEnv", "GuessNumberOptions", "last_integer"]

_INT = re.compile(r"-?\d+")


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (None if there is none)."""
    found = _INT.findall(text or "")
    return int(found[-1]) if found else None


class GuessNumberOptions(MessageEnvOptions):
    low: int = Field(default=1, description="Smallest possible number.")
    high: int = Field(default=100, description="Largest possible number.")
    max_turns: int = Field(default=8, ge=1, le=32, description="Guesses allowed.")

    @model_validator(mode="after")
    def _range(self) -> GuessNumberOptions:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        return self


class GuessNumberEnv(MessageEnv):
    """One game: find ``secret`` in ``[low, high]`` (see the module docstring)."""

    outcome_metrics = ("correct",)

    def __init__(self, renderer: Any, secret: int, low: int, high: int, **kw: Any):
        intro = (
            f"I am thinking of an integer between {low} and {high}. Guess it. Reply with your guess as a "
            "number only; I will tell you whether my number is higher or lower."
        )
        super().__init__(renderer, [{"role": "user", "content": intro}], **kw)
        self.secret, self.low, self.high, self.invalid = secret, low, high, 0

    def react(self, reply: dict) -> Reaction:
        guess = last_integer(reply.get("content") or "")
        if guess == self.secret:
            return self._result(found=True)
        if guess is None:
            self.invalid += 1
            text = f"Please reply with a number between {self.low} and {self.high}."
        else:
            text = "Higher." if self.secret > guess else "Lower."
        if self.turns >= self.limits.max_turns:
            return self._result(found=False)
        return Reaction([{"role": "user", "content": text}])

    def _result(self, found: bool) -> Reaction:
        metrics = {
            "correct": float(found),
            "guesses": float(self.turns),
            "invalid_guesses": float(self.invalid),
            "max_turns_reached": float(not found),
        }
        return Reaction(
            done=True,
            reward=float(found),
            metrics=metrics,
            logs={"reference": str(self.secret), "end": "found" if found else "max_turns"},
        )


@dataclass(frozen=True, kw_only=True)
class GuessNumberBuilder(MessageGroupBuilder):
    limits: EpisodeLimits = EpisodeLimits(max_turns=8)
    secret: int
    low: int = 1
    high: int = 100

    def make_env(self, renderer: Any) -> GuessNumberEnv:
        return GuessNumberEnv(renderer, self.secret, self.low, self.high, limits=self.limits)


@register_env
class GuessNumber(Environment):
    name = "guess_number"
    description = "Multi-turn game: guess a hidden integer from 'higher'/'lower' answers; reward 1 when found."
    Options = GuessNumberOptions

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        opts = cls.options(spec)

        def make(batch: int, group: int) -> GuessNumberBuilder:
            secret = int(problem_rng(ctx.seed, batch, group).integers(opts.low, opts.high + 1))
            return GuessNumberBuilder(
                secret=secret,
                low=opts.low,
                high=opts.high,
                group_size=ctx.group_size,
                renderer_name=ctx.renderer_name,
                tokenizer_id=ctx.tokenizer_id,
                limits=opts.limits(),
                tags=(cls.name,),
            )

        return GeneratedDataset(ctx.groups_per_batch, make)
