"""Check a code solution against HumanEval-style tests in the sandbox.

A problem is ``{prompt, tests, entry_point}``: ``tests`` defines ``check(candidate)`` (asserts), and
the solution passes when ``check(<entry_point>)`` returns.  HumanEval
(https://github.com/openai/human-eval, ``data/HumanEval.jsonl.gz``) names the tests ``test``;
:func:`load_code_problems` accepts both.  The execution follows human-eval's ``check_correctness``
(solution, then tests, then ``check(entry_point)`` in one namespace), inside
:func:`prefect_tinker.recipes.sandbox.run_python` instead of a forked interpreter.
"""

from __future__ import annotations

import gzip
import json
import re
import secrets
from pathlib import Path

from pydantic import BaseModel

from prefect_tinker.recipes.sandbox.config import SandboxConfig, SandboxResult
from prefect_tinker.recipes.sandbox.core import run_python

__all__ = ["CodeTestResult", "last_code_block", "load_code_problems", "run_tests"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)```", re.DOTALL)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# The runner reads a one-time token from stdin before the solution runs and prints it only after
# check() returned, so a solution that exits early (sys.exit(0), os._exit(0)) or redefines
# check() does not pass.
_RUNNER = """\
import sys


def _main(entry_point):
    token = sys.stdin.readline().strip()
    namespace = {"__name__": "solution", "__builtins__": __builtins__}
    with open("solution.py", encoding="utf-8") as f:
        exec(compile(f.read(), "solution.py", "exec"), namespace)
    with open("tests.py", encoding="utf-8") as f:
        exec(compile(f.read(), "tests.py", "exec"), namespace)
    if entry_point not in namespace:
        raise NameError("the solution does not define %r" % entry_point)
    namespace["check"](namespace[entry_point])
    sys.stdout.write("\\n" + token + "\\n")
    sys.stdout.flush()


_main(sys.argv[1])
"""


class CodeTestResult(BaseModel):
    """Outcome of :func:`run_tests`.

    Attributes:
        passed: ``check(entry_point)`` returned and the program then exited with status 0.
        detail: why it did not pass (the failing assertion's line, a limit, an early exit), or "".
        sandbox: the execution (stdout without the runner's token line).
    """

    passed: bool
    detail: str
    sandbox: SandboxResult


def run_tests(
    code: str, tests: str, entry_point: str, timeout: float = 10.0, config: SandboxConfig | None = None
) -> CodeTestResult:
    """Run ``code`` then ``tests`` then ``check(entry_point)`` in a fresh sandbox.

    Args:
        code: the full solution source (for HumanEval: ``prompt + completion``), untrusted.
        tests: source that defines ``check(candidate)``.
        entry_point: name of the function under test (a Python identifier).
        timeout: wall-time limit in seconds (also the CPU limit unless ``config`` sets ``cpu_s``).
        config: other limits; its ``timeout_s`` is replaced by ``timeout``.

    Raises:
        ValueError: ``entry_point`` is not an identifier.
        SandboxUnavailable: the sandbox cannot run here.
    """
    if not _IDENT.match(entry_point or ""):
        raise ValueError(f"entry_point must be a Python identifier, got {entry_point!r}")
    config = (config or SandboxConfig()).model_copy(update={"timeout_s": float(timeout)})
    token = secrets.token_hex(16)
    result = run_python(
        _RUNNER, files={"solution.py": code, "tests.py": tests}, args=[entry_point], stdin=token + "\n", config=config
    )
    marker = "\n" + token + "\n"
    completed = marker in result.stdout
    stdout = result.stdout.replace(marker, "", 1) if completed else result.stdout
    passed = completed and result.passed
    if passed:
        detail = ""
    elif result.reason != "ok":
        detail = f"{result.reason}: {result.detail}"
    else:
        detail = "the program exited before check() returned"
    return CodeTestResult(passed=passed, detail=detail, sandbox=result.model_copy(update={"stdout": stdout}))


def last_code_block(text: str) -> str | None:
    """The body of the last closed Markdown code fence (```` ```python ... ``` ````) in ``text``, or None."""
    blocks = _FENCE.findall(text or "")
    return blocks[-1][1] if blocks else None


def load_code_problems(path: str | Path) -> list[dict]:
    """Read code problems from JSONL (``.jsonl`` or ``.jsonl.gz``).

    Each record needs ``prompt`` (str), ``tests`` or HumanEval's ``test`` (str, defines
    ``check(candidate)``) and ``entry_point`` (identifier); ``task_id`` and ``canonical_solution`` are
    kept when present.

    Returns:
        One dict per record: ``{"task_id", "prompt", "tests", "entry_point", "canonical_solution"}``
        (``task_id`` defaults to ``"<file>:<line>"``, ``canonical_solution`` to None).

    Raises:
        ValueError: a line is not JSON or lacks a field (the message names file, line and field).
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    problems = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            tests = rec.get("tests", rec.get("test")) if isinstance(rec, dict) else None
            for field, value in (("prompt", rec.get("prompt") if isinstance(rec, dict) else None), ("tests", tests)):
                if not isinstance(value, str):
                    raise ValueError(f"{path}:{lineno}: field {field!r} must be a string, got {value!r:.60}")
            entry = rec.get("entry_point")
            if not isinstance(entry, str) or not _IDENT.match(entry):
                raise ValueError(f"{path}:{lineno}: field 'entry_point' must be an identifier, got {entry!r:.60}")
            problems.append(
                {
                    "task_id": str(rec.get("task_id", f"{path.name}:{lineno}")),
                    "prompt": rec["prompt"],
                    "tests": tests,
                    "entry_point": entry,
                    "canonical_solution": rec.get("canonical_solution"),
                }
            )
    return problems
