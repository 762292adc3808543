"""A single-turn verifiers environment on local data (the tests' own, loaded from this file by path):
name a country's capital inside <answer> tags; rubric 1.0 x exact answer + 0.25 x reply length in
[0, 1] (a second reward function, so that the weighted sum is tested)."""

import verifiers as vf
from datasets import Dataset

ROWS = [
    ("France", "Paris"),
    ("Japan", "Tokyo"),
    ("Italy", "Rome"),
    ("Peru", "Lima"),
    ("Egypt", "Cairo"),
    ("Chile", "Santiago"),
    ("Kenya", "Nairobi"),
    ("Spain", "Madrid"),
]
PARSER = vf.XMLParser(fields=["answer"], answer_field="answer")


def exact_answer(completion, answer, **kwargs) -> float:
    return float((PARSER.parse_answer(completion) or "").strip() == answer)


def brevity(completion, **kwargs) -> float:
    text = completion[-1]["content"] if isinstance(completion[-1], dict) else completion[-1].content
    return max(0.0, 1.0 - len(text or "") / 100.0)


def load_environment(n: int = 8) -> vf.Environment:
    data = Dataset.from_list([{"question": f"What is the capital of {c}?", "answer": a} for c, a in ROWS[:n]])
    rubric = vf.Rubric(funcs=[exact_answer, brevity], weights=[1.0, 0.25], parser=PARSER)
    return vf.SingleTurnEnv(dataset=data, system_prompt="Reply as <answer>CITY</answer>.", parser=PARSER, rubric=rubric)
