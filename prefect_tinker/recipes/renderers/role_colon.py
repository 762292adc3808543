"""``role_colon``: a plain-text chat format for base (non-chat) models.

Format, with ``[...]`` optional::

    [System: {system}\\n\\n]User: {user}\\n\\nAssistant: {assistant}\\n\\nUser: ...

Each message is a header ``"{Role}:"`` followed by a body ``" {content}\\n\\n"`` (roles
capitalised: ``System``, ``User``, ``Assistant``, ``Tool``).  The model ends its turn by writing
``"\\n\\nUser:"``, the stop string: the ``User:`` header after a trained assistant reply is trained
with it (appended when the conversation ends with that reply).  Tokens are the per-segment
encodings (``add_special_tokens=False``) after the tokenizer's own leading special tokens (BOS for
Llama-style tokenizers, nothing for SmolLM2).  There is no template to match: the format is ours.

``role_colon_cookbook`` is tinker-cookbook 0.6.1's ``RoleColonRenderer`` token for token (for runs
that must send what the cookbook sends, ``docs/cookbook-parity.md``): the ``User:`` after a reply is
trained only where it ends the conversation (its ``stop_overlap`` belongs to the last message, so a
multi-turn example never teaches the model to stop after an earlier reply); the prompt starts with
the tokenizer's ``bos_token`` whenever it has one (SmolLM2's is ``<|im_start|>``, which its
tokenizer never adds itself); and content is encoded as the tokenizer reads it
(``special_tokens_in_content=True``: no escaping of role markers, special-token strings become
control tokens).

The format has no control tokens: a turn boundary is the text ``"\\n\\n{Role}:"``.  Message content
is encoded as text, and a role marker at a line start inside it (``"\\n\\nUser:"``, also
``Assistant``, ``System``, ``Tool``) is escaped with a WORD JOINER (U+2060) after the blank line --
``"\\n\\n\\u2060User:"`` -- so that content can neither forge a turn nor contain the stop
sequence; existing joiners there get one more, so :func:`unescape_role_markers` (applied by
:meth:`RoleColonRenderer.parse_response`) gives the original text back.  The model sees the joiner;
``special_tokens_in_content=True`` turns the escaping off (and encodes special-token strings in
content as control tokens), the old behaviour.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from prefect_tinker.recipes.renderers.base import (
    Message,
    ParsedResponse,
    Renderer,
    Segment,
    Termination,
)

__all__ = ["RoleColonRenderer", "escape_role_markers", "unescape_role_markers"]

_ROLES = "System|User|Assistant|Tool"
_MARKER = re.compile(rf"\n\n(\u2060*)(?=(?:{_ROLES}):)")
_ESCAPED = re.compile(rf"\n\n\u2060(\u2060*)(?=(?:{_ROLES}):)")


def escape_role_markers(text: str) -> str:
    """``"\\n\\n\\u2060"*k + Role:`` -> one joiner more, for every line-start role marker in ``text``."""
    return _MARKER.sub(lambda m: "\n\n\u2060" + m.group(1), text)


def unescape_role_markers(text: str) -> str:
    """Inverse of :func:`escape_role_markers` (one joiner fewer after each blank line before a role)."""
    return _ESCAPED.sub(lambda m: "\n\n" + m.group(1), text)


def leading_special_tokens(tokenizer: Any) -> list[int]:
    """Tokens the tokenizer puts before any text when ``add_special_tokens=True`` (e.g. [BOS])."""
    probe = "x"
    with_sp = list(tokenizer.encode(probe, add_special_tokens=True))
    without = list(tokenizer.encode(probe, add_special_tokens=False))
    for start in range(len(with_sp) - len(without) + 1):
        if with_sp[start : start + len(without)] == without:
            return with_sp[:start]
    return []


class RoleColonRenderer(Renderer):
    """``User: ...\\n\\nAssistant: ...`` for base models (see the module docstring).

    Args:
        tokenizer: any Hugging Face tokenizer.
        special_tokens_in_content: see :class:`~prefect_tinker.recipes.renderers.Renderer`.
        stop_after_every_reply: train the ``User:`` header after every trained assistant reply
            (True, default) or only the one ending the conversation (False).
        bos: the leading tokens: those the tokenizer adds itself (``"tokenizer"``, default) or its
            ``bos_token`` whenever it has one (``"bos_token"``).  ``role_colon_cookbook`` is this
            class with False, ``"bos_token"`` and ``special_tokens_in_content=True`` (module docstring).
    """

    name = "role_colon"
    STOP = "\n\nUser:"

    def __init__(
        self,
        tokenizer: Any,
        *,
        special_tokens_in_content: bool = False,
        stop_after_every_reply: bool = True,
        bos: Literal["tokenizer", "bos_token"] = "tokenizer",
    ):
        super().__init__(tokenizer, special_tokens_in_content=special_tokens_in_content)
        if bos == "bos_token":
            token = getattr(tokenizer, "bos_token", None)
            self._prefix = list(tokenizer.encode(token, add_special_tokens=False)) if token else []
        else:
            self._prefix = leading_special_tokens(tokenizer)
        self.stop_after_every_reply = stop_after_every_reply

    @staticmethod
    def _header(role: str) -> str:
        return f"{role.capitalize()}:"

    def _segments(self, messages: list[Message], tools: Sequence[Mapping[str, Any]] | None) -> list[Segment]:
        segs = [Segment(list(self._prefix), None, "prefix")] if self._prefix else []
        for i, msg in enumerate(messages):
            after_reply = i > 0 and messages[i - 1]["role"] == "assistant" and self.stop_after_every_reply
            closes = i - 1 if after_reply else None
            segs.append(Segment(self.encode(self._header(msg["role"])), i, "header", closes=closes))
            text = msg["content"] if self.special_tokens_in_content else escape_role_markers(msg["content"])
            segs.append(Segment(self.encode_pieces([self.content(f" {text}\n\n")]), i, "body"))
        if messages[-1]["role"] == "assistant":
            segs.append(Segment(self.encode(self._header("user")), None, "end", closes=len(messages) - 1))
        return segs

    def _assistant_header(self) -> list[int]:
        return self.encode(self._header("assistant"))

    def get_stop_sequences(self) -> list[str]:
        """``["\\n\\nUser:"]`` (a stop string)."""
        return [self.STOP]

    def parse_response(self, tokens: Sequence[int]) -> ParsedResponse:
        """Text up to ``"\\n\\nUser:"`` (stop_sequence), else up to EOS (end_of_sequence), else all (truncated)."""
        tokens = [int(t) for t in tokens]
        eos = set(self.eos_token_ids())
        cut = next((i for i, t in enumerate(tokens) if t in eos), None)
        text = self.tokenizer.decode(tokens if cut is None else tokens[:cut], skip_special_tokens=True)
        if self.STOP in text:
            text, term = text[: text.index(self.STOP)], Termination.STOP_SEQUENCE
        elif cut is not None:
            term = Termination.END_OF_SEQUENCE
        else:
            term = Termination.TRUNCATED
        text = text.removeprefix(" ")
        if term is not Termination.STOP_SEQUENCE:
            text = text.removesuffix("\n\n")
        if not self.special_tokens_in_content:
            text = unescape_role_markers(text)
        return ParsedResponse({"role": "assistant", "content": text}, term)
