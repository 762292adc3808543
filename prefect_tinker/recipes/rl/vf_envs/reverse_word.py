"""A single-turn ``verifiers`` environment on generated data: write a short word backwards inside
``<answer>...</answer>``. Rubric: 1.0 x ``exact_answer`` (the ``XMLParser``'s parsed answer equals the
reversed word) + 0.2 x ``tagged`` (the reply has an ``<answer>...</answer>`` pair)."""

from __future__ import annotations

import random

import verifiers as vf
from datasets import Dataset

WORDS = (
    "cat dog sun map cup pen box hat red top bus car egg fig jam key log net owl pig "
    "rat sky toy van web yak zip ant bat cow den elf fox gum hen ink jet kit lip mud"
).split()


def load_environment(num_examples: int = 200, seed: int = 0) -> vf.Environment:
    """``num_examples`` words drawn with ``seed`` (the train split) and 40 more (the eval split)."""
    rng = random.Random(seed)
    parser = vf.XMLParser(fields=["answer"], answer_field="answer")

    def rows(n: int) -> Dataset:
        words = [rng.choice(WORDS) for _ in range(n)]
        return Dataset.from_list([{"question": f"Write the word '{w}' backwards.", "answer": w[::-1]} for w in words])

    def exact_answer(completion, answer, **kwargs) -> float:
        return float((parser.parse_answer(completion) or "").strip().lower() == answer)

    def tagged(completion, **kwargs) -> float:
        return float(parser.parse_answer(completion) is not None)

    rubric = vf.Rubric(funcs=[exact_answer, tagged], weights=[1.0, 0.2], parser=parser)
    return vf.SingleTurnEnv(
        dataset=rows(num_examples),
        eval_dataset=rows(40),
        system_prompt=f"Answer in this format: {parser.get_format_str()}",
        parser=parser,
        rubric=rubric,
    )
