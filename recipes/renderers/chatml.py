"""ChatML renderers: ``chatml`` (plain) and ``smollm2`` (ChatML with SmolLM2's default system prompt).

ChatML writes every message as ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` and the generation
prompt as ``<|im_start|>assistant\\n``; the sampler stops at ``<|im_end|>``.  Source: the ChatML
format as used by Qwen and SmolLM2 chat templates (e.g. SmolLM2-135M-Instruct's
``chat_template.jinja``, which also inserts ``<|im_start|>system\\nYou are a helpful AI assistant
named SmolLM, trained by Hugging Face<|im_end|>\\n`` when the first message is not a system one).

Tokenisation matches ``apply_chat_template(tokenize=True)`` except in one case: the text between
an assistant header and its content is encoded separately, so that the generation prompt is a
token prefix of the supervised example; for content starting with a newline or with two or more
whitespace characters a byte-level BPE merges differently across that boundary than it does in
the joint encoding of the whole text (for system/user/tool messages we encode jointly, matching
the template exactly).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect_tinker.recipes.renderers.base import Message, Renderer, Segment

__all__ = ["SMOLLM2_DEFAULT_SYSTEM", "ChatMLRenderer", "SmolLM2Renderer"]

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

IM_START, IM_END = "<|im_start|>", "<|im_end|>"


class ChatMLRenderer(Renderer):
    """ChatML without a default system prompt.

    Args:
        tokenizer: a tokenizer with ``<|im_start|>`` and ``<|im_end|>`` as single tokens.

    Raises:
        RendererError: the tokenizer lacks those tokens.
    """

    name = "chatml"
    #: System prompt inserted when the conversation does not start with a system message.
    default_system: str | None = None

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self.im_start = self.special_token_id(IM_START)
        self.im_end = self.special_token_id(IM_END)

    def block(self, i: int | None, role: str, body: str, *, joint: bool, header_only: bool = False) -> list[Segment]:
        """Segments of ``<|im_start|>{role}\\n{body}<|im_end|>\\n`` owned by message ``i``.

        ``joint`` encodes header and body together (exact template tokens; use for messages that
        never follow a generation prompt); ``header_only`` marks the body untrained too (an
        inserted default system prompt).
        """
        head, content = self.encode_pair(f"{IM_START}{role}\n", body, joint=joint)
        body_part = "header" if header_only else "body"
        end_part = "header" if header_only else "end"
        sep_part = "header" if header_only else "sep"
        return [
            Segment(head, i, "header"), Segment(content, i, body_part),
            Segment([self.im_end], i, end_part), Segment(self.encode("\n"), i, sep_part),
        ]

    def _segments(self, messages: list[Message], tools: Sequence[Mapping[str, Any]] | None) -> list[Segment]:
        segs: list[Segment] = []
        if self.default_system is not None and messages[0]["role"] != "system":
            segs += self.block(0, "system", self.default_system, joint=True, header_only=True)
        for i, msg in enumerate(messages):
            segs += self.block(i, msg["role"], msg["content"], joint=msg["role"] != "assistant")
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


class SmolLM2Renderer(ChatMLRenderer):
    """ChatML as SmolLM2-Instruct's template writes it: a default system prompt when none is given.

    The inserted system block belongs to the first message but is never trained except under
    ``all_messages`` / ``all_tokens``.
    """

    name = "smollm2"
    default_system = SMOLLM2_DEFAULT_SYSTEM
