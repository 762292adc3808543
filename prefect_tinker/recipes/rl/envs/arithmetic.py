"""``arithmetic``: "What is a + b?" with operands drawn from ``[0, max_operand]`` by a generator
seeded with (seed, batch index): unbounded, no files, the fast default. The reply must be just
the integer (``env_options.answer="last_integer"``: the reply's last integer is its answer and any
reply is well-formatted, as tinker-cookbook 0.6.1's ``ArithmeticEnv`` grades).

``env_options.reward="partial"`` adds partial credit to a wrong reply (reward shaping, Ng, Harada and
Russell 1999, "Policy invariance under reward transformations"; here a plain dense bonus, not their
potential-based form), so that a model which never answers right -- a randomly initialised one --
still sees rewards that differ within a group: see :class:`ArithmeticPartialCreditEnv`.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.envs.problems import problem_builder
from prefect_tinker.recipes.rl.problem_env import Problem, ProblemEnv
from prefect_tinker.recipes.rl.types import EnvGroupBuilder, RLDataset, StepResult

__all__ = [
    "ArithmeticEnv",
    "ArithmeticPartialCreditEnv",
    "ArithmeticLastIntegerEnv",
    "arithmetic_partial_credit",
    "ArithmeticDataset",
    "ArithmeticOptions",
    "Arithmetic",
    "arithmetic_problem",
    "write_arithmetic_sft_jsonl",
    "ARITHMETIC_SHOT",
]

#: The solved example of ``few_shot=true``.
ARITHMETIC_SHOT = ({"role": "user", "content": "What is 4 + 5?"}, {"role": "assistant", "content": "9"})


class ArithmeticEnv(ProblemEnv):
    """Reply must be one integer (spaces around it allowed); correct when it equals the sum."""

    def check_format(self, response: str) -> bool:
        return re.fullmatch(r"\s*-?\d+\s*", response) is not None

    def check_answer(self, response: str) -> bool:
        m = re.fullmatch(r"\s*(-?\d+)\s*", response)
        return m is not None and int(m.group(1)) == int(self.problem.answer)


class ArithmeticLastIntegerEnv(ProblemEnv):
    """Any reply is well-formatted; correct when its last integer (commas removed) equals the sum:
    tinker-cookbook 0.6.1's ``ArithmeticEnv`` rule (``"The sum is 12"`` is right, and so is
    ``"11? no, 12"``)."""

    def check_format(self, response: str) -> bool:
        return True

    def check_answer(self, response: str) -> bool:
        found = re.findall(r"-?\d+", response.replace(",", ""))
        return bool(found) and int(found[-1]) == int(self.problem.answer)


def arithmetic_partial_credit(response: str, answer: int) -> float:
    """Partial credit in ``[0, 0.5)`` for a reply that is not the right answer.

    ``0.1 * brevity + 0.2 * digit_share + 0.2 * closeness`` over the reply's non-space characters:
    ``brevity = min(1, len(str(answer)) / n_chars)`` (a length penalty: 1 for a reply no longer than
    the answer, 0 for an empty one), ``digit_share`` is the fraction of them that are digits and
    ``closeness = 1 / (1 + |n - answer|)`` for the reply's first integer ``n`` (0 when it has none).
    A reply ``"12"`` to ``answer=10`` scores ``0.1 + 0.2 + 0.2 / 3``. Every reply of a model that
    emits random tokens differs in length, so every group gets a learning signal; on the random
    ``tiny`` preset that did not yet make the reward rise within 7 steps (docs/training.md).
    """
    chars = [c for c in response if not c.isspace()]
    if not chars:
        return 0.0
    brevity = min(1.0, len(str(answer)) / len(chars))
    digit_share = sum(c.isdigit() for c in chars) / len(chars)
    m = re.search(r"\d+", response)
    closeness = 1.0 / (1.0 + abs(int(m.group(0)) - answer)) if m else 0.0
    return 0.1 * brevity + 0.2 * digit_share + 0.2 * closeness


class ArithmeticPartialCreditEnv(ArithmeticEnv):
    """:class:`ArithmeticEnv` whose wrong replies earn :func:`arithmetic_partial_credit`.

    ``reward = correct + (1 - correct) * partial + format_coef * (format_ok - 1)``: a right,
    well-formed reply still scores 1 and every wrong one less than 0.5, so the best policy is
    unchanged; the partial credit only gives a model that cannot yet add a direction (more
    digits, then numbers nearer the sum). ``metrics["partial"]`` holds the credit (0 when right).
    """

    def step(self, action: list[int]) -> StepResult:
        result = super().step(action)
        correct = result.metrics["correct"] > 0
        partial = 0.0 if correct else arithmetic_partial_credit(result.logs["response"], int(self.problem.answer))
        return dataclasses.replace(
            result, reward=result.reward + partial, metrics={**result.metrics, "partial": partial}
        )


def arithmetic_problem(rng: np.random.Generator, max_operand: int, id_prefix: str = "") -> Problem:
    """One sum ``a + b`` with ``a, b`` uniform in ``[0, max_operand]``."""
    a, b = (int(x) for x in rng.integers(0, max_operand + 1, size=2))
    return Problem(question=f"What is {a} + {b}?", answer=str(a + b), id=f"{id_prefix}{a}+{b}")


class ArithmeticDataset(RLDataset):
    """Unbounded generated sums: batch ``i`` draws its problems from ``default_rng([seed, i])``;
    with ``problems="cookbook"`` from ``numpy.random.RandomState(i)`` (``randint(0, max_operand + 1)``
    for a, then b, group after group), as tinker-cookbook 0.6.1's ``ArithmeticDataset`` does
    (there ``max_operand`` is 100 and the run's seed plays no part)."""

    def __init__(
        self,
        groups_per_batch: int,
        make_builder,
        max_operand: int = 20,
        seed: int = 0,
        problems: Literal["seeded", "cookbook"] = "seeded",
    ):
        self.groups_per_batch = groups_per_batch
        self.make_builder = make_builder
        self.max_operand = max_operand
        self.seed = seed
        self.problems = problems

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        if self.problems == "cookbook":
            legacy = np.random.RandomState(index)
            out = []
            for _ in range(self.groups_per_batch):
                a, b = int(legacy.randint(0, self.max_operand + 1)), int(legacy.randint(0, self.max_operand + 1))
                out.append(
                    self.make_builder(
                        Problem(question=f"What is {a} + {b}?", answer=str(a + b), id=f"b{index}-{a}+{b}")
                    )
                )
            return out
        rng = np.random.default_rng([self.seed, index])
        return [
            self.make_builder(arithmetic_problem(rng, self.max_operand, f"b{index}-"))
            for _ in range(self.groups_per_batch)
        ]


class ArithmeticOptions(BaseModel):
    """``env_options`` of ``arithmetic``."""

    model_config = ConfigDict(extra="forbid")
    max_operand: int = Field(default=20, ge=1, description="Operands are drawn from [0, max_operand].")
    reward: Literal["exact", "partial"] = Field(
        default="exact",
        description="exact: 1 for the right integer, else 0 (minus format_coef when malformed); partial: a wrong "
        "reply also earns up to 0.5 for its brevity, share of digits and closeness to the sum (rewards that differ "
        "within a group even when no reply is right).",
    )
    problems: Literal["seeded", "cookbook"] = Field(
        default="seeded",
        description="seeded: batch i's sums drawn from a generator seeded by (seed, i); cookbook: from "
        "numpy.random.RandomState(i), as tinker-cookbook 0.6.1's arithmetic environment (max_operand 100 there).",
    )
    answer: Literal["exact", "last_integer"] = Field(
        default="exact",
        description="exact: the reply must be just the integer (else malformed); last_integer: the reply's last "
        "integer is its answer and any reply is well-formatted (tinker-cookbook's rule; reward=exact only).",
    )

    @model_validator(mode="after")
    def _check(self) -> ArithmeticOptions:
        if self.answer == "last_integer" and self.reward == "partial":
            raise ValueError(
                "env_options.answer=last_integer goes with reward=exact (partial credit grades exact replies)"
            )
        return self


@register_env
class Arithmetic(Environment):
    name = "arithmetic"
    description = "Generated sums 'What is a + b?' (operands up to env_options.max_operand); the reply is the integer."
    Options = ArithmeticOptions

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        options = cls.options(spec)
        env_cls: type[ProblemEnv] = (
            ArithmeticLastIntegerEnv
            if options.answer == "last_integer"
            else ArithmeticPartialCreditEnv
            if options.reward == "partial"
            else ArithmeticEnv
        )
        make = problem_builder(env_cls, spec, ctx, ARITHMETIC_SHOT, "", cls.name)
        return ArithmeticDataset(ctx.groups_per_batch, make, options.max_operand, ctx.seed, options.problems)


def write_arithmetic_sft_jsonl(path: str | Path, n: int, *, max_operand: int = 20, seed: int = 0) -> Path:
    """Write ``n`` solved sums as chat JSONL (``{"messages": [user, assistant]}``) for an SFT warm-up
    in the same format the ``arithmetic`` env prompts with. Returns the path."""
    rng = np.random.default_rng([seed, 10**6])
    path = Path(path)
    with path.open("w", encoding="utf-8") as fh:
        for _ in range(n):
            p = arithmetic_problem(rng, max_operand)
            msgs = [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.answer}]
            fh.write(json.dumps({"messages": msgs}) + "\n")
    return path
