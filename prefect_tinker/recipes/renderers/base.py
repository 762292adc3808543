"""Renderer base: validated messages, ``train_on_what`` modes, segments, response termination.

A renderer turns a conversation into the tokens a model sees and the per-token loss weights.
Family renderers (role_colon, chatml/smollm2, qwen3, llama3) build a conversation as a list of
:class:`Segment` s -- token runs that each belong to one message and play one part in it:

``prefix``  tokens before any message (e.g. Llama's ``<|begin_of_text|>``); owned by no message
``header``  the role marker (``<|im_start|>assistant\\n``); the generation prompt ends with one
``body``    the message itself (content, reasoning, tool calls)
``end``     the end-of-turn marker the sampler stops at (``<|im_end|>``, ``<|eot_id|>``)
``sep``     what the template writes after the end marker (ChatML's ``\\n``)

Weights then follow from ``train_on_what`` (see :class:`TrainOnWhat`): a trained message gets
weight 1.0 on its ``body`` and ``end`` tokens -- exactly what the model has to produce after
the generation prompt -- and 0.0 elsewhere; ``all_messages`` trains every part of every message
and ``all_tokens`` every token.  Because the generation prompt of ``messages[:i]`` is the
segments of those messages followed by an assistant ``header``, it is a token prefix of the
supervised example of any conversation that continues them (the property the tests check):
an assistant header and the reply after it are encoded separately, never merged by BPE.

Markup (headers, end markers, format text) is encoded with special tokens recognised; message
content as text (:mod:`prefect_tinker.recipes.renderers.encoding`), unless the renderer is built
with ``special_tokens_in_content=True``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import numpy as np
import tinker

from prefect_tinker.recipes.media import MediaError, MediaToken, model_input_from_tokens, tokens_from_model_input
from prefect_tinker.recipes.renderers.encoding import Piece, text_encoder
from prefect_tinker.recipes.renderers.media_parts import MediaContent, MediaEncoder, MediaRun
from prefect_tinker.recipes.renderers.messages import (
    KNOWN_ROLES,
    Message,
    RendererError,
    check_message_list,
    check_tools,
    normalize_messages,
)

__all__ = [
    "KNOWN_ROLES",
    "TRAIN_ON_CHOICES",
    "ContentPiece",
    "Message",
    "ParsedResponse",
    "Renderer",
    "RendererError",
    "Segment",
    "Termination",
    "TrainOnWhat",
    "check_message_list",
    "check_tools",
    "normalize_messages",
    "trained_message_mask",
]

#: A piece whose text may be a message's :class:`MediaContent` (text, image and audio parts), expanded on encoding.
ContentPiece = tuple[str | MediaContent, bool]


class TrainOnWhat(str, Enum):  # noqa: UP042 -- StrEnum changes str()/format() of members, which configs and logs show
    """Which tokens of a conversation get loss weight.

    ``last_assistant_message``: the last assistant message (body and end-of-turn marker).
    ``last_assistant_turn``: every assistant message after the last user message (an agent's
    whole reply: tool calls and final answer; tool results in between are not trained).
    ``all_assistant_messages``: every assistant message.
    ``all_messages``: every message, role headers and separators included (not the
    conversation prefix such as BOS).
    ``all_tokens``: every token.
    ``customized``: the messages whose ``trainable`` flag is ``True`` (missing = ``False``).
    """

    LAST_ASSISTANT_MESSAGE = "last_assistant_message"
    LAST_ASSISTANT_TURN = "last_assistant_turn"
    ALL_ASSISTANT_MESSAGES = "all_assistant_messages"
    ALL_MESSAGES = "all_messages"
    ALL_TOKENS = "all_tokens"
    CUSTOMIZED = "customized"


#: Accepted values of ``train_on_what`` (the :class:`TrainOnWhat` values).
TRAIN_ON_CHOICES = tuple(t.value for t in TrainOnWhat)


class Termination(str, Enum):  # noqa: UP042 -- StrEnum changes str()/format() of members, which logs and rows show
    """How a sampled response ended (second item of :meth:`Renderer.parse_response`).

    ``stop_sequence``: the renderer's end-of-turn stop sequence ended it (normal end).
    ``end_of_sequence``: the tokenizer's end-of-sequence token ended it (no end-of-turn marker).
    ``truncated``: neither was found: the tokens ran out (``max_tokens`` reached).
    ``malformed``: it ended, but its content does not parse (bad tool call JSON, an unclosed
    ``<think>``); the message then holds the raw text as content.
    """

    STOP_SEQUENCE = "stop_sequence"
    END_OF_SEQUENCE = "end_of_sequence"
    TRUNCATED = "truncated"
    MALFORMED = "malformed"


class ParsedResponse(NamedTuple):
    """``(message, termination)`` returned by :meth:`Renderer.parse_response`."""

    message: Message
    termination: Termination

    @property
    def ok(self) -> bool:
        """True when the response ended properly (stop sequence or end of sequence) and parsed."""
        return self.termination in (Termination.STOP_SEQUENCE, Termination.END_OF_SEQUENCE)


@dataclass
class Segment:
    """A run of tokens with its owner message and part (see the module docstring).

    Attributes:
        tokens: token ids.
        owner: index of the message it belongs to; None for the conversation prefix or suffix.
        part: ``"prefix" | "header" | "body" | "end" | "sep"``.
        closes: index of an earlier message this run also ends (role_colon: the ``User:`` header
            after an assistant reply is that reply's stop sequence, trained with it).
    """

    tokens: list[int]
    owner: int | None
    part: str
    closes: int | None = None


def check_train_on(train_on_what: Any) -> TrainOnWhat:
    """Parse ``train_on_what``; raises RendererError naming the accepted values."""
    try:
        return TrainOnWhat(train_on_what)
    except ValueError:
        raise RendererError(f"train_on_what={train_on_what!r} is not one of {', '.join(TRAIN_ON_CHOICES)}") from None


def trained_message_mask(messages: Sequence[Message], train_on_what: Any) -> list[bool]:
    """Which messages are training targets under ``train_on_what`` (one bool per message).

    Raises:
        RendererError: no message qualifies (no assistant message; none after the last user
            message; no ``trainable: true`` flag).
    """
    mode = check_train_on(train_on_what)
    n = len(messages)
    if mode in (TrainOnWhat.ALL_MESSAGES, TrainOnWhat.ALL_TOKENS):
        return [True] * n
    if mode is TrainOnWhat.CUSTOMIZED:
        mask = [m.get("trainable") is True for m in messages]
        if not any(mask):
            raise RendererError("train_on_what='customized' but no message has trainable=true")
        return mask
    assistant = [m["role"] == "assistant" for m in messages]
    if not any(assistant):
        raise RendererError("conversation has no assistant message to train on")
    if mode is TrainOnWhat.ALL_ASSISTANT_MESSAGES:
        return assistant
    if mode is TrainOnWhat.LAST_ASSISTANT_MESSAGE:
        last = max(i for i in range(n) if assistant[i])
        return [i == last for i in range(n)]
    last_user = max((i for i in range(n) if messages[i]["role"] == "user"), default=-1)
    mask = [assistant[i] and i > last_user for i in range(n)]
    if not any(mask):
        raise RendererError(
            "train_on_what='last_assistant_turn' but no assistant message follows the last user message"
        )
    return mask


def segment_weights(segments: Sequence[Segment], trained: Sequence[bool], mode: TrainOnWhat) -> np.ndarray:
    """Per-token weights, float32 of shape (N,), for segments under a trained-message mask."""
    out: list[float] = []
    for seg in segments:
        if mode is TrainOnWhat.ALL_TOKENS:
            w = 1.0
        elif mode is TrainOnWhat.ALL_MESSAGES:
            w = float(seg.owner is not None or seg.closes is not None)
        else:
            own = seg.owner is not None and trained[seg.owner] and seg.part in ("body", "end")
            w = float(own or (seg.closes is not None and trained[seg.closes]))
        out.extend(0.0 if isinstance(t, MediaToken) else w for t in seg.tokens)  # media: never trained
    return np.asarray(out, dtype=np.float32)


class Renderer:
    """Base class of renderers.

    Subclasses built from segments implement :meth:`_segments` (the whole conversation) and
    :meth:`_assistant_header` (the generation prompt's tail), and define the stop tokens; the
    generic chat-template renderer overrides the public methods instead.

    Args:
        tokenizer: a Hugging Face tokenizer (``TrainingClient.get_tokenizer()`` or
            ``AutoTokenizer.from_pretrained(...)``).
        special_tokens_in_content: False (default): message content, reasoning, tool-call
            arguments and tool schemas are encoded as text (:mod:`.encoding`), so special-token
            strings in them never become control tokens; True: they do (the behaviour before,
            for data that writes control tokens into content on purpose, e.g. inline ``<think>``).
    """

    name: str = ""
    #: Whether ``tools=`` (function schemas) can be rendered into the prompt.
    supports_tools: bool = False
    #: Whether image / audio content parts can be rendered (:mod:`.media_parts`).
    supports_media: bool = False

    def __init__(self, tokenizer: Any, *, special_tokens_in_content: bool = False):
        self.tokenizer = tokenizer
        #: False (default): message content is encoded as text; True: special-token strings in
        #: content become control tokens (the old behaviour, for data that relies on it).
        self.special_tokens_in_content = bool(special_tokens_in_content)
        self.encoder = text_encoder(tokenizer)

    # ---- helpers for subclasses -------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of the renderer's own markup ``text`` (special-token strings are control tokens)."""
        return self.encoder.markup(text)

    def content(self, text: str) -> Piece:
        """``text`` as a content piece for :meth:`encode_pieces` (markup only with ``special_tokens_in_content``)."""
        return (text, self.special_tokens_in_content)

    def encode_pieces(self, pieces: Sequence[ContentPiece]) -> list[int]:
        """Joint encoding of markup/content pieces (see :meth:`TextEncoder.pieces`), concatenated;
        media content parts become their token runs (text on either side is encoded apart)."""
        return [t for run in self._piece_runs(pieces) for t in run]

    @property
    def media(self) -> MediaEncoder:
        """The encoder of image / audio parts for this tokenizer (made on first use)."""
        enc = self.__dict__.get("_media")
        if enc is None:
            enc = self.__dict__["_media"] = MediaEncoder(self.tokenizer, self.encode)
        return enc

    def _piece_runs(self, pieces: Sequence[Any]) -> list[list[int]]:
        """Token runs of ``pieces``: text pieces encoded jointly between media items, each media
        item its own run (pieces whose text is :class:`MediaContent` are expanded first)."""
        flat: list[Any] = []
        for piece in pieces:
            if isinstance(piece, MediaRun) or not isinstance(piece[0], MediaContent):
                flat.append(piece)
                continue
            for part in piece[0]:
                if part["type"] == "text":
                    flat.append((part["text"], piece[1]))
                elif not self.supports_media:
                    raise RendererError(f"renderer {self.name!r} cannot render {part['type']} parts")
                else:
                    try:
                        flat.append(self.media.run(part))
                    except MediaError as exc:
                        raise RendererError(str(exc)) from None
        runs: list[list[int]] = []
        group: list[Piece] = []
        for piece in flat:
            if isinstance(piece, MediaRun):
                runs.extend(self.encoder.pieces(group) if group else [])
                runs.append(list(piece))
                group = []
            else:
                group.append(piece)
        runs.extend(self.encoder.pieces(group) if group else [])
        return runs

    def encode_pair(
        self, head: str, body: Sequence[ContentPiece] | str | MediaContent, *, joint: bool
    ) -> tuple[list[int], list[int]]:
        """Encode markup ``head`` followed by ``body`` (content text, or markup/content pieces).

        ``joint=False`` encodes the two separately, so that a generation prompt ending at ``head``
        is a token prefix of ``head + body``; ``joint=True`` encodes them together, as
        ``apply_chat_template`` does, and gives a token that straddles the boundary (BPE merging
        e.g. ``"\\n"`` with leading spaces of the body) to the body.
        """
        # a message's text or MediaContent is one content piece (markup only with special_tokens_in_content)
        pieces: list[ContentPiece] = (
            [(body, self.special_tokens_in_content)] if isinstance(body, (str, MediaContent)) else [*body]
        )
        if not joint:
            return self.encode(head), self.encode_pieces(pieces)
        runs = self._piece_runs([(head, True), *pieces])
        return runs[0], [t for run in runs[1:] for t in run]

    def tag_items(self, tokens: Sequence[int], tags: Sequence[str]) -> list[str]:
        """Decode sampled ``tokens`` into text and :class:`Tag` items (see :meth:`TextEncoder.tag_items`)."""
        return self.encoder.tag_items(tokens, tags)

    def special_token_id(self, text: str) -> int:
        """Id of a special token that must exist as one token (e.g. ``<|im_end|>``).

        Raises:
            RendererError: the tokenizer encodes ``text`` as several tokens (wrong family).
        """
        ids = self.encode(text)
        if len(ids) != 1:
            raise RendererError(
                f"renderer {self.name!r} needs the special token {text!r}, which tokenizer "
                f"{getattr(self.tokenizer, 'name_or_path', '?')!r} lacks (it encodes to {len(ids)} tokens); "
                "pick the renderer of this model's family"
            )
        return ids[0]

    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids that end a response without the end-of-turn marker."""
        eos = getattr(self.tokenizer, "eos_token_id", None)
        return [] if eos is None else [int(eos)]

    def _check_tools(self, tools: Any) -> list[dict[str, Any]] | None:
        if not tools:
            return None
        if not self.supports_tools:
            raise RendererError(
                f"renderer {self.name!r} cannot render tool definitions; describe them in a system message"
            )
        return check_tools(tools)

    # ---- to implement -----------------------------------------------------------------
    def _segments(self, messages: list[Message], tools: Sequence[Mapping[str, Any]] | None) -> list[Segment]:
        raise NotImplementedError

    def _assistant_header(self) -> list[int]:
        raise NotImplementedError

    # ---- public operations ------------------------------------------------------------
    def segments(
        self, messages: list[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> list[Segment] | None:
        """The normalized conversation ``messages`` as the renderer's :class:`Segment` s (each with
        its owner message, part and tokens), or None for a renderer that renders whole
        conversations only (it overrides the public methods, not the segments).

        Raises:
            RendererError: the conversation cannot be rendered.
        """
        if type(self)._segments is Renderer._segments:
            return None
        return self._segments(messages, tools)

    def assistant_header(self) -> list[int]:
        """The tokens that open an assistant message (the generation prompt's tail).

        Raises:
            NotImplementedError: a renderer that renders whole conversations only.
        """
        return self._assistant_header()

    def build_supervised_example(
        self,
        messages: Any,
        train_on_what: str | TrainOnWhat = "all_assistant_messages",
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[tinker.ModelInput, np.ndarray]:
        """Render a whole conversation for supervised training.

        Args:
            messages: message dicts (see :func:`check_message_list`) or a ``Conversation``.
            train_on_what: a :class:`TrainOnWhat` value.
            tools: function schemas to describe in the prompt (renderers with ``supports_tools``).

        Returns:
            ``(model_input, weights)``: the N positions (text tokens, and image / audio chunks
            for content parts) and float32 weights of shape ``(N,)`` (1.0 on trained tokens,
            0.0 on every media position).  Shift with :func:`prefect_tinker.recipes.datasets.datum_from_example`.

        Raises:
            RendererError: invalid messages, unknown ``train_on_what``, no message to train on,
                no trained token, tools given to a renderer without tool support, media parts
                given to one without media support, or media that cannot be read.
        """
        tokens, weights = self.build_supervised_sequence(messages, train_on_what, tools=tools)
        return self._model_input(tokens), weights

    def build_supervised_sequence(
        self,
        messages: Any,
        train_on_what: str | TrainOnWhat = "all_assistant_messages",
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[list[int], np.ndarray]:
        """Like :meth:`build_supervised_example`, but the positions as a token list in which
        media are :class:`~prefect_tinker.recipes.media.MediaToken` runs (by reference: what
        datasets store; :func:`~prefect_tinker.recipes.media.model_input_from_tokens` sends it)."""
        if type(self)._segments is Renderer._segments:  # a renderer that overrides the public methods
            model_input, weights = self.build_supervised_example(messages, train_on_what, tools=tools)
            return tokens_from_model_input(model_input), np.asarray(weights, dtype=np.float32)
        msgs = self._normalize(messages)
        mode = check_train_on(train_on_what)
        tools = self._check_tools(tools)
        trained = trained_message_mask(msgs, mode)
        segments = self._segments(msgs, tools)
        tokens = [t for seg in segments for t in seg.tokens]
        weights = segment_weights(segments, trained, mode)
        if not weights.any():
            raise RendererError(
                f"no trainable token: the messages selected by train_on_what={mode.value!r} render to no tokens"
            )
        return tokens, weights

    def build_generation_prompt(
        self,
        messages: Any,
        prefill: str | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tinker.ModelInput:
        """Tokens of ``messages`` followed by the header of a new assistant message.

        Args:
            messages: the conversation so far.
            prefill: text the assistant reply must start with, appended after the header
                (the recipe's own text: encoded as markup).
            tools: as in :meth:`build_supervised_example`.

        Returns:
            A ``tinker.ModelInput`` that is a token prefix of the supervised example of
            ``messages + [reply]`` (when ``prefill`` is None).

        Raises:
            RendererError: invalid messages, unsupported tools or media.
        """
        return self._model_input(self.build_generation_sequence(messages, prefill, tools=tools))

    def build_generation_sequence(
        self,
        messages: Any,
        prefill: str | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        """:meth:`build_generation_prompt` as a token list (media as MediaToken runs)."""
        if type(self)._segments is Renderer._segments:
            return tokens_from_model_input(self.build_generation_prompt(messages, prefill, tools=tools))
        msgs = self._normalize(messages)
        tools = self._check_tools(tools)
        tokens = [t for seg in self._segments(msgs, tools) for t in seg.tokens] + self._assistant_header()
        if prefill:
            tokens += self.encode(prefill)
        return tokens

    def _normalize(self, messages: Any) -> list[Message]:
        msgs = normalize_messages(messages)
        if not self.supports_media:
            for i, m in enumerate(msgs):
                if isinstance(m["content"], MediaContent):
                    kinds = sorted({p["type"] for p in m["content"] if p["type"] != "text"})
                    raise RendererError(
                        f"messages[{i}].content: renderer {self.name!r} cannot render "
                        f"{' / '.join(kinds)} parts (use a vision/audio model's renderer)"
                    )
        return msgs

    @staticmethod
    def _model_input(tokens: list[int]) -> tinker.ModelInput:
        try:
            return model_input_from_tokens(tokens)
        except MediaError as exc:
            raise RendererError(str(exc)) from None

    def get_stop_sequences(self) -> list[str] | list[int]:
        """Stop strings or stop token ids ending an assistant turn (for ``tinker.SamplingParams.stop``)."""
        raise NotImplementedError

    def parse_response(self, tokens: Sequence[int]) -> ParsedResponse:
        """Decode sampled tokens (what followed the generation prompt) into an assistant message.

        Returns:
            ``ParsedResponse(message, termination)``; the message is
            ``{"role": "assistant", "content": str, ...}`` without the stop sequence.
        """
        content, term = self.split_at_stop(tokens)
        text = self.tokenizer.decode(content, skip_special_tokens=False)
        return ParsedResponse({"role": "assistant", "content": text}, term)

    def split_at_stop(self, tokens: Sequence[int]) -> tuple[list[int], Termination]:
        """Tokens before the first stop token (or EOS), and how the response ended."""
        stops = {int(s) for s in self.get_stop_sequences() if isinstance(s, int)}
        eos = set(self.eos_token_ids()) - stops
        tokens = [int(t) for t in tokens]
        for i, tok in enumerate(tokens):
            if tok in stops:
                return tokens[:i], Termination.STOP_SEQUENCE
            if tok in eos:
                return tokens[:i], Termination.END_OF_SEQUENCE
        return tokens, Termination.TRUNCATED
