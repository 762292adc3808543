"""Examples of a benchmark: read through the field mapping, and rendered into chat prompts.

:func:`load_examples` reads a :class:`~prefect_tinker.recipes.evals.benchmarks.BenchmarkSpec`'s
source (or generates its sums) into :class:`Example` s: the question, the reference (for
``number``/``math`` graders the final answer inside the field: after ``####``, else the last
``\\boxed{}``; for ``choice`` the correct letter; several references when the field is a list),
the lettered options and every other mapped field. Bad records raise at once with
``file:line`` and the field: a benchmark never runs on a silently shortened set.

:func:`build_messages` turns an example into ``[system], few-shot turns..., user`` messages.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from prefect_tinker.recipes.data_reading import iter_records
from prefect_tinker.recipes.data_sources import RecordError, get_field
from prefect_tinker.recipes.evals.benchmarks import PLACEHOLDER, BenchmarkSpec, GeneratedSpec
from prefect_tinker.recipes.evals.choice import Choices, parse_options, resolve_reference_letter
from prefect_tinker.recipes.evals.example import Example
from prefect_tinker.recipes.evals.graders import reference_answer

__all__ = ["Example", "load_examples", "build_messages", "fill_template"]


def _arithmetic(spec: BenchmarkSpec, gen: GeneratedSpec) -> list[Example]:
    rng = np.random.default_rng(gen.seed)
    n = min(gen.num_examples, spec.limit or gen.num_examples)
    out = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(0, gen.max_operand + 1, size=2))
        q = f"What is {a} + {b}?"
        out.append(Example(f"arith-{i}", q, str(a + b), None, {"question": q, "answer": a + b}, f"generated:{i}"))
    return out


def _reference(spec: BenchmarkSpec, value: Any, choices: Choices | None, where: str) -> str | tuple[str, ...]:
    path = spec.fields.get("answer", "answer")
    values = value if isinstance(value, (list, tuple)) else [value]
    if not values:
        raise ValueError(f"{where}: field {path!r} is an empty list")
    refs = []
    for v in values:
        if spec.grader.kind == "choice":
            if choices is None:  # BenchmarkSpec requires fields.options for the choice grader
                raise ValueError(f"{where}: the choice grader needs the record's options")
            try:
                refs.append(resolve_reference_letter(v, choices, path))
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
            continue
        if not isinstance(v, (str, int, float)) or isinstance(v, bool) or not str(v).strip():
            raise ValueError(f"{where}: field {path!r} must be a non-empty string or number, got {str(v)[:60]!r}")
        refs.append(reference_answer(v) if spec.grader.kind in ("number", "math") else str(v).strip())
    return refs[0] if len(refs) == 1 and not isinstance(value, (list, tuple)) else tuple(refs)


def _from_record(spec: BenchmarkSpec, record: Any, index: int, where: str) -> Example:
    if not isinstance(record, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {str(record)[:60]!r}")
    values: dict[str, Any] = {}
    for name, path in spec.fields.items():
        try:
            values[name] = get_field(record, path)
        except RecordError as exc:
            raise ValueError(f"{where}: {exc}") from None
    question = values["question"]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(
            f"{where}: field {spec.fields['question']!r} must be a non-empty string, got {str(question)[:60]!r}"
        )
    choices = None
    if "options" in values:
        try:
            choices = parse_options(values["options"], spec.fields["options"])
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    reference: str | tuple[str, ...] = ""
    if "answer" in values:
        reference = _reference(spec, values["answer"], choices, where)
    ex_id = str(values["id"]) if "id" in values else str(index)
    return Example(ex_id, question.strip(), reference, choices, values, where)


def load_examples(spec: BenchmarkSpec) -> list[Example]:
    """The examples of ``spec`` in source order, at most ``spec.limit``.

    Raises:
        FileNotFoundError: a local source that does not exist.
        ValueError: malformed JSON, a missing or empty field, options that do not parse, a
            reference naming no option, duplicate ids, or no example at all; the message names
            ``file:line`` and the field.
    """
    if spec.generate is not None:
        return _arithmetic(spec, spec.generate)
    if spec.source is None:  # BenchmarkSpec holds exactly one of source and generate
        raise ValueError(f"benchmark {spec.name!r}: no source and nothing to generate")
    source = spec.source.model_copy(update={"max_records": spec.limit or spec.source.max_records})
    examples: list[Example] = []
    seen: dict[str, str] = {}
    for i, raw in enumerate(iter_records(source)):
        if raw.error is not None:
            raise ValueError(f"{raw.where}: {raw.error}")
        ex = _from_record(spec, raw.record, i, raw.where)
        if ex.id in seen:
            raise ValueError(
                f"{raw.where}: duplicate example id {ex.id!r} (also at {seen[ex.id]}); "
                f"field {spec.fields.get('id')!r} must be unique"
            )
        seen[ex.id] = raw.where
        examples.append(ex)
    if not examples:
        raise ValueError(f"benchmark {spec.name!r}: no examples in {source.path!r}")
    return examples


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


def fill_template(template: str, values: Mapping[str, Any], choices: Choices | None = None) -> str:
    """``template`` with ``{name}`` replaced by ``values[name]`` (non-strings as JSON),
    ``{options}`` / ``{letters}`` by the lettered options; ``{{``/``}}`` give literal braces.
    Dataset text is inserted as is (never re-read as a template).

    Raises:
        KeyError: a placeholder without a value.
    """

    def sub(m: Any) -> str:
        token = m.group(0)
        if token in ("{{", "}}"):
            return token[0]
        name = m.group(1)
        if name == "options" and choices is not None:
            return choices.render()
        if name == "letters" and choices is not None:
            return ", ".join(choices.letters)
        if name not in values:
            raise KeyError(f"question_template needs {{{name}}}, which this example lacks")
        return _text(values[name])

    return PLACEHOLDER.sub(sub, template)


def build_messages(spec: BenchmarkSpec, example: Example) -> list[dict[str, str]]:
    """The prompt conversation of ``example``: system message (when set), each few-shot example
    as a user turn (the template filled with its fields) and an assistant turn (its
    ``response``), then the example's user turn."""
    prompt = spec.prompt
    messages = [{"role": "system", "content": prompt.system}] if prompt.system else []
    for i, shot in enumerate(prompt.few_shot):
        opts = parse_options(shot["options"], f"few_shot[{i}].options") if "options" in shot else None
        messages.append({"role": "user", "content": fill_template(prompt.question_template, shot, opts)})
        messages.append({"role": "assistant", "content": shot["response"]})
    values = {**example.fields, "question": example.question}
    messages.append({"role": "user", "content": fill_template(prompt.question_template, values, example.choices)})
    return messages
