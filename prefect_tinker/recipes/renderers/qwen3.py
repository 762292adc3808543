"""Qwen3 renderers: ``qwen3`` (thinking) and ``qwen3_disable_thinking``; tool calls and tool results.

Follows the chat template shipped with the Qwen3 models (``tokenizer_config.json`` of e.g.
https://huggingface.co/Qwen/Qwen3-8B, documented at https://qwen.readthedocs.io/ under "Function
Calling" and "Thinking"), which is ChatML plus:

- reasoning: an assistant message after the last user query is written
  ``<think>\\n{reasoning}\\n</think>\\n\\n{content}`` when it is the last message or has reasoning;
  earlier assistant messages lose their reasoning (history is rendered without thinking).
  Reasoning comes from ``reasoning_content`` (or, with ``special_tokens_in_content=True``, from a
  ``<think>...</think>`` prefix of content, as the template does; by default content is text).
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

from collections.abc import Mapping, Sequence
from typing import Any

from prefect_tinker.recipes.renderers.base import Message, ParsedResponse, Segment, Termination
from prefect_tinker.recipes.renderers.chatml import IM_START, ChatMLRenderer
from prefect_tinker.recipes.renderers.encoding import Piece, Tag
from prefect_tinker.recipes.renderers.tools import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    format_tool_call,
    parse_tool_calls,
    tool_calls_pieces,
    tools_system_pieces,
    tools_system_prompt,
)

__all__ = ["Qwen3Renderer", "format_tool_call", "parse_tool_calls", "qwen3_tools_system_prompt"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EMPTY_THINK = "<think>\n\n</think>\n\n"

#: The system block text declaring tools (the Hermes/Qwen format of ``recipes.renderers.tools``).
qwen3_tools_system_prompt = tools_system_prompt


def _split_reasoning(msg: Message, inline: bool) -> tuple[str, str]:
    """(reasoning, content) of an assistant message, as the Qwen3 template derives them.

    ``inline`` also takes reasoning from a ``<think>...</think>`` prefix of content (only with
    ``special_tokens_in_content``: otherwise content is text and ``<think>`` in it is not markup).
    """
    content = msg["content"]
    if isinstance(msg.get("reasoning_content"), str):
        return msg["reasoning_content"], content
    if inline and THINK_CLOSE in content:
        before = content.split(THINK_CLOSE)[0]
        return before.rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n"), content.split(THINK_CLOSE)[-1].lstrip("\n")
    return "", content


def _is_query(msg: Message) -> bool:
    c = msg["content"]
    if not isinstance(c, str):  # content parts with media: a query
        return msg["role"] == "user"
    return msg["role"] == "user" and not (c.startswith(TOOL_RESPONSE_OPEN) and c.endswith(TOOL_RESPONSE_CLOSE))


class Qwen3Renderer(ChatMLRenderer):
    """Qwen3 chat format (see the module docstring).

    Args:
        tokenizer: a Qwen3 tokenizer (any tokenizer with ``<|im_start|>``/``<|im_end|>`` tokens).
        enable_thinking: False = the generation prompt carries an empty think block
            (``qwen3_disable_thinking``).
        strip_thinking_from_history: True (the template's behaviour) drops the reasoning of
            assistant messages before the last user query; False keeps every message's
            reasoning, so that each turn is rendered as it was sampled (multi-turn RL).
        special_tokens_in_content: see :class:`~prefect_tinker.recipes.renderers.Renderer`.
    """

    name = "qwen3"
    supports_tools = True
    supports_media = True  # image / audio parts for Qwen-VL-style tokenizers (media_parts)

    def __init__(
        self,
        tokenizer: Any,
        *,
        enable_thinking: bool = True,
        strip_thinking_from_history: bool = True,
        special_tokens_in_content: bool = False,
    ):
        super().__init__(tokenizer, special_tokens_in_content=special_tokens_in_content)
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
            segs += self.block(
                0 if first_system else None, "system", tools_system_pieces(tools, system, self.content), joint=True
            )
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
                body = [
                    (f"\n{TOOL_RESPONSE_OPEN}\n", True),
                    self.content(msg["content"]),
                    (f"\n{TOOL_RESPONSE_CLOSE}", True),
                ]
                head, body_tokens = self.encode_pair(f"{IM_START}user" if opens else "", body, joint=True)
                segs += [Segment(head, i, "header"), Segment(body_tokens, i, "body")]
                if closes:
                    segs += [Segment([self.im_end], i, "end"), Segment(self.encode("\n"), i, "sep")]
        return segs

    def _assistant_segments(self, i: int, msg: Message, *, after_query: bool, last: bool) -> list[Segment]:
        reasoning, content = _split_reasoning(msg, inline=self.special_tokens_in_content)
        think = (after_query and (last or bool(reasoning))) or (
            not self.strip_thinking_from_history and bool(reasoning)
        )
        header = f"{IM_START}assistant\n"
        body: list[Piece] = []
        if think:
            content = content.lstrip("\n")
            if reasoning or self.enable_thinking:
                body = [(f"{THINK_OPEN}\n", True), self.content(reasoning.strip("\n")), (f"\n{THINK_CLOSE}\n\n", True)]
            else:  # the empty block the non-thinking generation prompt already holds
                header += EMPTY_THINK
        body += tool_calls_pieces(content, msg.get("tool_calls"), self.content)
        return [
            Segment(self.encode(header), i, "header"),
            Segment(self.encode_pieces(body), i, "body"),
            Segment([self.im_end], i, "end"),
            Segment(self.encode("\n"), i, "sep"),
        ]

    def _assistant_header(self) -> list[int]:
        return self.encode(f"{IM_START}assistant\n" + ("" if self.enable_thinking else EMPTY_THINK))

    def parse_response(self, tokens: Sequence[int]) -> ParsedResponse:
        """Split sampled tokens into reasoning, content and tool calls.

        Think and tool-call tags count only where the model sampled them as tokens when the
        tokenizer has them as added tokens (Qwen3's do); text spelling them is content.

        Returns:
            ``ParsedResponse`` whose message has ``content``, plus ``reasoning_content`` when a
            think block was present and ``tool_calls`` (``{"type": "function", "function":
            {"name", "arguments": dict}}``) when calls were made; termination ``malformed``
            for an unclosed ``<think>`` or a bad tool call, and ``truncated`` when no stop token
            came (in both cases the message content is the raw decoded text).  Never raises.
        """
        content_tokens, term = self.split_at_stop(tokens)
        raw = self.tokenizer.decode(content_tokens, skip_special_tokens=False)
        if term is Termination.TRUNCATED:  # cut off mid-way: nothing reliable to split
            return ParsedResponse({"role": "assistant", "content": raw}, term)
        items = self.tag_items(content_tokens, (THINK_OPEN, THINK_CLOSE, TOOL_CALL_OPEN, TOOL_CALL_CLOSE))
        msg: Message = {"role": "assistant"}
        ok = True
        close = next((k for k, it in enumerate(items) if isinstance(it, Tag) and it == THINK_CLOSE), None)
        if close is not None:
            before = items[:close]
            opened = max((k for k, it in enumerate(before) if isinstance(it, Tag) and it == THINK_OPEN), default=-1)
            msg["reasoning_content"] = "".join(before[opened + 1 :]).strip("\n")
            items = items[close + 1 :]
            if items and not isinstance(items[0], Tag):
                items[0] = items[0].lstrip("\n")
        elif any(isinstance(it, Tag) and it == THINK_OPEN for it in items):
            ok = False
        content, calls, calls_ok = parse_tool_calls(items)
        if not (ok and calls_ok):
            return ParsedResponse({"role": "assistant", "content": raw}, Termination.MALFORMED)
        msg["content"] = content
        if calls:
            msg["tool_calls"] = calls
        return ParsedResponse(msg, term)
