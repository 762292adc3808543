"""The ChatML-family tool format (Hermes / Qwen style), shared by ``chatml``, ``smollm2`` and ``qwen3``.

Tools (JSON function schemas) are declared in the system message, one JSON object per line inside
``<tools></tools>``, with the instructions Qwen2.5 and Qwen3 ship in their chat templates
(``tokenizer_config.json`` of e.g. https://huggingface.co/Qwen/Qwen3-8B; the format descends from
NousResearch's Hermes 2 Pro function calling).  A call is written in an assistant reply as::

    <tool_call>
    {"name": "<function-name>", "arguments": <arguments as JSON>}
    </tool_call>

after the reply's content (a newline between), one block per call, separated by newlines; tool
results are wrapped as ``<tool_response>\\n{result}\\n</tool_response>``.  Where the tokenizer has
``<tool_call>`` as one token (Qwen), a call is recognised only where the model sampled that token;
elsewhere (SmolLM2, ``tiny``) the tags are text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from prefect_tinker.recipes.renderers.base import ParsedResponse, Termination
from prefect_tinker.recipes.renderers.encoding import Piece, Tag, split_tags

__all__ = [
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "TOOL_RESPONSE_CLOSE",
    "TOOL_RESPONSE_OPEN",
    "format_tool_call",
    "parse_hermes_response",
    "parse_tool_calls",
    "tool_call_json",
    "tool_calls_pieces",
    "tools_system_pieces",
    "tools_system_prompt",
]

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tojson(value: Any) -> str:
    """What a chat template's ``tojson`` filter writes in transformers: ``json.dumps``, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def tools_system_pieces(
    tools: Sequence[Mapping[str, Any]], system: str | None, content: Callable[[str], Piece]
) -> list[Piece]:
    """System message body declaring ``tools``: markup pieces and, via ``content``, text pieces.

    The schemas and the conversation's own system prompt (written first, then a blank line) are
    content: text in them never becomes a control token.
    """
    pieces: list[Piece] = []
    if system is not None:
        pieces += [content(system), ("\n\n", True)]
    pieces.append((_TOOLS_HEAD, True))
    for tool in tools:
        pieces += [("\n", True), content(tojson(tool))]
    pieces.append((_TOOLS_TAIL, True))
    return pieces


def tools_system_prompt(tools: Sequence[Mapping[str, Any]], system: str | None = None) -> str:
    """The text of :func:`tools_system_pieces` (the system message Qwen/Hermes models expect).

    Args:
        tools: JSON schemas, e.g. ``{"type": "function", "function": {"name", "description", "parameters"}}``.
        system: the conversation's own system prompt, written first (followed by a blank line).
    """
    return "".join(text for text, _ in tools_system_pieces(tools, system, lambda s: (s, False)))


def _function(call: Mapping[str, Any]) -> Mapping[str, Any]:
    return call.get("function") or call


def tool_call_json(call: Mapping[str, Any]) -> str:
    """``{"name": ..., "arguments": ...}`` for one call.

    ``call`` is ``{"type": "function", "function": {"name", "arguments"}}`` or ``{"name",
    "arguments"}``; string arguments are written as they are (the Qwen template does so), others
    as JSON.
    """
    fn = _function(call)
    args = fn.get("arguments", {})
    return (
        '{"name": ' + tojson(fn["name"]) + ', "arguments": ' + (args if isinstance(args, str) else tojson(args)) + "}"
    )


def format_tool_call(call: Mapping[str, Any]) -> str:
    """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` for one call."""
    return f"{TOOL_CALL_OPEN}\n{tool_call_json(call)}\n{TOOL_CALL_CLOSE}"


def tool_calls_pieces(
    content_text: str, calls: Sequence[Mapping[str, Any]] | None, content: Callable[[str], Piece]
) -> list[Piece]:
    """An assistant body: its content, then one ``<tool_call>`` block per call (newline-separated)."""
    pieces: list[Piece] = [content(content_text)] if content_text else []
    for j, call in enumerate(calls or []):
        if j > 0 or content_text:
            pieces.append(("\n", True))
        pieces += [(TOOL_CALL_OPEN + "\n", True), content(tool_call_json(call)), ("\n" + TOOL_CALL_CLOSE, True)]
    return pieces


def _is(item: str, tag: str) -> bool:
    return isinstance(item, Tag) and item == tag


def parse_tool_calls(text: str | Sequence[str]) -> tuple[str, list[dict[str, Any]], bool]:
    """Split an assistant body into (content, tool calls, well_formed).

    Args:
        text: decoded text (tags recognised as text), or items from
            :meth:`prefect_tinker.recipes.renderers.Renderer.tag_items` (tags only where sampled).

    Returns:
        ``(content, calls, well_formed)``; calls come back as ``{"type": "function", "function":
        {"name": str, "arguments": dict}}``.  ``well_formed`` is False for an unclosed
        ``<tool_call>``, invalid JSON, a call without a name or with non-object arguments, a stray
        ``</tool_call>``, or text after the calls.  Never raises.
    """
    items = split_tags(text, (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)) if isinstance(text, str) else list(text)
    opens = [k for k, item in enumerate(items) if _is(item, TOOL_CALL_OPEN)]
    if not opens:
        return "".join(items), [], not any(_is(item, TOOL_CALL_CLOSE) for item in items)
    content = "".join(items[: opens[0]]).removesuffix("\n")
    calls: list[dict[str, Any]] = []
    ok = True
    for start, end in zip(opens, opens[1:] + [len(items)], strict=True):
        chunk = items[start + 1 : end]
        close = next((k for k, item in enumerate(chunk) if _is(item, TOOL_CALL_CLOSE)), None)
        inner = "".join(chunk if close is None else chunk[:close])
        after = "" if close is None else "".join(chunk[close + 1 :])
        if close is None or after.strip():
            ok = False
        try:
            obj = json.loads(inner.strip())
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            ok = False
            continue
        args = obj.get("arguments", {}) if isinstance(obj, dict) else None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not isinstance(args, dict):
            ok = False
            continue
        calls.append({"type": "function", "function": {"name": obj["name"], "arguments": args}})
    return content, calls, ok


def parse_hermes_response(renderer: Any, tokens: Sequence[int]) -> ParsedResponse:
    """``renderer.parse_response`` for replies in this format: content and ``<tool_call>`` blocks.

    Returns:
        ``ParsedResponse``: content without the stop token; ``tool_calls`` (``{"type":
        "function", "function": {"name", "arguments": dict}}``) when the reply made calls;
        termination ``malformed`` (content = the raw text) for a bad ``<tool_call>`` block,
        ``truncated`` (raw text) when no stop token came.  Never raises.
    """
    content_tokens, term = renderer.split_at_stop(tokens)
    raw = renderer.tokenizer.decode(content_tokens, skip_special_tokens=False)
    if term is Termination.TRUNCATED:
        return ParsedResponse({"role": "assistant", "content": raw}, term)
    content, calls, ok = parse_tool_calls(renderer.tag_items(content_tokens, (TOOL_CALL_OPEN, TOOL_CALL_CLOSE)))
    if not ok:
        return ParsedResponse({"role": "assistant", "content": raw}, Termination.MALFORMED)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = calls
    return ParsedResponse(msg, term)
