"""Sandboxed execution of untrusted Python (model-written code and its tests).

:func:`run_python` runs a program in a fresh bubblewrap sandbox (no network, read-only system,
an empty tmpfs as the only writable place, rlimits, empty environment, own PID namespace) and
returns a :class:`SandboxResult`; :func:`run_tests` checks a solution against HumanEval-style tests.
See :mod:`.isolation` for the mechanism, :mod:`.core` for the execution and :mod:`.config` for the
limits, and the README section "Code sandbox" for what it protects against.
"""

from prefect_tinker.recipes.sandbox.code_tests import last_code_block, load_code_problems, run_tests
from prefect_tinker.recipes.sandbox.config import SANDBOX_DIR, SandboxConfig, SandboxResult, SandboxUnavailable
from prefect_tinker.recipes.sandbox.core import run_python, sandbox_problem

__all__ = [
    "SANDBOX_DIR",
    "SandboxConfig",
    "SandboxResult",
    "SandboxUnavailable",
    "last_code_block",
    "load_code_problems",
    "run_python",
    "run_tests",
    "sandbox_problem",
]
