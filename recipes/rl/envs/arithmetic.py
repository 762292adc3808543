"""``arithmetic``: "What is a + b?" with operands drawn from ``[0, max_operand]`` by a generator
seeded with (seed, batch index): unbounded, no files, the fast default. The reply must be just
the integer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from prefect_tinker.recipes.rl.envs import EnvContext, Environment, register_env
from prefect_tinker.recipes.rl.envs.problems import problem_builder
from prefect_tinker.recipes.rl.problem_env import Problem, ProblemEnv
from prefect_tinker.recipes.rl.types import EnvGroupBuilder, RLDataset

__all__ = [
    "ArithmeticEnv",
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


def arithmetic_problem(rng: np.random.Generator, max_operand: int, id_prefix: str = "") -> Problem:
    """One sum ``a + b`` with ``a, b`` uniform in ``[0, max_operand]``."""
    a, b = (int(x) for x in rng.integers(0, max_operand + 1, size=2))
    return Problem(question=f"What is {a} + {b}?", answer=str(a + b), id=f"{id_prefix}{a}+{b}")


class ArithmeticDataset(RLDataset):
    """Unbounded generated sums: batch ``i`` draws its problems from ``default_rng([seed, i])``."""

    def __init__(self, groups_per_batch: int, make_builder, max_operand: int = 20, seed: int = 0):
        self.groups_per_batch = groups_per_batch
        self.make_builder = make_builder
        self.max_operand = max_operand
        self.seed = seed

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        rng = np.random.default_rng([self.seed, index])
        return [
            self.make_builder(arithmetic_problem(rng, self.max_operand, f"b{index}-"))
            for _ in range(self.groups_per_batch)
        ]


class ArithmeticOptions(BaseModel):
    """``env_options`` of ``arithmetic``."""

    model_config = ConfigDict(extra="forbid")
    max_operand: int = Field(default=20, ge=1, description="Operands are drawn from [0, max_operand].")


@register_env
class Arithmetic(Environment):
    name = "arithmetic"
    description = "Generated sums 'What is a + b?' (operands up to env_options.max_operand); the reply is the integer."
    Options = ArithmeticOptions

    @classmethod
    def build(cls, spec, ctx: EnvContext) -> RLDataset:
        make = problem_builder(ArithmeticEnv, spec, ctx, ARITHMETIC_SHOT, "", cls.name)
        return ArithmeticDataset(ctx.groups_per_batch, make, cls.options(spec).max_operand, ctx.seed)


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
