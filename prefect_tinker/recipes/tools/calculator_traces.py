"""Tool-use transcripts from calculator-annotated solutions: the ``calculator_solution`` dataset
format, for an SFT warm-up before RL in the ``calculator`` environment.

GSM8K's reference solutions mark every arithmetic step as ``<<expression=result>>`` (Cobbe et al.
2021, "Training Verifiers to Solve Math Word Problems", https://arxiv.org/abs/2110.14168, §2: the
annotations drive a calculator at sampling time). A solution becomes the conversation the
environment would hold with a model that uses the tool on every step:

    system   CALCULATOR_SYSTEM (the environment's; ``options.system_prompt`` replaces it)
    user     the question
    assistant  the text before the first annotation, and a ``calculator`` call of its expression
    tool       the calculator's own result for it (:func:`~prefect_tinker.recipes.tools.calculator.calculator`)
    assistant  the text from that result to the next annotation, and its call ... (one turn per step)
    assistant  the rest of the solution, ending ``#### <answer>``

with the calculator's schema as the conversation's ``tools`` (what the environment declares), so
the rendered prompt equals the environment's. Record fields: ``question``, ``answer`` (the
annotated solution; names mapped by ``fields``). A solution without annotations gives a
conversation of one direct answer; an annotation the calculator refuses (units, ``x``) is a
:class:`~prefect_tinker.recipes.data_sources.RecordError` (skipped with ``on_error=skip``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from prefect_tinker.recipes.format_options import FormatOptions
from prefect_tinker.recipes.record_fields import Converted, RecordError, pick_text, top_key
from prefect_tinker.recipes.tools.calculator import CalculatorError, calculator, evaluate_expression, format_number

__all__ = ["CALCULATOR_SYSTEM", "calculator_solution", "calculator_transcript"]

CALCULATOR_SYSTEM = (
    "Solve the problem. Use the calculator tool for arithmetic. When you are done, reply "
    "without a tool call and give the final answer as a number on the last line, as '#### <number>'."
)

_ANNOTATION = re.compile(r"<<([^<>=]*)=([^<>]*)>>")
_FINAL = re.compile(r"####\s*\S+\s*$")


def calculator_transcript(question: str, solution: str, system: str | None = CALCULATOR_SYSTEM) -> list[dict]:
    """The tool-use conversation of one annotated solution (see the module docstring).

    Each annotation's result as written is dropped: the text after a call continues from the
    calculator's own result (``48/2`` -> ``24``), so every tool message is what the tool returns.

    Raises:
        ValueError: an annotation the calculator refuses (message names it), or a solution
            without a final ``#### <answer>`` line.
    """
    if not _FINAL.search(solution.strip()):
        raise ValueError("has no final '#### <answer>' line")
    messages: list[dict] = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": question}
    ]
    pos, lead = 0, ""
    for m in _ANNOTATION.finditer(solution):
        expression = m.group(1).strip()
        try:
            result = format_number(evaluate_expression(expression))
        except CalculatorError as exc:
            raise ValueError(f"annotation <<{m.group(1)}={m.group(2)}>>: {exc}") from None
        call = {"type": "function", "function": {"name": calculator.name, "arguments": {"expression": expression}}}
        messages.append(
            {"role": "assistant", "content": (lead + solution[pos : m.start()]).strip(), "tool_calls": [call]}
        )
        messages.append({"role": "tool", "content": result, "name": calculator.name})
        written = m.group(2).strip()  # the result as the solution writes it after the annotation
        pos = m.end() + (len(written) if written and solution.startswith(written, m.end()) else 0)
        lead = result  # the next turn goes on from the tool's result
    messages.append({"role": "assistant", "content": (lead + solution[pos:]).strip()})
    return messages


def calculator_solution(record: Any, fields: Mapping[str, str], options: FormatOptions) -> list[Converted]:
    """The ``calculator_solution`` dataset format: ``question`` and a ``<<expr=result>>`` annotated
    ``answer``/``solution`` as one :func:`calculator_transcript` (tools in the metadata).

    Raises:
        RecordError: a missing or empty field, or an annotation the calculator cannot check.
    """
    qpath, question = pick_text(record, fields, "question", ("question",))
    apath, solution = pick_text(record, fields, "answer", ("answer", "solution"))
    if not isinstance(question, str) or not question.strip():
        raise RecordError(qpath, "is empty: no question")
    if not isinstance(solution, str):
        raise RecordError(apath, f"must be a string (an annotated solution), got {type(solution).__name__}")
    try:
        messages = calculator_transcript(question, solution, options.system_prompt or CALCULATOR_SYSTEM)
    except ValueError as exc:
        raise RecordError(apath, str(exc)) from None
    return [
        Converted(
            messages, f"{qpath}+{apath}", frozenset({top_key(qpath), top_key(apath)}), {"tools": [calculator.schema]}
        )
    ]
