"""``humaneval``: code RL with the tests run in the sandbox.

Problems: ``dataset``, a JSONL(.gz) of ``{prompt, tests, entry_point}`` (HumanEval's
``data/HumanEval.jsonl.gz`` names the tests ``test``; both are read by
:func:`~prefect_tinker.recipes.sandbox.load_code_problems`). The model sees the prompt (signature
and docstring) and replies with the function in a fenced code block; its last code block is run
against the tests by the rollout's ``sandbox`` service (``ctx.service(SANDBOX)``; built in: a fresh
local sandbox, :func:`~prefect_tinker.recipes.sandbox.run_tests`: no network, an empty temporary
directory, CPU/wall/memory/process/file-size limits, no inherited environment). Reward:

    reward = all_passed + format_coef * (format_ok - 1)

(``format_ok``: the reply has a closed code block). With ``env_options.max_turns > 1`` a failed
attempt gets the failure (the assertion or limit, cut to ``feedback_chars``) back as a user
message and the model tries again; the last attempt is graded. Metrics per episode:
``env/all_passed``, ``env/correct_rate`` (the same), ``env/format_rate``, ``env/attempts``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field

from prefect_tinker.recipes.code_grading import solution_program
from prefect_tinker.recipes.rl.envs import EnvContext, Environment, EnvSpec, register_env
from prefect_tinker.recipes.rl.message_env import (
    EpisodeLimits,
    MessageEnv,
    MessageEnvOptions,
    MessageGroupBuilder,
    Reaction,
    freeze,
    thaw,
)
from prefect_tinker.recipes.rl.problem_env import ProblemDataset, load_renderer
from prefect_tinker.recipes.rl.services import SANDBOX, CodeTester
from prefect_tinker.recipes.rl.types import RLDataset, RolloutContext
from prefect_tinker.recipes.sandbox import last_code_block, load_code_problems

__all__ = ["CodeProblem", "HumanEval", "HumanEvalBuilder", "HumanEvalEnv", "HumanEvalOptions", "code_question"]

CODE_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function, signature included, "
    "in a single ```python code block."
)


class HumanEvalOptions(MessageEnvOptions):
    max_turns: int = Field(
        default=1,
        ge=1,
        le=32,
        description="Attempts: after a failure the test output comes back and the model tries again.",
    )
    timeout_s: float = Field(
        default=10.0, gt=0, le=120, description="Wall-time limit of one test run in the sandbox, seconds."
    )
    feedback_chars: int = Field(default=600, ge=0, description="Most characters of failure detail shown to the model.")


@dataclass(frozen=True)
class CodeProblem:
    """One problem: ``prompt`` (signature + docstring), ``tests`` (defines ``check(candidate)``),
    ``entry_point`` and ``id``."""

    prompt: str
    tests: str
    entry_point: str
    id: str = ""


def code_question(prompt: str) -> str:
    """The user message of a problem: the instruction, then the prompt in a code block."""
    return f"{CODE_INSTRUCTION}\n\n```python\n{prompt.rstrip()}\n```"


class HumanEvalEnv(MessageEnv):
    """One code problem, ``max_turns`` attempts (see the module docstring)."""

    outcome_metrics = ("all_passed", "correct", "format")

    def __init__(
        self,
        renderer: Any,
        messages: list[dict],
        problem: CodeProblem,
        *,
        tester: CodeTester,
        format_coef: float,
        timeout_s: float,
        feedback_chars: int,
        **kw: Any,
    ):
        super().__init__(renderer, messages, **kw)
        self.problem, self.tester, self.format_coef = problem, tester, float(format_coef)
        self.timeout_s, self.feedback_chars = float(timeout_s), int(feedback_chars)

    def finish(self, reply: dict) -> Reaction:
        p = self.problem
        code = last_code_block(reply.get("content") or "")
        if code is None:
            passed, detail = False, "your reply has no ```python code block"
        else:
            result = self.tester(
                solution_program(p.prompt, code, p.entry_point), p.tests, p.entry_point, self.timeout_s
            )
            passed, detail = result.passed, result.detail or result.sandbox.stderr[-self.feedback_chars :]
        format_ok = code is not None
        if not passed and self.turns < self.limits.max_turns:
            note = detail[-self.feedback_chars :] if self.feedback_chars else ""
            return Reaction(
                [
                    {
                        "role": "user",
                        "content": f"The tests failed: {note}\nReply with the corrected "
                        "function in a single ```python code block.",
                    }
                ]
            )
        return Reaction(
            done=True,
            reward=float(passed) + self.format_coef * (float(format_ok) - 1.0),
            metrics={
                "all_passed": float(passed),
                "correct": float(passed),
                "format": float(format_ok),
                "attempts": float(self.turns),
            },
            logs={"problem_id": p.id, "detail": detail[:300]},
        )


@dataclass(frozen=True, kw_only=True)
class HumanEvalBuilder(MessageGroupBuilder):
    limits: EpisodeLimits = EpisodeLimits(max_turns=1)
    problem: CodeProblem
    prefix: tuple = ()
    format_coef: float = 0.1
    timeout_s: float = 10.0
    feedback_chars: int = 600

    def make_envs(self) -> list[MessageEnv]:
        raise RuntimeError("humaneval envs need the sandbox service: make them with make_envs_in(ctx)")

    def make_envs_in(self, ctx: RolloutContext) -> list[MessageEnv]:
        renderer = load_renderer(self.renderer_name, self.tokenizer_id)
        tester = ctx.service(SANDBOX)
        messages = thaw(self.prefix) + [{"role": "user", "content": code_question(self.problem.prompt)}]
        return [
            HumanEvalEnv(
                renderer,
                messages,
                self.problem,
                tester=tester,
                format_coef=self.format_coef,
                timeout_s=self.timeout_s,
                feedback_chars=self.feedback_chars,
                limits=self.limits,
            )
            for _ in range(self.group_size)
        ]


@register_env
class HumanEval(Environment):
    name = "humaneval"
    description = "Code RL: HumanEval-style {prompt, tests, entry_point} JSONL, the last code block run in the sandbox."
    Options = HumanEvalOptions

    @classmethod
    def check(cls, spec: EnvSpec) -> None:
        if not spec.dataset:
            raise ValueError(
                "env 'humaneval' needs dataset=<JSONL(.gz) of {prompt, tests, entry_point}>, "
                "e.g. HumanEval's data/HumanEval.jsonl.gz"
            )

    @classmethod
    def preflight(cls, spec: EnvSpec) -> None:
        load_code_problems(spec.required_dataset())

    @classmethod
    def build(cls, spec: EnvSpec, ctx: EnvContext) -> RLDataset:
        opts = cls.options(spec)
        records = load_code_problems(spec.required_dataset())[: spec.max_problems or None]
        problems = [CodeProblem(r["prompt"], r["tests"], r["entry_point"], r["task_id"]) for r in records]
        prefix = freeze([{"role": "system", "content": spec.system_prompt}] if spec.system_prompt else [])

        def make(problem: CodeProblem) -> HumanEvalBuilder:
            return HumanEvalBuilder(
                problem=problem,
                prefix=prefix,
                format_coef=spec.format_coef,
                timeout_s=opts.timeout_s,
                feedback_chars=opts.feedback_chars,
                group_size=ctx.group_size,
                renderer_name=ctx.renderer_name,
                tokenizer_id=ctx.tokenizer_id,
                limits=opts.limits(),
                tags=(cls.name,),
            )

        return ProblemDataset(problems, ctx.groups_per_batch, make, ctx.seed)
