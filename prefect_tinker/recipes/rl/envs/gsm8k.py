"""``gsm8k``: grade-school word problems from a JSONL file (``question``/``answer`` fields, the
answer's last line ``#### n``) or a Hugging Face id (``openai/gsm8k``, config ``main``); the
reference is the number after ``####``; the reply must end with a ``#### n`` line (a
``\\boxed{n}`` is accepted too) and is graded numerically."""

from __future__ import annotations

from prefect_tinker.recipes.data_reading import looks_local
from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.envs.problems import load_problems, problem_builder
from prefect_tinker.recipes.rl.grading import answers_match, extract_final_answer
from prefect_tinker.recipes.rl.problem_env import ProblemDataset, ProblemEnv
from prefect_tinker.recipes.rl.types import RLDataset

__all__ = ["GSM8K", "GSM8KEnv", "GSM8K_SUFFIX"]

GSM8K_SUFFIX = " Solve it step by step, then give the final answer as a number on the last line, as '#### <number>'."
GSM8K_SHOT = (
    {"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?" + GSM8K_SUFFIX},
    {"role": "assistant", "content": "He has 3 + 4 = 7 apples.\n#### 7"},
)


class GSM8KEnv(ProblemEnv):
    """Reply must contain a final ``#### n`` (or ``\\boxed{n}``); graded numerically against the
    reference number (commas, ``$`` and units tolerated)."""

    def check_format(self, response: str) -> bool:
        return extract_final_answer(response, "any") is not None

    def check_answer(self, response: str) -> bool:
        return answers_match(extract_final_answer(response, "any"), self.problem.answer)


@register_env
class GSM8K(Environment):
    name = "gsm8k"
    description = "GSM8K word problems (JSONL with question/answer, or openai/gsm8k); replies end with '#### n'."

    @classmethod
    def preflight(cls, spec: EnvSpec) -> None:
        if spec.dataset and looks_local(spec.dataset):
            load_problems(spec.dataset, max_problems=spec.max_problems)

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        source = spec.dataset or "openai/gsm8k"
        config = spec.dataset_config or ("main" if source == "openai/gsm8k" else None)
        problems = load_problems(
            source,
            question_field="question",
            answer_field="answer",
            split=spec.split,
            config_name=config,
            max_problems=spec.max_problems,
        )
        make = problem_builder(GSM8KEnv, spec, ctx, GSM8K_SHOT, GSM8K_SUFFIX, cls.name)
        return ProblemDataset(problems, ctx.groups_per_batch, make, ctx.seed)
