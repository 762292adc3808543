"""Graders: one reply text + one example -> ``Grade(correct, score, answer)``.

Kinds (:class:`GraderSpec` ``kind``):

``number``       GSM8K style: the final answer after ``####`` (then ``\\boxed{}``; style ``any``),
                 compared with :func:`~prefect_tinker.recipes.rl.grading.answers_match` (exact
                 rational comparison, then math-verify).
``math``         the last ``\\boxed{}`` (style ``boxed``), same comparison (symbolic answers).
``choice``       the option letter the reply chose (:func:`~prefect_tinker.recipes.evals.choice.parse_choice`)
                 equals the reference letter.
``exact_match``  SQuAD-normalised exact match (``correct``) and token F1 (``score``) against any
                 reference; the answer is the whole reply, or group 1 (else the whole match) of
                 the last match of ``answer_regex``.
``code``         the program (the last fenced code block, else the whole reply) passes when
                 ``run_code(program, example) -> bool`` says so: a callable registered with
                 :func:`register_code_runner` under ``code_runner``, or a ``"module:function"``
                 import path. The sandbox plugs in here.

Each kind is a function ``grader(spec, reply, example, run_code) -> Grade`` in :data:`GRADERS`;
a plugin adds a kind with :func:`register_grader` or an entry point of group
``prefect_tinker.graders``, and code runners with :func:`register_code_runner` or the group
``prefect_tinker.code_runners``.

``answer_style`` (number/math): ``hash`` (``####``), ``boxed``, ``any`` (``####`` then
``\\boxed{}``) or ``last_number`` (``any``, then the whole reply as a number, then its last number).

A grade's ``answer`` is None when the reply states no answer the grader can read (no ``####``,
no letter, an empty program): the runner counts it as *unparsable*. How the reply ended
(stop sequence, EOS, truncation) never decides that: graders see only the text.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, Field, field_validator

from prefect_tinker.recipes.evals.choice import parse_choice
from prefect_tinker.recipes.evals.example import Example
from prefect_tinker.recipes.grading_text import best_exact_match, best_token_f1
from prefect_tinker.recipes.registry import Registry
from prefect_tinker.recipes.rl.grading import (
    answers_match,
    extract_boxed,
    extract_final_answer,
    extract_hash_answer,
    parse_number,
)

__all__ = [
    "CODE_RUNNERS",
    "GRADERS",
    "Grade",
    "Grader",
    "GraderSpec",
    "CodeRunner",
    "grade",
    "extract_code",
    "extract_number_answer",
    "reference_answer",
    "register_code_runner",
    "register_grader",
    "resolve_code_runner",
]

AnswerStyle = Literal["hash", "boxed", "any", "last_number"]
#: ``run_code(program, example) -> passed``; exceptions count as errored samples.
CodeRunner = Callable[[str, "Example"], bool]

#: Code runners by name (``GraderSpec.code_runner``); plugins: entry-point group ``prefect_tinker.code_runners``.
CODE_RUNNERS: Registry[CodeRunner] = Registry("code runner", "prefect_tinker.code_runners")
_NUMBER_IN_TEXT = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?(?:/\d+)?")
_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)```", re.S)


class Grade(NamedTuple):
    """``correct`` (pass/fail), ``score`` (grader scale: 1/0, or token F1) and the ``answer`` read
    from the reply (None: unparsable)."""

    correct: bool
    score: float
    answer: str | None


class GraderSpec(BaseModel):
    """How replies are graded (see the module docstring)."""

    kind: str = Field(
        default="exact_match",
        description="A registered grader: number, math, choice, exact_match, code (or a plugin's).",
    )
    answer_style: AnswerStyle | None = Field(
        default=None,
        description="number/math: where the reply states its answer (default: any for number, boxed for math).",
    )
    answer_regex: str | None = Field(
        default=None,
        description="exact_match: regex whose last match (group 1 if any) is the answer; default the whole reply.",
    )
    code_runner: str | None = Field(
        default=None,
        description="code: a registered runner name or 'module:function' (run_code(program, example) -> bool).",
    )

    @field_validator("kind")
    @classmethod
    def _registered(cls, v: str) -> str:
        GRADERS.get_or_raise(v)
        return v

    @field_validator("answer_regex")
    @classmethod
    def _compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"answer_regex {v!r} does not compile: {exc}") from None
        return v

    def style(self) -> AnswerStyle:
        """The answer style in force for number/math graders."""
        return self.answer_style or ("boxed" if self.kind == "math" else "any")

    @property
    def score_name(self) -> str | None:
        """Metric name of the mean ``score`` when it differs from accuracy (``f1``), else None."""
        return "f1" if self.kind == "exact_match" else None


def register_code_runner(name: str, runner: CodeRunner) -> None:
    """Register ``runner(program, example) -> bool`` under ``name`` (overwrites) for code graders;
    the same as an entry point of group ``prefect_tinker.code_runners``."""
    CODE_RUNNERS.register(name, runner)


def resolve_code_runner(name: str | None) -> CodeRunner:
    """The code runner registered as ``name``, or imported from ``"module:function"``.

    Raises:
        ValueError: no name, an unknown name, or an import path that does not resolve to a callable.
    """
    if not name:
        raise ValueError("grader kind 'code' needs code_runner=<registered name or module:function>")
    if name in CODE_RUNNERS:
        return CODE_RUNNERS[name]
    if ":" not in name:
        raise ValueError(
            f"unknown code runner {name!r}; registered: {', '.join(CODE_RUNNERS.names()) or 'none'} "
            "(or give 'module:function')"
        )
    module, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"code runner {name!r} does not resolve: {exc}") from None
    if not callable(fn):
        raise ValueError(f"code runner {name!r} is not callable")
    return fn


def reference_answer(raw: Any) -> str:
    """The final answer inside a reference value: after ``####`` (GSM8K solutions), else the last
    ``\\boxed{}`` (MATH solutions), else the value itself (numbers as ``str``), stripped."""
    text = str(raw)
    return extract_hash_answer(text) or extract_boxed(text) or text.strip()


def extract_number_answer(reply: str, style: AnswerStyle) -> str | None:
    """The answer a reply states in ``style`` (see the module docstring); None when absent."""
    if style == "last_number":
        found = extract_final_answer(reply, "any")
        if found is not None:
            return found
        if parse_number(reply) is not None:
            return reply.strip()
        numbers = _NUMBER_IN_TEXT.findall(reply)
        return numbers[-1] if numbers else None
    return extract_final_answer(reply, style)


def extract_code(reply: str) -> str | None:
    """The last fenced code block of ``reply`` (```` ```python ... ``` ````), else the whole reply;
    None when that is blank."""
    blocks = _FENCE.findall(reply)
    code = blocks[-1][1] if blocks else reply
    return code if code.strip() else None


def _references(example: Example) -> list[str]:
    ref = example.reference
    return [str(r) for r in ref] if isinstance(ref, (list, tuple)) else [str(ref)]


#: ``grader(spec, reply, example, run_code) -> Grade`` of one ``GraderSpec.kind``.
Grader = Callable[[GraderSpec, str, "Example", "CodeRunner | None"], Grade]

#: Graders by kind; plugins: :func:`register_grader` or entry-point group ``prefect_tinker.graders``.
GRADERS: Registry[Grader] = Registry("grader", "prefect_tinker.graders")


def register_grader(kind: str, grader: Grader) -> Grader:
    """Register ``grader(spec, reply, example, run_code) -> Grade`` as grader ``kind`` (overwrites)."""
    return GRADERS.register(kind, grader)


def grade(spec: GraderSpec, reply: str, example: Example, *, run_code: CodeRunner | None = None) -> Grade:
    """Grade one reply text against ``example`` (its reference, options, fields) with the grader
    registered as ``spec.kind``.

    Args:
        run_code: code graders: overrides ``spec.code_runner``.

    Raises:
        ValueError: an unknown kind; a choice grader on an example without options; a code grader
            without a runner.
        Exception: whatever a code runner raises (the runner counts the sample as errored).
    """
    return GRADERS.get_or_raise(spec.kind)(spec, reply, example, run_code)


def _grade_number(spec: GraderSpec, reply: str, example: Example, run_code: CodeRunner | None) -> Grade:
    refs = _references(example)
    answer = extract_number_answer(reply, spec.style())
    ok = answer is not None and any(answers_match(answer, r) for r in refs)
    return Grade(ok, float(ok), answer)


def _grade_choice(spec: GraderSpec, reply: str, example: Example, run_code: CodeRunner | None) -> Grade:
    if example.choices is None:
        raise ValueError(f"example {example.id!r}: the choice grader needs options (map the 'options' field)")
    letter = parse_choice(reply, example.choices)
    ok = letter is not None and letter in _references(example)
    return Grade(ok, float(ok), letter)


def _grade_exact_match(spec: GraderSpec, reply: str, example: Example, run_code: CodeRunner | None) -> Grade:
    answer: str | None = reply.strip()
    if spec.answer_regex is not None:
        matches = list(re.finditer(spec.answer_regex, reply))
        last = matches[-1] if matches else None
        answer = None if last is None else (last.group(1) if last.re.groups else last.group(0)).strip()
    if answer is None:
        return Grade(False, 0.0, None)
    refs = _references(example)
    return Grade(best_exact_match(answer, refs), best_token_f1(answer, refs), answer)


def _grade_code(spec: GraderSpec, reply: str, example: Example, run_code: CodeRunner | None) -> Grade:
    runner = run_code or resolve_code_runner(spec.code_runner)
    program = extract_code(reply)
    if program is None:
        return Grade(False, 0.0, None)
    ok = bool(runner(program, example))
    return Grade(ok, float(ok), program)


for _kind, _grader in (
    ("number", _grade_number),
    ("math", _grade_number),
    ("choice", _grade_choice),
    ("exact_match", _grade_exact_match),
    ("code", _grade_code),
):
    register_grader(_kind, _grader)
