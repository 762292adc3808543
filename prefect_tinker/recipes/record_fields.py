"""Reading named fields of dataset records: the pieces every record converter uses (no registry).

A converter (:mod:`prefect_tinker.recipes.data_sources`, :mod:`prefect_tinker.recipes.media_sources`,
:mod:`prefect_tinker.recipes.tools.calculator_traces`, :mod:`prefect_tinker.recipes.distill.prompts`)
turns one record into :class:`Converted` conversations and reports a bad field as :class:`RecordError`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple, overload

__all__ = ["Converted", "RecordError", "get_field", "pick_text", "short_repr", "top_key", "with_system"]


class RecordError(ValueError):
    """A record lacks a field or holds a bad value (``field``: its path; ``problem``: what is wrong)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"field {field!r} {problem}")
        self.field, self.problem = field, problem


class Converted(NamedTuple):
    """One conversation made by a converter: messages, the field label, the top-level keys used,
    and metadata the converter adds (e.g. ``tools``: the tool schemas its messages call)."""

    messages: list[dict[str, Any]]
    field: str
    used: frozenset[str]
    metadata: Mapping[str, Any] | None = None


def short_repr(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (``...`` marks a cut)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_PATH_PART = re.compile(r"[^.\[\]]+|\[(\d+)\]")


def get_field(record: Any, path: str) -> Any:
    """The value at ``path`` in ``record``: keys separated by dots, list indices as ``[i]`` or ``.i``.

    Raises:
        RecordError: a key is missing or an index is out of range (message lists what exists).
    """
    value = record
    walked = ""
    for m in _PATH_PART.finditer(path):
        key = m.group(1) if m.group(1) is not None else m.group(0)
        if isinstance(value, Mapping):
            if key not in value:
                have = ", ".join(map(str, value)) or "no fields"
                raise RecordError(path, f"is missing ({'record' if not walked else repr(walked)} has: {have})")
            value = value[key]
        elif isinstance(value, list) and key.isdigit():
            if int(key) >= len(value):
                raise RecordError(path, f"is missing ({walked!r} has {len(value)} items)")
            value = value[int(key)]
        else:
            raise RecordError(path, f"is missing ({walked or 'record'!r} is {short_repr(value)}, not an object)")
        walked = f"{walked}[{key}]" if m.group(1) is not None else (f"{walked}.{key}" if walked else key)
    return value


def top_key(path: str) -> str:
    """The top-level key of a field path (``instances`` of ``instances[0].output``)."""
    return re.split(r"[.\[]", path, maxsplit=1)[0]


@overload
def pick_text(
    record: Mapping[str, Any],
    fields: Mapping[str, str],
    name: str,
    defaults: tuple[str, ...],
    *,
    required: Literal[True] = True,
) -> tuple[str, str]: ...


@overload
def pick_text(
    record: Mapping[str, Any], fields: Mapping[str, str], name: str, defaults: tuple[str, ...], *, required: bool
) -> tuple[str | None, str | None]: ...


def pick_text(
    record: Mapping[str, Any], fields: Mapping[str, str], name: str, defaults: tuple[str, ...], *, required: bool = True
) -> tuple[str | None, str | None]:
    """(path, string value) of logical field ``name``: the mapped path or the first default present.

    Raises:
        RecordError: required and missing, or not a string.
    """
    found = (
        fields[name]
        if name in fields
        else next((d for d in defaults if isinstance(record, Mapping) and d in record), None)
    )
    if found is None:
        if not required:
            return None, None
        have = ", ".join(map(str, record)) if isinstance(record, Mapping) else "not an object"
        raise RecordError(defaults[0], f"is missing (record has: {have or 'no fields'})")
    path: str = found
    value = get_field(record, path)
    if value is None and not required:
        return path, None
    if not isinstance(value, str):
        raise RecordError(path, f"must be a string, got {short_repr(value)}")
    return path, value


def with_system(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """``messages`` with a first system message ``system`` when given and none is there."""
    if system and (not messages or messages[0].get("role") != "system"):
        return [{"role": "system", "content": system}, *messages]
    return messages
