"""Answer extraction and grading: real GSM8K lines, math answer forms, the problem envs end to end
through a real tokenizer and renderer."""

from __future__ import annotations

import json
import re

import pytest

from prefect_tinker.recipes.rl.envs import EnvSpec, build_rl_dataset
from prefect_tinker.recipes.rl.envs.gsm8k import GSM8KEnv
from prefect_tinker.recipes.rl.envs.math import MathEnv
from prefect_tinker.recipes.rl.envs.problems import load_problems
from prefect_tinker.recipes.rl.grading import (
    answers_match,
    extract_boxed,
    extract_final_answer,
    extract_hash_answer,
    parse_number,
)
from prefect_tinker.recipes.rl.problem_env import Problem, ProblemGroupBuilder
from tests.data_files import data_file


def _gsm8k_lines(n: int) -> list[dict]:
    path = data_file("math/gsm8k_test.jsonl")
    with open(path, encoding="utf-8") as fh:
        return [json.loads(next(fh)) for _ in range(n)]


def _perturb(answer_text: str) -> str:
    """The answer with its final number changed (+1)."""
    head, _, final = answer_text.rpartition("####")
    value = parse_number(final)
    return f"{head}#### {value + 1}"


def test_gsm8k_reference_answers_grade_correct_and_perturbed_wrong():
    rows = _gsm8k_lines(60)
    env_cls = GSM8KEnv
    for row in rows:
        reference = extract_hash_answer(row["answer"])
        assert reference is not None and parse_number(reference) is not None, row["answer"]
        env = env_cls(Problem(row["question"], reference), renderer=None)
        assert env.check_format(row["answer"]) and env.check_answer(row["answer"]), row["answer"]
        wrong = _perturb(row["answer"])
        assert env.check_format(wrong) and not env.check_answer(wrong), wrong
        # the same number written other ways is still right
        assert env.check_answer(f"So the answer is \\boxed{{{reference}}}.")
        assert env.check_answer(f"...\n#### ${reference}")
        assert not env.check_answer("no final answer line " + reference)


def test_load_gsm8k_problems_with_references():
    path = data_file("math/gsm8k_test.jsonl")
    problems = load_problems(str(path), max_problems=5)
    assert len(problems) == 5
    assert problems[0].answer == "18" and problems[0].id.endswith("gsm8k_test.jsonl:1")
    assert "ducks" in problems[0].question


@pytest.mark.parametrize(
    "given, reference, ok",
    [
        ("1,234", "1234", True), ("$1,234.00", "1234", True), ("\\$18", "18", True), ("18 dollars", "18", True),
        ("5 \\text{ cm}", "5", True), ("50\\%", "50", True), ("0.75", "3/4", True), ("\\frac{3}{4}", "0.75", True),
        ("\\dfrac{3}{4}", "\\frac34", True), ("1 1/2", "3/2", True), ("-2.5", "-\\frac{5}{2}", True),
        ("90^\\circ", "90", True), ("x = 7", "7", True), ("7.", "7", True), ("1e3", "1000", True),
        ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", True), ("2\\pi", "6.283185307", True),
        ("12", "13", False), ("1,235", "1234", False), ("3/5", "3/4", False), ("", "1", False),
        ("\\frac{1}{2}", "\\frac{1}{3}", False), ("x7", "7", False), ("7 8", "7", False),
    ],
)
def test_answers_match(given, reference, ok):
    assert answers_match(given, reference) is ok


def test_extraction():
    text = "First \\boxed{1} then \\boxed{\\frac{a}{b^{2}}} done"
    assert extract_boxed(text) == "\\frac{a}{b^{2}}"
    assert extract_boxed("\\boxed{unclosed") is None and extract_boxed("none") is None
    assert extract_hash_answer("work\n#### 1,000 \n") == "1,000" and extract_hash_answer("####") is None
    assert extract_final_answer("\\boxed{3}\n#### 4", "any") == "4"
    assert extract_final_answer("\\boxed{3}\n#### 4", "boxed") == "3"
    with pytest.raises(ValueError, match="style"):
        extract_final_answer("x", "bad")


def test_math_env_on_own_field_names(tmp_path):
    """A JSONL of word problems with its own schema, graded through the real smollm2 renderer."""
    tok_dir = data_file("tokenizer/smollm2")
    rows = [
        {
            "id": 1,
            "problem": "A pie is cut into 8 slices and 6 are eaten. What fraction is left?",
            "meta": {"final": "\\frac{1}{4}"},
        },
        {
            "id": 2,
            "problem": "A shirt costs $1,200 after a 20% raise. What was the old price?",
            "meta": {"final": "$1,000"},
        },
        {"id": 3, "problem": "A square has area 2. What is its side?", "meta": {"final": "\\sqrt{2}"}},
    ]
    path = tmp_path / "word.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = EnvSpec(env="math", dataset=str(path),
                   env_options={"question_field": "problem", "answer_field": "meta.final"})
    ds = build_rl_dataset(spec, renderer_name="auto", tokenizer_id=str(tok_dir), group_size=2, groups_per_batch=3)
    builders = ds.get_batch(0)
    assert all(isinstance(b, ProblemGroupBuilder) for b in builders) and len(builders) == 3
    replies = {"1": "2/8 = \\boxed{0.25}", "2": "1200/1.2 = \\boxed{1000 \\text{ dollars}}", "3": "\\boxed{2^{1/2}}"}
    for b in builders:
        env = b.make_envs()[0]
        ob, stop = env.initial_observation()
        renderer = env.renderer
        assert "\\boxed{}" in renderer.tokenizer.decode(ob)
        pid = {r["problem"]: str(r["id"]) for r in rows}[b.problem.question]
        good = renderer.tokenizer.encode(replies[pid], add_special_tokens=False) + list(stop[:1])
        res = env.step(good)
        assert res.reward == 1.0 and res.metrics == {"correct": 1.0, "format": 1.0}, (pid, res)
        bad = renderer.tokenizer.encode("\\boxed{7}", add_special_tokens=False) + list(stop[:1])
        assert env.step(bad).reward == 0.0
        unformatted = renderer.tokenizer.encode("seven", add_special_tokens=False)  # no box, no stop
        assert env.step(unformatted).reward == pytest.approx(-0.1)
    assert isinstance(builders[0].make_envs()[0], MathEnv)


def test_problem_file_errors_name_file_line_and_field(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"q": "1+1?", "a": "2"}\n{"q": "2+2?"}\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2") + ".*'a'"):
        load_problems(str(path), question_field="q", answer_field="a")
    path.write_text('{"q": "1+1?", "a": "2"}\n{oops\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}:2") + ".*malformed JSON"):
        load_problems(str(path), question_field="q", answer_field="a")
    with pytest.raises(FileNotFoundError):
        load_problems(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="needs dataset"):
        build_rl_dataset(EnvSpec(env="math"), renderer_name="auto", tokenizer_id="x", group_size=2, groups_per_batch=1)
