"""``calculator``: word problems solved with a calculator tool (GSM8K by default).

The model sees the problem and one tool, ``calculator(expression)`` (:mod:`prefect_tinker.recipes.tools.calculator`:
plain arithmetic, never ``eval``), declared in the renderer's tool format; it may call it over
several turns (each result comes back as a tool message) and ends with a reply without a tool
call whose last line is ``#### <number>``. Reward, as in the one-step math envs:

    reward = correct + format_coef * (format_ok - 1)

with ``correct`` the numeric comparison of the ``####`` answer with the reference
(:func:`~prefect_tinker.recipes.rl.grading.answers_match`) and ``format_ok`` whether the final
reply has one. Metrics per episode: ``env/tool_calls`` (calls made), ``env/tool_errors``,
``env/correct_rate``, ``env/format_rate`` and the message-env endings (parse failures, context
overflow, turns run out).

Problems: ``dataset`` (JSONL with ``question_field``/``answer_field``, the answer's ``#### n`` or
``\\boxed{}`` taken as reference; default the Hugging Face ``openai/gsm8k``, config ``main``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

from prefect_tinker.recipes.data_reading import looks_local
from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.envs.problems import load_problems
from prefect_tinker.recipes.rl.grading import answers_match, extract_final_answer
from prefect_tinker.recipes.rl.message_env import (
    EpisodeLimits,
    MessageEnv,
    MessageEnvOptions,
    MessageGroupBuilder,
    Reaction,
    freeze,
    thaw,
)
from prefect_tinker.recipes.rl.problem_env import Problem, ProblemDataset
from prefect_tinker.recipes.rl.types import RLDataset
from prefect_tinker.recipes.tools import Toolset, calculator
from prefect_tinker.recipes.tools.calculator_traces import CALCULATOR_SYSTEM

__all__ = [
    "CALCULATOR_SHOTS",
    "CALCULATOR_SYSTEM",
    "Calculator",
    "CalculatorBuilder",
    "CalculatorEnv",
    "CalculatorOptions",
]


def _shot(question: str, expression: str, result: int, unit: str) -> tuple[dict, ...]:
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return (
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": str(result), "name": "calculator"},
        {"role": "assistant", "content": f"{expression} = {result} {unit}.\n#### {result}"},
    )


#: Two solved examples (few_shot): a tool call, its result, the final answer. (Measured on
#: SmolLM2-135M-Instruct: with them the exact tool call has a likelihood of about e^-7, more than
#: a correct direct answer's e^-14; with one example e^-17, so that RL saw no call to reinforce.)
CALCULATOR_SHOTS = (
    *_shot("A bag holds 23 marbles. How many marbles are in 41 bags?", "23 * 41", 943, "marbles"),
    *_shot("A shop had 58 pens and got 77 more. How many pens does it have now?", "58 + 77", 135, "pens"),
)


class CalculatorOptions(MessageEnvOptions):
    max_turns: int = Field(default=6, ge=1, le=32, description="Most replies per episode (tool calls + final answer).")
    question_field: str = Field(default="question", description="Record field holding the problem text.")
    answer_field: str = Field(default="answer", description="Record field holding the reference answer.")


class CalculatorEnv(MessageEnv):
    """One word problem with the calculator tool (see the module docstring)."""

    outcome_metrics = ("correct", "format")

    def __init__(self, renderer: Any, messages: list[dict], problem: Problem, *, format_coef: float, **kw: Any):
        super().__init__(renderer, messages, toolset=Toolset([calculator]), **kw)
        self.problem, self.format_coef = problem, float(format_coef)

    def finish(self, reply: dict) -> Reaction:
        text = reply.get("content") or ""
        answer = extract_final_answer(text, "any")
        correct, format_ok = answers_match(answer, self.problem.answer), answer is not None
        return Reaction(
            done=True,
            reward=float(correct) + self.format_coef * (float(format_ok) - 1.0),
            metrics={"correct": float(correct), "format": float(format_ok)},
            logs={"reference": self.problem.answer, "problem_id": self.problem.id},
        )


@dataclass(frozen=True, kw_only=True)
class CalculatorBuilder(MessageGroupBuilder):
    """The group of one problem: ``prefix`` (frozen messages) before the question."""

    limits: EpisodeLimits = EpisodeLimits(max_turns=6)
    problem: Problem
    prefix: tuple = ()
    format_coef: float = 0.1

    def make_env(self, renderer: Any) -> CalculatorEnv:
        messages = thaw(self.prefix) + [{"role": "user", "content": self.problem.question}]
        return CalculatorEnv(renderer, messages, self.problem, format_coef=self.format_coef, limits=self.limits)


@register_env
class Calculator(Environment):
    name = "calculator"
    description = "Word problems (GSM8K default) with a calculator tool over several turns; reward: correct '#### n'."
    Options = CalculatorOptions

    @classmethod
    def preflight(cls, spec: EnvSpec) -> None:
        if spec.dataset and looks_local(spec.dataset):
            opts = cls.options(spec)
            load_problems(
                spec.dataset,
                question_field=opts.question_field,
                answer_field=opts.answer_field,
                max_problems=spec.max_problems,
            )

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        source = spec.dataset or "openai/gsm8k"
        config = spec.dataset_config or ("main" if source == "openai/gsm8k" else None)
        opts = cls.options(spec)
        problems = load_problems(
            source,
            question_field=opts.question_field,
            answer_field=opts.answer_field,
            split=spec.split,
            config_name=config,
            max_problems=spec.max_problems,
        )
        prefix = [{"role": "system", "content": spec.system_prompt or CALCULATOR_SYSTEM}]
        if spec.few_shot:
            prefix += [dict(m) for m in CALCULATOR_SHOTS]
        limits = opts.limits()

        def make(problem: Problem) -> CalculatorBuilder:
            return CalculatorBuilder(
                problem=problem,
                prefix=freeze(prefix),
                format_coef=spec.format_coef,
                group_size=ctx.group_size,
                renderer_name=ctx.renderer_name,
                tokenizer_id=ctx.tokenizer_id,
                limits=limits,
                tags=(cls.name,),
            )

        return ProblemDataset(problems, ctx.groups_per_batch, make, ctx.seed)
