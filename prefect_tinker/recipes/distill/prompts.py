"""Prompt records and the teacher's view of them.

A :class:`PromptRecord` is one prompt the student answers: the conversation before the reply
(ending with a user message) and, when the record has one, the golden answer (its last assistant
message). :func:`load_prompts` reads them from any source the data readers know, in any record
format (``messages``, ``prompt_completion``, ``instruction``, ... and ``prompt``: one text field,
for raw inputs such as the sentences of a classification task).

A :class:`TeacherView` says what the teacher is shown instead of the student's prompt:

- ``system_prompt``: a system message the student never sees (prompt / context distillation);
- ``prompt_template``: the last user message rewritten, ``{prompt}`` standing for its text and
  ``{answer}`` for the golden answer (SDFT's demonstration, Shenfeld et al. 2026,
  "Self-Distillation Enables Continual Learning", arXiv:2601.19897). Other braces are literal, and
  the inserted texts are never read as templates (a ``{answer}`` inside a question stays text).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field, field_validator

from prefect_tinker.recipes.data_reading import OnError, SkipStats, SourceSpec, iter_conversations
from prefect_tinker.recipes.data_sources import DatasetFormatError, register_converter
from prefect_tinker.recipes.format_options import FormatOptions
from prefect_tinker.recipes.record_fields import Converted, pick_text, top_key, with_system

__all__ = ["DEMO_TEMPLATE", "PromptRecord", "TeacherView", "freeze", "load_prompts", "thaw"]

#: SDFT's default teacher prompt: the question, one demonstration, then the request for an own answer.
DEMO_TEMPLATE = (
    "{prompt}\n\nThis is an example for a response to the question:\n{answer}\n\n"
    "Now answer with a response of your own."
)

_SLOT = re.compile(r"\{(prompt|answer)\}")

Frozen = tuple[tuple[tuple[str, str], ...], ...]


def freeze(messages: Sequence[Mapping[str, Any]]) -> Frozen:
    """Messages as nested tuples of ``(key, text)`` pairs (hashable, stable ``repr``)."""
    return tuple(tuple(sorted((str(k), str(v)) for k, v in m.items() if v is not None)) for m in messages)


def thaw(frozen: Frozen) -> list[dict[str, str]]:
    """The messages of :func:`freeze` as dicts again."""
    return [dict(m) for m in frozen]


@dataclass(frozen=True)
class PromptRecord:
    """One prompt: ``messages`` (frozen, see :func:`freeze`; the last one is a user message),
    ``answer`` (the golden reply's text, or None), ``id`` (``file:line``) and ``source`` (index of
    the (dataset, teacher) pair it came from)."""

    messages: Frozen
    answer: str | None = None
    id: str = ""
    source: int = 0

    def message_list(self) -> list[dict[str, str]]:
        return thaw(self.messages)


def _prompt_only(record: Any, fields: Mapping[str, str], options: FormatOptions) -> list[Converted]:
    """Converter ``prompt``: one text field (``prompt``, ``text``, ``input`` or ``question``) as the
    user message; an ``answer`` (``answer``, ``completion``, ``response``, ``output``) when present."""
    ppath, prompt = pick_text(record, fields, "prompt", ("prompt", "text", "input", "question"))
    apath, answer = pick_text(record, fields, "answer", ("answer", "completion", "response", "output"), required=False)
    msgs = [{"role": "user", "content": prompt}]
    if answer is not None:
        msgs.append({"role": "assistant", "content": answer})
    used = frozenset(top_key(p) for p in (ppath, apath) if p)
    return [Converted(with_system(msgs, options.system_prompt), ppath or "prompt", used)]


register_converter("prompt", _prompt_only)


def load_prompts(
    spec: SourceSpec, *, source: int = 0, on_error: OnError = "raise", stats: SkipStats | None = None
) -> list[PromptRecord]:
    """The prompt records of one source, in record order.

    A conversation ending with an assistant message gives the messages before it as the prompt
    and its text as the golden answer; one ending with a user message is a prompt without answer.

    Raises:
        DatasetFormatError: a record that is malformed, or whose prompt does not end with a user
            message (the message names ``file:line``); an empty source.
        FileNotFoundError: a missing local file.
    """
    stats = stats if stats is not None else SkipStats()
    out: list[PromptRecord] = []
    for conv in iter_conversations(spec, on_error=on_error, stats=stats, require_assistant=False):
        msgs, answer = list(conv.messages), None
        if msgs[-1]["role"] == "assistant":
            answer = str(msgs.pop()["content"])
        if not msgs or msgs[-1]["role"] != "user":
            message = f"{conv.source}: field {conv.field!r}: a prompt must end with a user message"
            if on_error == "raise":
                raise DatasetFormatError(message)
            stats.skip("bad_record", message)
            continue
        kept: list[dict[str, Any]] = [{k: m[k] for k in ("role", "content") if k in m} for m in msgs]
        out.append(PromptRecord(freeze(kept), answer, conv.source, source))
    if not out:
        raise DatasetFormatError(f"{spec.path}: no prompts ({stats.summary()})")
    return out


class TeacherView(BaseModel):
    """What the teacher is shown in place of the student's prompt (see the module docstring)."""

    system_prompt: str | None = Field(
        default=None, description="A system message only the teacher sees (prompt distillation)."
    )
    prompt_template: str | None = Field(
        default=None,
        description="The teacher's last user message: {prompt} = the student's, {answer} = the golden answer (SDFT).",
    )

    @field_validator("prompt_template")
    @classmethod
    def _has_prompt(cls, v: str | None) -> str | None:
        if v is not None and "{prompt}" not in v:
            raise ValueError("prompt_template must contain {prompt} (where the student's message goes)")
        return v

    @property
    def is_identity(self) -> bool:
        """True when the teacher sees exactly the student's prompt."""
        return not self.system_prompt and not self.prompt_template

    @property
    def needs_answer(self) -> bool:
        return bool(self.prompt_template and "{answer}" in self.prompt_template)

    def messages(self, record: PromptRecord) -> list[dict[str, str]]:
        """The teacher's prompt messages for ``record``.

        Raises:
            ValueError: the template uses ``{answer}`` and the record has none (names the record).
        """
        msgs = record.message_list()
        if self.prompt_template:
            if self.needs_answer and record.answer is None:
                raise ValueError(
                    f"{record.id}: prompt_template uses {{answer}} but the record has no answer "
                    "(its last message must be the assistant's golden reply)"
                )
            values = {"prompt": msgs[-1]["content"], "answer": record.answer or ""}
            msgs[-1] = {"role": "user", "content": _SLOT.sub(lambda m: values[m.group(1)], self.prompt_template)}
        if self.system_prompt:
            if msgs[0]["role"] == "system":
                msgs[0] = {"role": "system", "content": self.system_prompt + "\n\n" + msgs[0]["content"]}
            else:
                msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs
