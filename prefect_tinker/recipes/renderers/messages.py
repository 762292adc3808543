"""Message and tool-schema validation for renderers and dataset readers.

A conversation is a list of message dicts (``role``, ``content``, optional reasoning, tool calls and
flags); :func:`check_message_list` validates one and names the offending field
(``[1].role``), :func:`normalize_messages` wraps that for renderers (:class:`RendererError`), and
:func:`check_tools` validates the function schemas passed as ``tools=``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from prefect_tinker.recipes.renderers.media_parts import MediaContent, PartProblem, check_content

__all__ = ["KNOWN_ROLES", "Message", "RendererError", "check_message_list", "check_tools", "normalize_messages"]

KNOWN_ROLES = ("system", "user", "assistant", "tool")

Message = dict[str, Any]


class RendererError(ValueError):
    """A conversation cannot be rendered (bad message, bad option, or a template that breaks prefixes)."""


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_message_list(messages: Any) -> list[Message]:
    """Validate a message list; the primitive behind :func:`normalize_messages` and dataset checks.

    Accepted message keys: ``role`` (one of :data:`KNOWN_ROLES`), ``content`` (str, or a list of
    text / image / audio parts: :mod:`~prefect_tinker.recipes.renderers.media_parts`; None or
    missing only for an assistant message with ``tool_calls``), optional ``reasoning_content``
    (str), ``tool_calls`` (list of ``{"type": "function", "function": {"name", "arguments"}}``
    or ``{"name", "arguments"}``), ``trainable`` (bool), ``name`` and ``tool_call_id`` (str);
    other keys are kept as they are.

    Returns:
        New dicts (content None replaced by ``""``).

    Raises:
        FieldProblem: ``(field, problem)``, field relative to the list, e.g. ``"[1].role"``.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise FieldProblem("", f"must be a list of messages, got {_short(messages)}")
    if not messages:
        raise FieldProblem("", "is empty: a conversation needs at least one message")
    out: list[Message] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise FieldProblem(f"[{i}]", f"must be an object with role and content, got {_short(msg)}")
        if "role" not in msg:
            raise FieldProblem(f"[{i}].role", "is missing")
        role = msg["role"]
        if role not in KNOWN_ROLES:
            raise FieldProblem(f"[{i}].role", f"unknown role {_short(role)} (expected one of {', '.join(KNOWN_ROLES)})")
        tool_calls = msg.get("tool_calls")
        if tool_calls is not None:
            if role != "assistant":
                raise FieldProblem(f"[{i}].tool_calls", f"only assistant messages make tool calls (role is {role!r})")
            _check_tool_calls(tool_calls, i)
        if "content" not in msg and not tool_calls:
            raise FieldProblem(f"[{i}].content", "is missing")
        content = msg.get("content")
        if content is None and tool_calls:
            content = ""
        if isinstance(content, list):  # content parts: text, image, audio (media_parts)
            try:
                content = check_content(content, role)
            except PartProblem as exc:
                raise FieldProblem(f"[{i}].content{exc.field}", exc.problem) from None
        if not isinstance(content, (str, MediaContent)):
            raise FieldProblem(f"[{i}].content", f"must be a string or a list of content parts, got {_short(content)}")
        for key in ("reasoning_content", "name", "tool_call_id"):
            if msg.get(key) is not None and not isinstance(msg[key], str):
                raise FieldProblem(f"[{i}].{key}", f"must be a string, got {_short(msg[key])}")
        if "trainable" in msg and not isinstance(msg["trainable"], bool):
            raise FieldProblem(f"[{i}].trainable", f"must be true or false, got {_short(msg['trainable'])}")
        out.append({**msg, "role": role, "content": content})
    return out


def _check_tool_calls(tool_calls: Any, i: int) -> None:
    if not isinstance(tool_calls, list):
        raise FieldProblem(f"[{i}].tool_calls", f"must be a list, got {_short(tool_calls)}")
    for j, call in enumerate(tool_calls):
        fn = call.get("function", call) if isinstance(call, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            raise FieldProblem(f"[{i}].tool_calls[{j}]", f"needs a function name, got {_short(call)}")
        if not isinstance(fn.get("arguments", {}), (str, Mapping)):
            raise FieldProblem(f"[{i}].tool_calls[{j}].arguments", "must be an object or a JSON string")


class FieldProblem(ValueError):
    """A problem at ``field`` (relative path) of a message list (raised by :func:`check_message_list`)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """Validate function schemas for ``tools=``.

    Each is ``{"type": "function", "function": {"name", "description", "parameters"}}`` (OpenAI
    style) or the bare ``{"name", "description", "parameters"}``; it must be JSON-serialisable.

    Returns:
        The schemas as a list of dicts (the same objects' contents).

    Raises:
        RendererError: e.g. ``"tools[1]: needs a function name, got {...}"``.
    """
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise RendererError(f"tools must be a list of function schemas, got {_short(tools)}")
    out = []
    for j, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RendererError(f"tools[{j}]: needs a function name, got {_short(tool)}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], Mapping):
            raise RendererError(f"tools[{j}].parameters: must be a JSON schema object, got {_short(fn['parameters'])}")
        try:
            json.dumps(tool)
        except (TypeError, ValueError) as exc:
            raise RendererError(f"tools[{j}]: not JSON-serialisable ({exc})") from None
        out.append(dict(tool))
    return out


def normalize_messages(messages: Any) -> list[Message]:
    """Validate messages for rendering (see :func:`check_message_list` for the accepted keys).

    Args:
        messages: a list of message dicts, or an object with a ``messages`` attribute
            (e.g. ``recipes.datasets.Conversation``).

    Raises:
        RendererError: e.g. ``"messages[1].role: unknown role 'bot' (expected one of ...)"``.
    """
    messages = getattr(messages, "messages", messages)
    try:
        return check_message_list(messages)
    except FieldProblem as exc:
        raise RendererError(f"messages{exc.field}: {exc.problem}") from None
