"""ChatML renderers: ``chatml`` (plain) and ``smollm2`` (ChatML with SmolLM2's default system prompt).

ChatML writes every message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` and the generation
prompt as ``<|im_start|>assistant\\n``; the sampler stops at ``<|im_end|>``.  Source: the ChatML
format as used by Qwen and SmolLM2 chat templates (e.g. SmolLM2-135M-Instruct's
``chat_template.jinja``, which also inserts ``<|im_start|>system\\nYou are a helpful AI assistant
named SmolLM, trained by Hugging Face<|im_end|>\\n`` when the first message is not a system one).

Tools use the Hermes/Qwen format of :mod:`prefect_tinker.recipes.renderers.tools`: with ``tools=``
the system message declares them (after the conversation's or the default system prompt) and
``tool`` messages are wrapped in ``<tool_response>`` tags, in their own ``tool`` turn; an
assistant message's ``tool_calls`` are always written as ``<tool_call>`` blocks after its content,
and :meth:`ChatMLRenderer.parse_response` returns them.  Without ``tools=`` a ``tool`` message is
written as its content, as SmolLM2's template does.

Tokenisation matches ``apply_chat_template(tokenize=True)`` except in two cases: the text after an
assistant header is encoded separately from the header, so that the generation prompt is a token
prefix of the supervised example (for content starting with whitespace a byte-level BPE merges
differently across that boundary than in the joint encoding of the whole text; system, user and
tool messages are encoded jointly, matching the template); and message content is encoded as text
(``<|im_end|>`` written in a message is not the control token) unless ``special_tokens_in_content``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect_tinker.recipes.renderers.base import Message, ParsedResponse, Renderer, Segment
from prefect_tinker.recipes.renderers.encoding import Piece
from prefect_tinker.recipes.renderers.tools import (
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    parse_hermes_response,
    tool_calls_pieces,
    tools_system_pieces,
)

__all__ = ["SMOLLM2_DEFAULT_SYSTEM", "ChatMLRenderer", "SmolLM2Renderer"]

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class ChatMLRenderer(Renderer):
    """ChatML without a default system prompt.

    Args:
        tokenizer: a tokenizer with ``<|im_start|>`` and ``<|im_end|>`` as single tokens.
        special_tokens_in_content: see :class:`~prefect_tinker.recipes.renderers.Renderer`.

    Raises:
        RendererError: the tokenizer lacks those tokens.
    """

    name = "chatml"
    supports_tools = True
    #: Image / audio content parts as in Qwen2-VL (``<|vision_start|>`` + image positions +
    #: ``<|vision_end|>``; audio alike), for tokenizers with those tokens (:mod:`.media_parts`).
    supports_media = True
    #: System prompt inserted when the conversation does not start with a system message.
    default_system: str | None = None

    def __init__(self, tokenizer: Any, *, special_tokens_in_content: bool = False):
        super().__init__(tokenizer, special_tokens_in_content=special_tokens_in_content)
        self.im_start = self.special_token_id(IM_START)
        self.im_end = self.special_token_id(IM_END)

    def block(
        self, i: int | None, role: str, body: Sequence[Piece] | str, *, joint: bool, header_only: bool = False
    ) -> list[Segment]:
        """Segments of ``<|im_start|>{role}\\n{body}<|im_end|>\\n`` owned by message ``i``.

        ``body`` is content text or markup/content pieces; ``joint`` encodes header and body
        together (exact template tokens; use for messages that never follow a generation prompt);
        ``header_only`` marks the body untrained too (an inserted default system prompt).
        """
        head, content = self.encode_pair(f"{IM_START}{role}\n", body, joint=joint)
        body_part = "header" if header_only else "body"
        end_part = "header" if header_only else "end"
        sep_part = "header" if header_only else "sep"
        return [
            Segment(head, i, "header"),
            Segment(content, i, body_part),
            Segment([self.im_end], i, end_part),
            Segment(self.encode("\n"), i, sep_part),
        ]

    def system_segments(self, messages: list[Message], tools: Sequence[Mapping[str, Any]] | None) -> list[Segment]:
        """The system block: the first message if it is a system one, the default system prompt
        (untrained), and the tool declarations; empty when there is none of these."""
        first_system = messages[0]["role"] == "system"
        system = messages[0]["content"] if first_system else self.default_system
        if tools:
            body = tools_system_pieces(tools, system, self.content)
        elif system is None:
            return []
        else:
            body = [self.content(system)]
        return self.block(0, "system", body, joint=True, header_only=not first_system)

    def _segments(self, messages: list[Message], tools: Sequence[Mapping[str, Any]] | None) -> list[Segment]:
        segs = self.system_segments(messages, tools)
        for i in range(1 if messages[0]["role"] == "system" else 0, len(messages)):
            msg, role = messages[i], messages[i]["role"]
            if role == "assistant":
                body = tool_calls_pieces(msg["content"], msg.get("tool_calls"), self.content)
            elif role == "tool" and tools:
                body = [
                    (TOOL_RESPONSE_OPEN + "\n", True),
                    self.content(msg["content"]),
                    ("\n" + TOOL_RESPONSE_CLOSE, True),
                ]
            else:
                body = [self.content(msg["content"])]
            segs += self.block(i, role, body, joint=role != "assistant")
        return segs

    def _assistant_header(self) -> list[int]:
        return self.encode(f"{IM_START}assistant\n")

    def get_stop_sequences(self) -> list[int]:
        """``[id of <|im_end|>]``."""
        return [self.im_end]

    def eos_token_ids(self) -> list[int]:
        ids = super().eos_token_ids()
        extra = self.encode("<|endoftext|>")
        if len(extra) == 1 and extra[0] not in ids:
            ids.append(extra[0])
        return ids

    def parse_response(self, tokens: Sequence[int]) -> ParsedResponse:
        """Content and ``tool_calls`` of a sampled reply (see
        :func:`~prefect_tinker.recipes.renderers.tools.parse_hermes_response`)."""
        return parse_hermes_response(self, tokens)


class SmolLM2Renderer(ChatMLRenderer):
    """ChatML as SmolLM2-Instruct's template writes it: a default system prompt when none is given.

    The inserted system block belongs to the first message but is never trained except under
    ``all_messages`` / ``all_tokens``.
    """

    name = "smollm2"
    default_system = SMOLLM2_DEFAULT_SYSTEM
