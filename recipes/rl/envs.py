"""The RL recipes' environments: ``arithmetic`` (generated sums), ``gsm8k`` and generic ``math``.

- ``arithmetic``: "What is a + b?" with operands drawn from ``[0, max_operand]`` by a generator
  seeded with (seed, batch index): unbounded, no files, the fast default. The reply must be just
  the integer.
- ``gsm8k``: grade-school word problems from a JSONL file (``question``/``answer`` fields, the
  answer's last line ``#### n``) or a Hugging Face id (``openai/gsm8k``, config ``main``); the
  reference is the number after ``####``; the reply must end with a ``#### n`` line (a
  ``\\boxed{n}`` is accepted too) and is graded numerically.
- ``math``: any JSONL (or dataset) of problems, with ``question_field``/``answer_field`` naming
  the columns (dotted paths allowed); references may be plain (``3/4``, ``\\frac{\\pi}{2}``) or
  contain ``\\boxed{}`` / ``####``; replies are graded on their last ``\\boxed{}`` (style
  ``boxed``), ``####`` (``hash``) or either (``any``) with :func:`prefect_tinker.recipes.rl.grading.answers_match`.

:func:`build_rl_dataset` turns an :class:`EnvSpec` into an :class:`~prefect_tinker.recipes.rl.types.RLDataset`.
"""

from __future__ import annotations

import json
import re
from functools import partial
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field, field_validator

from prefect_tinker.recipes.data_reading import check_local_source
from prefect_tinker.recipes.rl.grading import answers_match, extract_boxed, extract_final_answer, extract_hash_answer
from prefect_tinker.recipes.rl.problem_env import Problem, ProblemDataset, ProblemEnv, ProblemGroupBuilder, freeze_messages
from prefect_tinker.recipes.rl.types import EnvGroupBuilder, RLDataset

__all__ = [
    "ENV_NAMES",
    "EnvSpec",
    "ArithmeticEnv",
    "GSM8KEnv",
    "MathEnv",
    "ArithmeticDataset",
    "arithmetic_problem",
    "load_problems",
    "build_rl_dataset",
    "write_arithmetic_sft_jsonl",
]

ENV_NAMES = ("arithmetic", "gsm8k", "math")
GSM8K_SUFFIX = " Solve it step by step, then give the final answer as a number on the last line, as '#### <number>'."
MATH_SUFFIX = " Write the final answer inside \\boxed{}."


class ArithmeticEnv(ProblemEnv):
    """Reply must be one integer (spaces around it allowed); correct when it equals the sum."""

    def check_format(self, response: str) -> bool:
        return re.fullmatch(r"\s*-?\d+\s*", response) is not None

    def check_answer(self, response: str) -> bool:
        m = re.fullmatch(r"\s*(-?\d+)\s*", response)
        return m is not None and int(m.group(1)) == int(self.problem.answer)


class GSM8KEnv(ProblemEnv):
    """Reply must contain a final ``#### n`` (or ``\\boxed{n}``); graded numerically against the
    reference number (commas, ``$`` and units tolerated)."""

    def check_format(self, response: str) -> bool:
        return extract_final_answer(response, "any") is not None

    def check_answer(self, response: str) -> bool:
        return answers_match(extract_final_answer(response, "any"), self.problem.answer)


class MathEnv(ProblemEnv):
    """Reply graded on its last ``\\boxed{}`` (class attribute ``answer_style``: boxed/hash/any)."""

    answer_style = "boxed"

    def check_format(self, response: str) -> bool:
        return extract_final_answer(response, self.answer_style) is not None

    def check_answer(self, response: str) -> bool:
        return answers_match(extract_final_answer(response, self.answer_style), self.problem.answer)


class MathEnvHash(MathEnv):
    answer_style = "hash"


class MathEnvAny(MathEnv):
    answer_style = "any"


_MATH_ENVS = {"boxed": MathEnv, "hash": MathEnvHash, "any": MathEnvAny}


class EnvSpec(BaseModel):
    """Which environment and problems an RL run trains on (fields of the RL flow config)."""

    env: Literal["arithmetic", "gsm8k", "math"] = Field(default="arithmetic", description="Environment: arithmetic, gsm8k or math.")
    dataset: str | None = Field(default=None, description="gsm8k/math: JSONL path or Hugging Face dataset id (gsm8k default: openai/gsm8k).")
    dataset_config: str | None = Field(default=None, description="Hugging Face dataset configuration (gsm8k default: main).")
    split: str = Field(default="train", description="Split of a Hugging Face dataset.")
    question_field: str = Field(default="question", description="math: record field holding the problem text.")
    answer_field: str = Field(default="answer", description="math: record field holding the reference answer.")
    answer_style: Literal["boxed", "hash", "any"] = Field(default="boxed", description="math: where replies state the answer.")
    max_problems: int | None = Field(default=None, ge=1, description="Use at most this many problems.")
    max_operand: int = Field(default=20, ge=1, description="arithmetic: operands are drawn from [0, max_operand].")
    few_shot: bool = Field(default=False, description="Prepend one solved example as a user/assistant turn.")
    system_prompt: str | None = Field(default=None, description="Optional system message.")
    format_coef: float = Field(default=0.1, ge=0, description="Reward penalty for a malformed reply.")

    _dataset_exists = field_validator("dataset")(check_local_source)  # a missing file fails here


def arithmetic_problem(rng: np.random.Generator, max_operand: int, id_prefix: str = "") -> Problem:
    """One sum ``a + b`` with ``a, b`` uniform in ``[0, max_operand]``."""
    a, b = (int(x) for x in rng.integers(0, max_operand + 1, size=2))
    return Problem(question=f"What is {a} + {b}?", answer=str(a + b), id=f"{id_prefix}{a}+{b}")


class ArithmeticDataset(RLDataset):
    """Unbounded generated sums: batch ``i`` draws its problems from ``default_rng([seed, i])``."""

    def __init__(self, groups_per_batch: int, make_builder, max_operand: int = 20, seed: int = 0):
        self.groups_per_batch = groups_per_batch
        self.make_builder = make_builder
        self.max_operand = max_operand
        self.seed = seed

    def get_batch(self, index: int) -> list[EnvGroupBuilder]:
        rng = np.random.default_rng([self.seed, index])
        return [
            self.make_builder(arithmetic_problem(rng, self.max_operand, f"b{index}-"))
            for _ in range(self.groups_per_batch)
        ]


def _reference(raw: str) -> str:
    """The final answer inside a reference field: after ``####``, else the last ``\\boxed{}``, else the field."""
    return extract_hash_answer(raw) or extract_boxed(raw) or raw.strip()


def load_problems(
    source: str, *, question_field: str = "question", answer_field: str = "answer", split: str = "train",
    config_name: str | None = None, max_problems: int | None = None,
) -> list[Problem]:
    """Problems from a JSONL file (optionally gzipped) or a Hugging Face dataset.

    ``question_field``/``answer_field`` are record paths (``meta.answer``, ``choices[0]``); the
    reference answer is extracted from the answer field (``#### n``, ``\\boxed{}``, else as is).

    Raises:
        FileNotFoundError: a path-like source that does not exist.
        ValueError: a malformed line or a missing/empty field; the message names ``file:line``
            and the field.
    """
    from prefect_tinker.recipes.data_reading import SourceSpec, iter_records
    from prefect_tinker.recipes.data_sources import RecordError, get_field

    spec = SourceSpec(path=source, split=split, config_name=config_name, max_records=max_problems)
    problems = []
    for raw in iter_records(spec):
        if raw.error:
            raise ValueError(f"{raw.where}: {raw.error}")
        try:
            question, answer = get_field(raw.record, question_field), get_field(raw.record, answer_field)
        except RecordError as exc:
            raise ValueError(f"{raw.where}: {exc}") from None
        if isinstance(answer, (int, float)) and not isinstance(answer, bool):
            answer = str(answer)
        for name, value in ((question_field, question), (answer_field, answer)):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{raw.where}: field {name!r} must be a non-empty string, got {value!r:.60}")
        problems.append(Problem(question=question.strip(), answer=_reference(answer), id=raw.where))
    if not problems:
        raise ValueError(f"no problems in {source!r}")
    return problems


def build_rl_dataset(spec: EnvSpec, *, renderer_name: str, tokenizer_id: str, group_size: int,
                     groups_per_batch: int, seed: int = 0) -> RLDataset:
    """The training :class:`RLDataset` of ``spec`` (groups of ``group_size`` envs,
    ``groups_per_batch`` groups per batch).

    Raises:
        ValueError / FileNotFoundError: from :func:`load_problems`; ``math`` without ``dataset``.
    """
    prefix: list[dict] = []
    if spec.system_prompt:
        prefix.append({"role": "system", "content": spec.system_prompt})
    if spec.env == "arithmetic":
        env_cls, suffix = ArithmeticEnv, ""
        shot = [{"role": "user", "content": "What is 4 + 5?"}, {"role": "assistant", "content": "9"}]
    elif spec.env == "gsm8k":
        env_cls, suffix = GSM8KEnv, GSM8K_SUFFIX
        shot = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many apples does he have?" + suffix},
                {"role": "assistant", "content": "He has 3 + 4 = 7 apples.\n#### 7"}]
    else:
        env_cls, suffix = _MATH_ENVS[spec.answer_style], MATH_SUFFIX if spec.answer_style == "boxed" else GSM8K_SUFFIX
        shot = [{"role": "user", "content": "What is 1/2 + 1/4?" + suffix},
                {"role": "assistant", "content": "1/2 + 1/4 = 3/4, so the answer is \\boxed{\\frac{3}{4}}.\n#### 3/4"}]
    if spec.few_shot:
        prefix += shot
    make_builder = partial(
        ProblemGroupBuilder, env_cls, group_size=group_size, renderer_name=renderer_name, tokenizer_id=tokenizer_id,
        format_coef=spec.format_coef, convo_prefix=freeze_messages(prefix), question_suffix=suffix, tags=(spec.env,),
    )
    if spec.env == "arithmetic":
        return ArithmeticDataset(groups_per_batch, make_builder, spec.max_operand, seed)
    if spec.env == "math" and not spec.dataset:
        raise ValueError("env 'math' needs dataset=<JSONL path or dataset id> (and question_field/answer_field)")
    source = spec.dataset or "openai/gsm8k"
    config = spec.dataset_config or ("main" if source == "openai/gsm8k" else None)
    fields = ("question", "answer") if spec.env == "gsm8k" else (spec.question_field, spec.answer_field)
    problems = load_problems(source, question_field=fields[0], answer_field=fields[1], split=spec.split,
                             config_name=config, max_problems=spec.max_problems)
    return ProblemDataset(problems, groups_per_batch, make_builder, seed)


def write_arithmetic_sft_jsonl(path: str | Path, n: int, *, max_operand: int = 20, seed: int = 0) -> Path:
    """Write ``n`` solved sums as chat JSONL (``{"messages": [user, assistant]}``) for an SFT warm-up
    in the same format the ``arithmetic`` env prompts with. Returns the path."""
    rng = np.random.default_rng([seed, 10**6])
    path = Path(path)
    with path.open("w", encoding="utf-8") as fh:
        for _ in range(n):
            p = arithmetic_problem(rng, max_operand)
            msgs = [{"role": "user", "content": p.question}, {"role": "assistant", "content": p.answer}]
            fh.write(json.dumps({"messages": msgs}) + "\n")
    return path
