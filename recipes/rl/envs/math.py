"""``math``: any JSONL (or dataset) of problems, with ``question_field``/``answer_field`` naming
the columns (dotted paths allowed); references may be plain (``3/4``, ``\\frac{\\pi}{2}``) or
contain ``\\boxed{}`` / ``####``; replies are graded on their last ``\\boxed{}`` (style
``boxed``), ``####`` (``hash``) or either (``any``) with
:func:`prefect_tinker.recipes.rl.grading.answers_match`."""

from __future__ import annotations

from prefect_tinker.recipes.data_reading import looks_local
from prefect_tinker.recipes.rl.envs import EnvContext, Environment, register_env
from prefect_tinker.recipes.rl.envs.gsm8k import GSM8K_SUFFIX
from prefect_tinker.recipes.rl.envs.problems import load_problems, problem_builder
from prefect_tinker.recipes.rl.grading import answers_match, extract_final_answer
from prefect_tinker.recipes.rl.problem_env import ProblemDataset, ProblemEnv
from prefect_tinker.recipes.rl.types import RLDataset

__all__ = ["Math", "MathEnv", "MathEnvAny", "MathEnvHash", "MATH_SUFFIX"]

MATH_SUFFIX = " Write the final answer inside \\boxed{}."


def _shot(suffix: str) -> tuple[dict, dict]:
    return ({"role": "user", "content": "What is 1/2 + 1/4?" + suffix},
            {"role": "assistant", "content": "1/2 + 1/4 = 3/4, so the answer is \\boxed{\\frac{3}{4}}.\n#### 3/4"})


class MathEnv(ProblemEnv):
    """Reply graded on its last ``\\boxed{}`` (class attribute ``answer_style``: boxed/hash/any)."""

    answer_style = "boxed"

    def check_format(self, response: str) -> bool:
        return extract_final_answer(response, self.answer_style) is not None

    def check_answer(self, response: str) -> bool:
        return answers_match(extract_final_answer(response, self.answer_style), self.problem.answer)


class MathEnvHash(MathEnv):
    answer_style = "hash"


class MathEnvAny(MathEnv):
    answer_style = "any"


_STYLES = {"boxed": MathEnv, "hash": MathEnvHash, "any": MathEnvAny}


@register_env
class Math(Environment):
    name = "math"
    description = "Any JSONL/dataset of problems (question_field, answer_field); graded on \\boxed{} (answer_style)."

    @classmethod
    def check(cls, spec) -> None:
        if not spec.dataset:
            raise ValueError("env 'math' needs dataset=<JSONL path or dataset id> (and question_field/answer_field)")

    @classmethod
    def preflight(cls, spec) -> None:
        if looks_local(spec.dataset):
            load_problems(spec.dataset, question_field=spec.question_field, answer_field=spec.answer_field,
                          max_problems=spec.max_problems)

    @classmethod
    def build(cls, spec, ctx: EnvContext) -> RLDataset:
        cls.check(spec)
        suffix = MATH_SUFFIX if spec.answer_style == "boxed" else GSM8K_SUFFIX
        problems = load_problems(spec.dataset, question_field=spec.question_field, answer_field=spec.answer_field,
                                 split=spec.split, config_name=spec.dataset_config, max_problems=spec.max_problems)
        make = problem_builder(_STYLES[spec.answer_style], spec, ctx, _shot(suffix), suffix, cls.name)
        return ProblemDataset(problems, ctx.groups_per_batch, make, ctx.seed)
