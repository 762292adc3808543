"""HumanEval-style checking in the sandbox: real HumanEval problems, canonical and wrong solutions."""

from __future__ import annotations

import gzip
import json
import os

import pytest

from prefect_tinker.recipes.sandbox import last_code_block, load_code_problems, run_tests, sandbox_problem
from tests.data_files import data_file

# spread over the set: string, list, math and parsing problems
TASKS = ["HumanEval/0", "HumanEval/10", "HumanEval/32", "HumanEval/53", "HumanEval/101", "HumanEval/163"]


@pytest.fixture(scope="module")
def problems():
    problem = sandbox_problem()
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"the code sandbox must work in CI: {problem}")
        pytest.skip(f"the code sandbox cannot run here: {problem}")
    by_id = {p["task_id"]: p for p in load_code_problems(data_file("code/humaneval.jsonl.gz"))}
    return [by_id[t] for t in TASKS]


def test_load_code_problems_reads_humaneval():
    path = data_file("code/humaneval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        raw = [json.loads(line) for line in f]
    loaded = load_code_problems(path)
    assert len(loaded) == len(raw) == 164
    assert [p["task_id"] for p in loaded] == [r["task_id"] for r in raw]
    assert all(
        p["tests"] == r["test"] and p["entry_point"] == r["entry_point"] for p, r in zip(loaded, raw, strict=True)
    )


def test_canonical_solutions_pass(problems):
    for p in problems:
        r = run_tests(p["prompt"] + p["canonical_solution"], p["tests"], p["entry_point"], timeout=10)
        assert r.passed, (p["task_id"], r.detail, r.sandbox.stderr[-500:])
        assert r.detail == "" and r.sandbox.exit_code == 0


def test_wrong_solutions_fail_in_check(problems):
    for p in problems:
        wrong = p["prompt"] + "    return None\n"
        r = run_tests(wrong, p["tests"], p["entry_point"], timeout=10)
        assert not r.passed, p["task_id"]
        # an assertion of check(), or a TypeError where check() computes with the returned None
        assert r.sandbox.reason == "error", (p["task_id"], r.detail)
        assert "AssertionError" in r.detail or "TypeError" in r.detail, (p["task_id"], r.detail)
        assert 'File "tests.py"' in r.sandbox.stderr  # the failing line of the tests is shown


def test_cheating_solutions_do_not_pass(problems):
    p = problems[0]
    early_exit = p["prompt"] + p["canonical_solution"] + "\nimport os\nos._exit(0)\n"
    r = run_tests(early_exit, p["tests"], p["entry_point"])
    assert not r.passed and r.sandbox.exit_code == 0 and "exited before check() returned" in r.detail
    own_check = p["prompt"] + "    return None\n\ndef check(candidate):\n    pass\n"
    r = run_tests(own_check, p["tests"], p["entry_point"])  # the tests' check() replaces the solution's
    assert not r.passed and "AssertionError" in r.detail
    missing = "def something_else():\n    return 1\n"
    r = run_tests(missing, p["tests"], p["entry_point"])
    assert not r.passed and "does not define" in r.detail


def test_slow_solution_times_out(problems):
    p = problems[1]
    slow = p["prompt"] + "    while True:\n        pass\n"
    r = run_tests(slow, p["tests"], p["entry_point"], timeout=1.5)
    assert not r.passed and r.sandbox.reason in ("cpu_limit", "wall_timeout") and r.sandbox.killed


def test_prints_of_the_solution_are_kept_without_the_token(problems):
    p = problems[2]
    r = run_tests("print('debug line')\n" + p["prompt"] + p["canonical_solution"], p["tests"], p["entry_point"])
    assert r.passed and r.sandbox.stdout == "debug line\n"


def test_bad_entry_point_is_refused():
    with pytest.raises(ValueError, match="identifier"):
        run_tests("x = 1", "def check(c): pass", "not valid!")


def test_last_code_block():
    text = "First:\n```python\ndef a():\n    return 1\n```\nthen\n```\nprint(2)\n```\nand ```py\nunclosed"
    assert last_code_block(text) == "print(2)\n"
    assert last_code_block("```python3 title\nx = 1\n```") == "x = 1\n"
    assert last_code_block("no fences here") is None
    assert last_code_block("") is None


def test_load_code_problems_names_bad_lines(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "p", "tests": "t", "entry_point": "f"}\n\n{"prompt": "p", "entry_point": "f"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: field 'tests'"):
        load_code_problems(path)
    path.write_text('{"prompt": "p", "tests": "t", "entry_point": "f x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: field 'entry_point'"):
        load_code_problems(path)
    path.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: not JSON"):
        load_code_problems(path)
    path.write_text('{"prompt": "p", "tests": "t", "entry_point": "f"}\n')
    assert load_code_problems(path) == [{"task_id": "bad.jsonl:1", "prompt": "p", "tests": "t", "entry_point": "f",
                                         "canonical_solution": None}]
