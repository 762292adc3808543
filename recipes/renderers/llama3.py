"""``llama3``: the Llama 3 instruct format.

Source: Meta's Llama 3 model card and prompt-format documentation
(https://www.llama.com/docs/model-cards-and-prompt-formats/meta-llama-3/) and the chat template of
Meta-Llama-3-8B-Instruct::

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n{system}<|eot_id|>
    <|start_header_id|>user<|end_header_id|>\\n\\n{user}<|eot_id|>
    <|start_header_id|>assistant<|end_header_id|>\\n\\n{assistant}<|eot_id|>

(one line here; no newlines between the blocks).  Content is trimmed of surrounding whitespace
as the template does (``| trim``).  The generation prompt ends with
``<|start_header_id|>assistant<|end_header_id|>\\n\\n``; the sampler stops at ``<|eot_id|>`` (and
at ``<|eom_id|>`` where the tokenizer has it, Llama 3.1's end of a tool-calling message).  Tool
results (``tool`` messages) use Llama 3.1's ``ipython`` role header.  Llama 3.1's template adds a
"Cutting Knowledge Date" system block; give it as a system message to reproduce it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prefect_tinker.recipes.renderers.base import Message, Renderer, Segment

__all__ = ["Llama3Renderer"]

BOS, EOT, EOM = "<|begin_of_text|>", "<|eot_id|>", "<|eom_id|>"
START_HEADER, END_HEADER = "<|start_header_id|>", "<|end_header_id|>"


class Llama3Renderer(Renderer):
    """Llama 3 instruct format (see the module docstring).

    Args:
        tokenizer: a Llama 3 tokenizer (``<|begin_of_text|>``, header and ``<|eot_id|>`` tokens).

    Raises:
        RendererError: the tokenizer lacks those special tokens.
    """

    name = "llama3"

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self.bos = self.special_token_id(BOS)
        self.eot = self.special_token_id(EOT)
        self.special_token_id(START_HEADER)
        self.special_token_id(END_HEADER)
        eom = self.encode(EOM)
        self.eom = eom[0] if len(eom) == 1 else None

    @staticmethod
    def _header_text(role: str) -> str:
        return f"{START_HEADER}{'ipython' if role == 'tool' else role}{END_HEADER}\n\n"

    def _segments(self, messages: list[Message], tools: Sequence[Mapping[str, Any]] | None) -> list[Segment]:
        segs = [Segment([self.bos], None, "prefix")]
        for i, msg in enumerate(messages):
            head, body = self.encode_pair(self._header_text(msg["role"]), msg["content"].strip(),
                                          joint=msg["role"] != "assistant")
            segs += [Segment(head, i, "header"), Segment(body, i, "body"), Segment([self.eot], i, "end")]
        return segs

    def _assistant_header(self) -> list[int]:
        return self.encode(self._header_text("assistant"))

    def get_stop_sequences(self) -> list[int]:
        """``[<|eot_id|>]`` plus ``<|eom_id|>`` when the tokenizer has it."""
        return [self.eot] + ([self.eom] if self.eom is not None else [])

    def eos_token_ids(self) -> list[int]:
        ids = super().eos_token_ids()
        end = self.encode("<|end_of_text|>")
        if len(end) == 1 and end[0] not in ids:
            ids.append(end[0])
        return ids
