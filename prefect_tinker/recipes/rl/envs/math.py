"""``math``: any JSONL (or dataset) of problems, with ``question_field``/``answer_field`` naming
the columns (dotted paths allowed); references may be plain (``3/4``, ``\\frac{\\pi}{2}``) or
contain ``\\boxed{}`` / ``####``; replies are graded on their last ``\\boxed{}`` (style
``boxed``), ``####`` (``hash``) or either (``any``) with
:func:`prefect_tinker.recipes.rl.grading.answers_match`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from prefect_tinker.recipes.data_reading import looks_local
from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.envs.gsm8k import GSM8K_SUFFIX
from prefect_tinker.recipes.rl.envs.problems import load_problems, problem_builder
from prefect_tinker.recipes.rl.grading import answers_match, extract_final_answer
from prefect_tinker.recipes.rl.problem_env import ProblemDataset, ProblemEnv
from prefect_tinker.recipes.rl.types import RLDataset

__all__ = ["Math", "MathOptions", "MathEnv", "MathEnvAny", "MathEnvHash", "MATH_SUFFIX"]

MATH_SUFFIX = " Write the final answer inside \\boxed{}."
#: ``env_options.prompt="cookbook"``: tinker-cookbook 0.6.1's ``MathEnv`` suffix and solved example.
COOKBOOK_MATH_SUFFIX = " Write your answer in \\boxed{} format."
COOKBOOK_MATH_SHOT = (
    {"role": "user", "content": "How many r's are in strawberry?" + COOKBOOK_MATH_SUFFIX},
    {
        "role": "assistant",
        "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a 5) w 6) b 7) e 8) r "
        "9) r 10) y. We have r's at positions 3, 8, and 9. \\boxed{3}",
    },
)


def _shot(suffix: str) -> tuple[dict, dict]:
    return (
        {"role": "user", "content": "What is 1/2 + 1/4?" + suffix},
        {"role": "assistant", "content": "1/2 + 1/4 = 3/4, so the answer is \\boxed{\\frac{3}{4}}.\n#### 3/4"},
    )


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


class MathOptions(BaseModel):
    """``env_options`` of ``math``."""

    model_config = ConfigDict(extra="forbid")
    question_field: str = Field(default="question", description="Record field holding the problem text.")
    answer_field: str = Field(default="answer", description="Record field holding the reference answer.")
    answer_style: Literal["boxed", "hash", "any"] = Field(
        default="boxed", description="Where replies state the answer."
    )
    prompt: Literal["default", "cookbook"] = Field(
        default="default",
        description="default: our answer instruction and solved example; cookbook: tinker-cookbook 0.6.1's MathEnv "
        "prompt (' Write your answer in \\boxed{} format.', its 'strawberry' example; answer_style boxed).",
    )


@register_env
class Math(Environment):
    name = "math"
    description = (
        "Any JSONL/dataset of problems (env_options.question_field, answer_field); graded on \\boxed{} (answer_style)."
    )
    Options = MathOptions

    @classmethod
    def check(cls, spec: EnvSpec) -> None:
        if not spec.dataset:
            raise ValueError(
                "env 'math' needs dataset=<JSONL path or dataset id> (and env_options.question_field/answer_field)"
            )

    @classmethod
    def preflight(cls, spec: EnvSpec) -> None:
        dataset = spec.required_dataset()
        if looks_local(dataset):
            opts = cls.options(spec)
            load_problems(
                dataset,
                question_field=opts.question_field,
                answer_field=opts.answer_field,
                max_problems=spec.max_problems,
            )

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        cls.check(spec)
        opts = cls.options(spec)
        suffix = MATH_SUFFIX if opts.answer_style == "boxed" else GSM8K_SUFFIX
        shot = _shot(suffix)
        if opts.prompt == "cookbook":
            suffix, shot = COOKBOOK_MATH_SUFFIX, COOKBOOK_MATH_SHOT
        problems = load_problems(
            spec.required_dataset(),
            question_field=opts.question_field,
            answer_field=opts.answer_field,
            split=spec.split,
            config_name=spec.dataset_config,
            max_problems=spec.max_problems,
        )
        make = problem_builder(_STYLES[opts.answer_style], spec, ctx, shot, suffix, cls.name)
        return ProblemDataset(problems, ctx.groups_per_batch, make, ctx.seed)
