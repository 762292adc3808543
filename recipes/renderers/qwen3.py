"""Qwen3 renderers: ``qwen3`` (thinking) and ``qwen3_disable_thinking``; tool calls and tool results.

Follows the chat template shipped with the Qwen3 models (``tokenizer_config.json`` of e.g.
https://huggingface.co/Qwen/Qwen3-8B, documented at https://qwen.readthedocs.io/ under "Function
Calling" and "Thinking"), which is ChatML plus:

- reasoning: an assistant message after the last user query is written
  ``<think>\\n{reasoning}\\n</think>\\n\\n{content}`` when it is the last message or has reasoning;
  earlier assistant messages lose their reasoning (history is rendered without thinking).
  Reasoning comes from ``reasoning_content`` or from a ``<think>...</think>`` prefix of content.
  ``enable_thinking=False`` ends the generation prompt with an empty ``<think>\\n\\n</think>\\n\\n``;
  this renderer then treats that empty block as part of the assistant header (never trained).
- tool calls: after the content (a newline between), one block per call:
  ``<tool_call>\\n{"name": "<name>", "arguments": <arguments as JSON>}\\n</tool_call>``.
- tool results: ``tool`` messages become a user turn, consecutive results sharing it:
  ``<|im_start|>user\\n<tool_response>\\n{result}\\n</tool_response>[\\n<tool_response>...]<|im_end|>\\n``.
- tool definitions: a system block ``[{system}\\n\\n]# Tools ... <tools>\\n{schema}...\\n</tools> ...``
  (see :func:`qwen3_tools_system_prompt`).

The sampler stops at ``<|im_end|>``; :meth:`Qwen3Renderer.parse_response` splits reasoning, content
and tool calls back out of the sampled tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from prefect_tinker.recipes.renderers.base import Message, ParsedResponse, Segment, Termination
from prefect_tinker.recipes.renderers.chatml import IM_START, ChatMLRenderer

__all__ = ["Qwen3Renderer", "format_tool_call", "parse_tool_calls", "qwen3_tools_system_prompt"]

_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
EMPTY_THINK = "<think>\n\n</think>\n\n"


def _tojson(value: Any) -> str:
    # what the template's ``tojson`` filter writes in transformers: json.dumps, non-ASCII kept
    return json.dumps(value, ensure_ascii=False)


def qwen3_tools_system_prompt(tools: Sequence[Mapping[str, Any]], system: str | None = None) -> str:
    """System block text describing ``tools`` (function schemas) the way Qwen3 expects.

    Args:
        tools: JSON schemas, e.g. ``{"type": "function", "function": {"name", "description", "parameters"}}``.
        system: the conversation's own system prompt, written first (followed by a blank line).
    """
    head = f"{system}\n\n" if system is not None else ""
    return head + _TOOLS_HEAD + "".join("\n" + _tojson(t) for t in tools) + _TOOLS_TAIL


def format_tool_call(call: Mapping[str, Any]) -> str:
    """``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` for one call.

    ``call`` is ``{"type": "function", "function": {"name", "arguments"}}`` or ``{"name",
    "arguments"}``; string arguments are written as they are, others as JSON.
    """
    fn = call.get("function") or call
    args = fn.get("arguments", {})
    args_text = args if isinstance(args, str) else _tojson(args)
    return '<tool_call>\n{"name": "' + fn["name"] + '", "arguments": ' + args_text + "}\n</tool_call>"


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]], bool]:
    """Split an assistant body into (content, tool calls, well_formed).

    Calls come back as ``{"type": "function", "function": {"name": str, "arguments": dict}}``.
    ``well_formed`` is False for an unclosed ``<tool_call>``, invalid JSON, a call without a
    name, or text after the calls.
    """
    if "<tool_call>" not in text:
        return text, [], "</tool_call>" not in text
    head, _, rest = text.partition("<tool_call>")
    content = head.removesuffix("\n")
    calls: list[dict[str, Any]] = []
    ok = True
    for piece in rest.split("<tool_call>"):
        inner, closed, after = piece.partition("</tool_call>")
        if not closed or after.strip():
            ok = False
        try:
            obj = json.loads(inner.strip())
        except json.JSONDecodeError:
            ok = False
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            ok = False
            continue
        calls.append({"type": "function", "function": {"name": obj["name"], "arguments": obj.get("arguments", {})}})
    return content, calls, ok


def _split_reasoning(msg: Message) -> tuple[str, str]:
    """(reasoning, content) of an assistant message, as the Qwen3 template derives them."""
    content = msg["content"]
    if isinstance(msg.get("reasoning_content"), str):
        return msg["reasoning_content"], content
    if "</think>" in content:
        before = content.split("</think>")[0]
        return before.rstrip("\n").split("<think>")[-1].lstrip("\n"), content.split("</think>")[-1].lstrip("\n")
    return "", content


def _is_query(msg: Message) -> bool:
    c = msg["content"]
    return msg["role"] == "user" and not (c.startswith("<tool_response>") and c.endswith("</tool_response>"))


class Qwen3Renderer(ChatMLRenderer):
    """Qwen3 chat format (see the module docstring).

    Args:
        tokenizer: a Qwen3 tokenizer (any tokenizer with ``<|im_start|>``/``<|im_end|>`` tokens).
        enable_thinking: False = the generation prompt carries an empty think block
            (``qwen3_disable_thinking``).
        strip_thinking_from_history: True (the template's behaviour) drops the reasoning of
            assistant messages before the last user query; False keeps every message's
            reasoning, so that each turn is rendered as it was sampled (multi-turn RL).
    """

    name = "qwen3"
    supports_tools = True

    def __init__(self, tokenizer: Any, *, enable_thinking: bool = True, strip_thinking_from_history: bool = True):
        super().__init__(tokenizer)
        self.enable_thinking = enable_thinking
        self.strip_thinking_from_history = strip_thinking_from_history
        if not enable_thinking:
            self.name = "qwen3_disable_thinking"

    def _segments(self, messages: list[Message], tools: Sequence[Mapping[str, Any]] | None) -> list[Segment]:
        n = len(messages)
        first_system = messages[0]["role"] == "system"
        segs: list[Segment] = []
        if tools:
            system = messages[0]["content"] if first_system else None
            segs += self.block(0 if first_system else None, "system", qwen3_tools_system_prompt(tools, system), joint=True)
        elif first_system:
            segs += self.block(0, "system", messages[0]["content"], joint=True)
        last_query = next((i for i in range(n - 1, -1, -1) if _is_query(messages[i])), n - 1)
        for i in range(1 if first_system else 0, n):
            msg, role = messages[i], messages[i]["role"]
            if role in ("user", "system"):
                segs += self.block(i, role, msg["content"], joint=True)
            elif role == "assistant":
                segs += self._assistant_segments(i, msg, after_query=i > last_query, last=i == n - 1)
            else:  # tool results: grouped into one user turn
                opens = i == 0 or messages[i - 1]["role"] != "tool"
                closes = i == n - 1 or messages[i + 1]["role"] != "tool"
                head, body = self.encode_pair(f"{IM_START}user" if opens else "",
                                              f"\n<tool_response>\n{msg['content']}\n</tool_response>", joint=True)
                segs += [Segment(head, i, "header"), Segment(body, i, "body")]
                if closes:
                    segs += [Segment([self.im_end], i, "end"), Segment(self.encode("\n"), i, "sep")]
        return segs

    def _assistant_segments(self, i: int, msg: Message, *, after_query: bool, last: bool) -> list[Segment]:
        reasoning, content = _split_reasoning(msg)
        think = (after_query and (last or bool(reasoning))) or (not self.strip_thinking_from_history and bool(reasoning))
        header = f"{IM_START}assistant\n"
        body = ""
        if think:
            content = content.lstrip("\n")
            if reasoning or self.enable_thinking:
                body = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n"
            else:  # the empty block the non-thinking generation prompt already holds
                header += EMPTY_THINK
        body += content
        for j, call in enumerate(msg.get("tool_calls") or []):
            if j > 0 or content:
                body += "\n"
            body += format_tool_call(call)
        return [
            Segment(self.encode(header), i, "header"), Segment(self.encode(body), i, "body"),
            Segment([self.im_end], i, "end"), Segment(self.encode("\n"), i, "sep"),
        ]

    def _assistant_header(self) -> list[int]:
        return self.encode(f"{IM_START}assistant\n" + ("" if self.enable_thinking else EMPTY_THINK))

    def parse_response(self, tokens: Sequence[int]) -> ParsedResponse:
        """Split sampled tokens into reasoning, content and tool calls.

        Returns:
            ``ParsedResponse`` whose message has ``content``, plus ``reasoning_content`` when a
            think block was present and ``tool_calls`` (``{"type": "function", "function":
            {"name", "arguments": dict}}``) when calls were made; termination ``malformed``
            for an unclosed ``<think>`` or a bad tool call, and ``truncated`` when no stop token
            came (in both cases the message content is the raw decoded text).
        """
        content_tokens, term = self.split_at_stop(tokens)
        raw = self.tokenizer.decode(content_tokens, skip_special_tokens=False)
        msg: Message = {"role": "assistant", "content": raw}
        text, ok = raw, True
        if "</think>" in text:
            before, _, text = text.partition("</think>")
            msg["reasoning_content"] = before.split("<think>")[-1].strip("\n")
            text = text.lstrip("\n")
        elif "<think>" in text:
            ok = False
        content, calls, calls_ok = parse_tool_calls(text)
        ok = ok and calls_ok
        if term is Termination.TRUNCATED:  # cut off mid-way: nothing reliable to split
            return ParsedResponse({"role": "assistant", "content": raw}, term)
        if not ok:
            return ParsedResponse({"role": "assistant", "content": raw}, Termination.MALFORMED)
        msg["content"] = content
        if calls:
            msg["tool_calls"] = calls
        return ParsedResponse(msg, term)
