"""``subtraction``: "What is a - b?" with ``a >= b`` drawn from ``[0, max_operand]``; the reply is
the integer. A new RL environment as one file: its options model and one registered class."""

from __future__ import annotations

import re

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from prefect_tinker.plugin import (
    EnvContext,
    EnvGroupBuilder,
    Environment,
    Problem,
    ProblemEnv,
    RLDataset,
    problem_builder,
    register_env,
)


class SubtractionOptions(BaseModel):
    """``env_options`` of ``subtraction``."""

    model_config = ConfigDict(extra="forbid")
    max_operand: int = Field(default=9, ge=1, description="Operands are drawn from [0, max_operand].")


class DifferenceEnv(ProblemEnv):
    """The reply must be one integer (spaces around it allowed); correct when it equals the difference."""

    def check_format(self, response: str) -> bool:
        return re.fullmatch(r"\s*-?\d+\s*", response) is not None

    def check_answer(self, response: str) -> bool:
        m = re.fullmatch(r"\s*(-?\d+)\s*", response)
        return m is not None and int(m.group(1)) == int(self.problem.answer)


class SubtractionDataset(RLDataset):
    """Batch ``i`` draws its problems from ``default_rng([seed, i])``."""

    def __init__(self, groups_per_batch: int, make_builder, max_operand: int, seed: int):
        self.groups_per_batch, self.make_builder, self.max_operand, self.seed = (
            groups_per_batch, make_builder, max_operand, seed)

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        rng = np.random.default_rng([self.seed, index])
        out = []
        for g in range(self.groups_per_batch):
            a, b = sorted(int(x) for x in rng.integers(0, self.max_operand + 1, size=2))[::-1]
            problem = Problem(question=f"What is {a} - {b}?", answer=str(a - b), id=f"b{index}-{g}")
            out.append(self.make_builder(problem))
        return out


@register_env
class Subtraction(Environment):
    name = "subtraction"
    description = "Generated differences 'What is a - b?' (a >= b); the reply is the integer."
    Options = SubtractionOptions

    @classmethod
    def build(cls, spec, ctx: EnvContext) -> RLDataset:
        make = problem_builder(DifferenceEnv, spec, ctx, (), "", cls.name)
        return SubtractionDataset(ctx.groups_per_batch, make, cls.options(spec).max_operand, ctx.seed)
