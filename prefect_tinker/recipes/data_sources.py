"""Converters from the record formats users bring to chat conversations.

A converter turns one record (a JSON object / dataset row) into one or more message lists.  Each
reads named *fields*; a field mapping renames them (``{"output": "response"}``) and may reach into
nested values with a path (``"instances[0].output"`` or ``"instances.0.output"``).

============================  ===========================================  =====================================
format                        fields (default names; first present wins)   messages
============================  ===========================================  =====================================
``messages``                  ``messages`` (+ ``role``, ``content`` keys)   as given (``role_map`` renames roles)
``sharegpt``                  ``conversations`` with ``from``/``value``     ``human``/``gpt`` -> user/assistant
``instruction`` (``alpaca``,  ``instruction``, ``input``|``context``,       user: instruction [+ "\\n\\n" + input];
``dolly``)                    ``output``|``response``, ``system``           assistant: output
``prompt_completion``         ``prompt``, ``completion``|``response``|       user: prompt; assistant: completion
                              ``answer``, ``system``
``dialogue`` (``hh``)         ``text``                                      ``\\n\\nHuman: ...\\n\\nAssistant: ...``
                                                                            turns (content stripped)
``self_instruct``             ``instruction``, ``instances``                one conversation per instance
``preference``                ``prompt`` (optional), ``chosen``,            prompt + the chosen reply (comparisons:
                              ``rejected``                                  :func:`pairs_from_record`)
``calculator_solution``       ``question``, ``answer``|``solution``         GSM8K ``<<expr=result>>`` steps as
                              (``<<expr=result>>`` annotated)               calculator tool calls (tools in metadata;
                                                                            :mod:`~prefect_tinker.recipes.tools.calculator_traces`)
============================  ===========================================  =====================================

Options (``options=``), typed per format (:class:`~prefect_tinker.recipes.format_fields.FormatFields`; unknown keys):
``system_prompt`` (every format: a system message put first when the record has none),
``include_truncated`` (every format, for capture sources), ``input_separator`` (instruction,
self_instruct; default ``"\\n\\n"``), ``strip_completion_suffix`` (prompt_completion: an end
marker removed from completions, as in OpenAI's legacy fine-tuning files), ``role_map``
(messages/sharegpt).

Errors are :class:`RecordError` (field + problem); the readers in :mod:`prefect_tinker.recipes.data_reading` add
the file and line.  Sources of the formats: Alpaca (https://github.com/tatsu-lab/stanford_alpaca,
instruction/input/output), Dolly 15k (instruction/context/response), Anthropic HH-RLHF
(https://github.com/anthropics/hh-rlhf, ``\\n\\nHuman:``/``\\n\\nAssistant:`` transcripts), Self-Instruct
seed tasks (https://github.com/yizhongw/self-instruct, ``instances`` of input/output).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pydantic import BaseModel, Field

from prefect_tinker.recipes.format_options import DataFormat, FormatOptions
from prefect_tinker.recipes.media_sources import MEDIA_FORMATS
from prefect_tinker.recipes.record_fields import (
    Converted,
    RecordError,
    get_field,
    pick_text,
    short_repr,
    top_key,
    with_system,
)
from prefect_tinker.recipes.registry import Registry, tagged_options
from prefect_tinker.recipes.renderers.messages import FieldProblem, check_message_list
from prefect_tinker.recipes.tools.calculator_traces import calculator_solution

__all__ = [
    "CONVERTERS",
    "Conversation",
    "Converted",
    "DatasetFormatError",
    "InstructionOptions",
    "MessagesOptions",
    "PromptCompletionOptions",
    "PAIR_FORMATS",
    "PreferencePair",
    "RecordError",
    "convert_record",
    "data_format",
    "converter_names",
    "get_field",
    "parse_dialogue",
    "pairs_from_record",
    "preference_from_dialogues",
    "register_converter",
    "validate_messages",
]


class DatasetFormatError(ValueError):
    """A dataset record is malformed; the message names ``file:line`` (or row) and the field."""


@dataclass(frozen=True)
class Conversation:
    """One validated conversation.

    Attributes:
        messages: the messages (plain dicts with at least ``role`` and ``content``).
        source: where it came from, ``"path:line"`` or ``"dataset[split]:row"``.
        metadata: the record's other top-level fields (kept as read).
        field: the record field(s) the messages came from (for error messages).
    """

    messages: list[dict[str, Any]]
    source: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    field: str = "messages"

    def __len__(self) -> int:
        return len(self.messages)


def _messages(
    record: Any,
    fields: Mapping[str, str],
    options: MessagesOptions,
    *,
    default_field: str = "messages",
    role_key: str = "role",
    content_key: str = "content",
    role_map: Mapping[str, str] | None = None,
) -> list[Converted]:
    path = fields.get("messages", default_field)
    msgs = get_field(record, path)
    rk, ck = fields.get("role", role_key), fields.get("content", content_key)
    rmap = dict(role_map or {}, **options.role_map)
    if (rk, ck) != ("role", "content") or rmap:
        if not isinstance(msgs, list):
            raise RecordError(path, f"must be a non-empty list of messages, got {short_repr(msgs)}")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, Mapping):
                raise RecordError(f"{path}[{i}]", f"must be an object with {rk} and {ck}, got {short_repr(m)}")
            for key in (rk, ck):
                if key not in m:
                    raise RecordError(f"{path}[{i}].{key}", "is missing")
            rest = {k: v for k, v in m.items() if k not in (rk, ck)}
            out.append({**rest, "role": rmap.get(m[rk], m[rk]), "content": m[ck]})
        msgs = out
    if isinstance(msgs, list):
        msgs = with_system(msgs, options.system_prompt)
    return [Converted(msgs, path, frozenset({top_key(path)}))]


def _sharegpt(record: Any, fields: Mapping[str, str], options: MessagesOptions) -> list[Converted]:
    roles = {
        "human": "user",
        "user": "user",
        "gpt": "assistant",
        "assistant": "assistant",
        "system": "system",
        "tool": "tool",
    }
    return _messages(
        record, fields, options, default_field="conversations", role_key="from", content_key="value", role_map=roles
    )


def _require_text(path: str | None, value: str | None, what: str) -> str:
    if value is None or not value.strip():
        raise RecordError(path or what, "is empty: nothing to train on")
    return value


def _instruction(record: Any, fields: Mapping[str, str], options: InstructionOptions) -> list[Converted]:
    ipath, instruction = pick_text(record, fields, "instruction", ("instruction",))
    xpath, extra = pick_text(record, fields, "input", ("input", "context"), required=False)
    opath, output = pick_text(record, fields, "output", ("output", "response"))
    spath, system = pick_text(record, fields, "system", ("system",), required=False)
    user = instruction + options.input_separator + extra if extra and extra.strip() else instruction
    msgs = [{"role": "user", "content": user}, {"role": "assistant", "content": _require_text(opath, output, "output")}]
    used = frozenset(top_key(p) for p in (ipath, xpath, opath, spath) if p)
    return [Converted(with_system(msgs, system or options.system_prompt), f"{ipath}+{opath}", used)]


def _prompt_completion(record: Any, fields: Mapping[str, str], options: PromptCompletionOptions) -> list[Converted]:
    ppath, prompt = pick_text(record, fields, "prompt", ("prompt",))
    cpath, completion = pick_text(record, fields, "completion", ("completion", "response", "answer"))
    spath, system = pick_text(record, fields, "system", ("system",), required=False)
    suffix = options.strip_completion_suffix
    if suffix and completion.endswith(suffix):
        completion = completion[: -len(suffix)]
    msgs = [
        {"role": "user", "content": prompt},
        {"role": "assistant", "content": _require_text(cpath, completion, "completion")},
    ]
    used = frozenset(top_key(p) for p in (ppath, cpath, spath) if p)
    return [Converted(with_system(msgs, system or options.system_prompt), f"{ppath}+{cpath}", used)]


_TURN = re.compile(r"\n\n(Human|Assistant):")


def parse_dialogue(text: str) -> list[dict[str, str]]:
    """Messages of a ``\\n\\nHuman: ...\\n\\nAssistant: ...`` transcript (HH-RLHF style).

    Turns become user/assistant messages with content stripped of surrounding whitespace;
    consecutive turns of one speaker stay separate messages; a transcript may omit the leading
    blank line.  ``Human:`` inside a turn (not after a blank line) is content.

    Raises:
        ValueError: text before the first turn, or no turn at all.
    """
    if text.startswith(("Human:", "Assistant:")):
        text = "\n\n" + text
    parts = _TURN.split(text)
    if parts[0].strip():
        raise ValueError(f"has text before the first '\\n\\nHuman:' turn: {short_repr(parts[0], 40)}")
    if len(parts) < 3:
        raise ValueError("has no '\\n\\nHuman:' / '\\n\\nAssistant:' turns")
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[who], "content": body.strip()} for who, body in zip(parts[1::2], parts[2::2], strict=True)]


def _dialogue(record: Any, fields: Mapping[str, str], options: FormatOptions) -> list[Converted]:
    path, text = pick_text(record, fields, "text", ("text",))
    try:
        msgs = parse_dialogue(text)
    except ValueError as exc:
        raise RecordError(path, str(exc)) from None
    return [Converted(with_system(msgs, options.system_prompt), path, frozenset({top_key(path)}))]


def _self_instruct(record: Any, fields: Mapping[str, str], options: InstructionOptions) -> list[Converted]:
    ipath, instruction = pick_text(record, fields, "instruction", ("instruction",))
    lpath = fields.get("instances", "instances")
    instances = get_field(record, lpath)
    if not isinstance(instances, list) or not instances:
        raise RecordError(lpath, f"must be a non-empty list of {{input, output}} objects, got {short_repr(instances)}")
    out = []
    for j, inst in enumerate(instances):
        sub = {"instruction": instruction, **inst} if isinstance(inst, Mapping) else None
        if sub is None:
            raise RecordError(f"{lpath}[{j}]", f"must be an object with input and output, got {short_repr(inst)}")
        try:
            (conv,) = _instruction(sub, {}, options)
        except RecordError as exc:
            raise RecordError(f"{lpath}[{j}].{exc.field}", exc.problem) from None
        out.append(Converted(conv.messages, f"{ipath}+{lpath}[{j}]", frozenset({top_key(ipath), top_key(lpath)})))
    return out


Converter = Callable[[Any, Mapping[str, str], Any], list[Converted]]

#: Dataset formats by name: a :class:`~prefect_tinker.recipes.format_options.DataFormat` (converter
#: ``convert(record, fields, options) -> list[Converted]`` and its options model) or, from a plugin, a
#: bare converter function (any option, passed as a dict). ``prompt``
#: (:mod:`~prefect_tinker.recipes.distill.prompts`) registers in its own module, imported when the
#: registry is first read; plugins add formats through the ``prefect_tinker.formats`` entry-point group.
CONVERTERS: Registry[DataFormat | Converter] = Registry(
    "dataset format", "prefect_tinker.formats", builtins=("prefect_tinker.recipes.distill.prompts",)
)


def register_converter(
    name: str, converter: Converter, options: type[FormatOptions] = FormatOptions
) -> DataFormat | Converter:
    """Register ``converter(record, fields, options) -> list[Converted]`` under ``name``
    (overwrites), its ``options`` validated by ``options`` (a :class:`FormatOptions` subclass);
    the same as an entry point of group ``prefect_tinker.formats`` naming a ``DataFormat``."""
    return CONVERTERS.register(name, DataFormat(converter, options))


class MessagesOptions(FormatOptions):
    """Options of ``messages`` and ``sharegpt``."""

    role_map: dict[str, str] = Field(
        default_factory=dict, description="Roles renamed, e.g. {bot: assistant} (after sharegpt's own mapping)."
    )


class InstructionOptions(FormatOptions):
    """Options of ``instruction`` (``alpaca``, ``dolly``) and ``self_instruct``."""

    input_separator: str = Field(default="\n\n", description="Between the instruction and its input in the user turn.")


class PromptCompletionOptions(FormatOptions):
    """Options of ``prompt_completion``."""

    strip_completion_suffix: str | None = Field(
        default=None, description="An end marker removed from completions (OpenAI's legacy fine-tuning files)."
    )


for _name, _format in {
    "messages": DataFormat(_messages, MessagesOptions),
    "sharegpt": DataFormat(_sharegpt, MessagesOptions),
    "instruction": DataFormat(_instruction, InstructionOptions),
    "alpaca": DataFormat(_instruction, InstructionOptions),
    "dolly": DataFormat(_instruction, InstructionOptions),
    "prompt_completion": DataFormat(_prompt_completion, PromptCompletionOptions),
    "dialogue": DataFormat(_dialogue),
    "hh": DataFormat(_dialogue),
    "self_instruct": DataFormat(_self_instruct, InstructionOptions),
    **MEDIA_FORMATS,  # image_folder, image_classification, audio_transcript
    "calculator_solution": DataFormat(calculator_solution),
}.items():
    CONVERTERS.register(_name, _format)


def data_format(name: str) -> DataFormat:
    """The registered format ``name`` (a plugin's bare function wrapped: any option, as a dict).

    Raises:
        ValueError: unknown name (the message lists the registered ones).
    """
    return DataFormat.of(CONVERTERS.get_or_raise(name))


def converter_names() -> list[str]:
    """Accepted ``format`` names, sorted."""
    return CONVERTERS.names()


def convert_record(
    record: Any,
    format: str = "messages",
    fields: Mapping[str, str] | None = None,
    options: FormatOptions | Mapping[str, Any] | None = None,
) -> list[Converted]:
    """Run the converter ``format`` on one record (messages not yet validated); ``options`` the
    format's options model, or a mapping validated by it.

    Raises:
        ValueError: unknown format (lists the accepted ones), or a bad option.
        RecordError: a missing field or a bad value.
    """
    fmt = data_format(format)
    if not isinstance(options, BaseModel):
        options = dict(options or {})
    options = tagged_options("format", format, fmt.Options, options)
    if not isinstance(record, Mapping):
        raise RecordError("(record)", f"must be a JSON object, got {short_repr(record)}")
    return fmt(record, dict(fields or {}), options)


def validate_messages(
    messages: Any, where: str, field_name: str = "messages", *, require_assistant: bool = True
) -> list[dict[str, Any]]:
    """Check one record's messages and return them as plain dicts.

    Args:
        messages: the value of the messages field.
        where: location for error messages, e.g. ``"data.jsonl:12"``.
        field_name: the field's name for error messages.
        require_assistant: a conversation without an assistant message is an error.

    Raises:
        DatasetFormatError: e.g. ``"data.jsonl:12: field 'messages[1].role': unknown role 'bot' ..."``.
    """
    if not isinstance(messages, list) or not messages:
        raise DatasetFormatError(
            f"{where}: field {field_name!r} must be a non-empty list of messages, got {short_repr(messages)}"
        )
    try:
        out = check_message_list(messages)
    except FieldProblem as exc:
        sep = " " if exc.problem.startswith(("is ", "must ", "needs ", "only ")) else ": "
        raise DatasetFormatError(f"{where}: field '{field_name}{exc.field}'{sep}{exc.problem}") from None
    if require_assistant and not any(m["role"] == "assistant" for m in out):
        raise DatasetFormatError(f"{where}: field {field_name!r} has no assistant message to train on")
    return out


class PreferencePair(NamedTuple):
    """A comparison: shared ``prompt`` messages, then the ``chosen`` and ``rejected`` continuations."""

    prompt: list[dict[str, str]]
    chosen: list[dict[str, str]]
    rejected: list[dict[str, str]]


#: Record formats of comparisons (``pairs_from_record``).
PAIR_FORMATS = ("preference", "dialogue", "hh")


def _as_messages(value: Any, path: str, *, reply: bool) -> list[dict]:
    """A field value as messages: text -> one message (assistant for replies, user for prompts)."""
    if isinstance(value, str):
        return [{"role": "assistant" if reply else "user", "content": value}]
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(m, Mapping) for m in value):
        raise RecordError(path, f"must be a text, a message or a list of messages, got {short_repr(value)}")
    for i, m in enumerate(value):
        if "role" not in m or "content" not in m:
            raise RecordError(f"{path}[{i}]", "needs role and content")
        if not isinstance(m["content"], str):
            raise RecordError(f"{path}[{i}].content", f"must be a string, got {short_repr(m['content'])}")
    return [dict(m) for m in value]


def _field(record: Any, fields: Mapping[str, str], name: str, required: bool = True) -> tuple[str, Any]:
    path = fields.get(name, name)
    try:
        return path, get_field(record, path)
    except RecordError:
        if required:
            raise
        return path, None


def pairs_from_record(
    record: Any, format: str = "preference", fields: Mapping[str, str] | None = None
) -> tuple[list[dict], list[dict], list[dict]]:
    """``(prompt, chosen, rejected)`` message lists of one record (see the module docstring):
    ``prompt`` is what both continuations share; ``chosen``/``rejected`` what follows it.

    Raises:
        RecordError: a missing field or a value of the wrong type (names the field's path).
        ValueError: an unknown format.
    """
    fields = dict(fields or {})
    if format not in PAIR_FORMATS:
        raise ValueError(f"unknown preference format {format!r}; accepted: {', '.join(PAIR_FORMATS)}")
    cpath, chosen = _field(record, fields, "chosen")
    rpath, rejected = _field(record, fields, "rejected")
    if format in ("dialogue", "hh"):
        out = []
        for path, text in ((cpath, chosen), (rpath, rejected)):
            if not isinstance(text, str):
                raise RecordError(path, f"must be a '\\n\\nHuman: ...' transcript, got {short_repr(text)}")
            try:
                out.append(parse_dialogue(text))
            except ValueError as exc:
                raise RecordError(path, str(exc)) from None
        return _split_shared([], out[0], out[1])
    ppath, prompt = _field(record, fields, "prompt", required=False)
    prompt_msgs = [] if prompt is None else _as_messages(prompt, ppath, reply=False)
    return _split_shared(
        prompt_msgs, _as_messages(chosen, cpath, reply=True), _as_messages(rejected, rpath, reply=True)
    )


def _split_shared(
    prompt: list[dict], chosen: list[dict], rejected: list[dict]
) -> tuple[list[dict], list[dict], list[dict]]:
    k = 0
    while k < min(len(chosen), len(rejected)) - 1 and chosen[k] == rejected[k]:
        k += 1
    return prompt + chosen[:k], chosen[k:], rejected[k:]


def preference_from_dialogues(chosen: str, rejected: str) -> PreferencePair:
    """Split two HH-RLHF transcripts sharing a prefix into prompt + chosen/rejected continuations.

    Raises:
        ValueError: a transcript does not parse, or one continuation is empty (identical dialogues).
    """
    prompt, a, b = _split_shared([], parse_dialogue(chosen), parse_dialogue(rejected))
    if a == b:
        raise ValueError("chosen and rejected dialogues are identical")
    return PreferencePair(prompt, a, b)


def _preference(record: Any, fields: Mapping[str, str], options: FormatOptions) -> list[Converted]:
    """``preference`` records as conversations for SFT: the prompt and the chosen reply."""
    prompt, chosen, _ = pairs_from_record(record, "preference", fields)
    used = frozenset(top_key(fields.get(k, k)) for k in ("prompt", "chosen", "rejected"))
    return [Converted(with_system(prompt + chosen, options.system_prompt), fields.get("chosen", "chosen"), used)]


register_converter("preference", _preference)
