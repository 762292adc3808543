"""Renderers: turn chat messages into token sequences for training and sampling.

A renderer owns the mapping between a conversation (a list of ``{"role", "content"}`` dicts)
and the tokens a model sees.  It provides three operations used by every recipe:

- ``build_supervised_example(messages, train_on_what)`` -> ``(tinker.ModelInput, weights)``
  where ``weights`` is float32 of shape ``(N,)`` aligned with the N tokens of the model
  input (1.0 = this token is a training target, 0.0 = context only).  Shifting inputs
  against targets is done later by :func:`recipes.datasets.datum_from_example`.
- ``build_generation_prompt(messages)`` -> ``tinker.ModelInput`` ending where the next
  assistant reply starts.  It is always a token prefix of the supervised example of the
  same messages followed by an assistant reply.
- ``get_stop_sequences()`` -> stop strings or stop token ids for ``tinker.SamplingParams``.

Two renderers are registered (see :func:`get_renderer`):

``role_colon``
    For base (non-chat) models.  Format, with ``[...]`` optional::

        [System: {system}\\n\\n]User: {user}\\n\\nAssistant: {assistant}\\n\\nUser: ...

    Each message is a header ``"{Role}:"`` (never trained) followed by a body
    ``" {content}\\n\\n"``.  After a trained assistant body the next ``"User:"`` header is
    trained too (appended when the conversation ends), so the model learns to end its turn
    by writing ``"\\n\\nUser:"``, which is the stop sequence.  Tokens are the concatenation
    of the per-segment encodings (``add_special_tokens=False``) after the tokenizer's own
    leading special tokens (e.g. BOS for Llama-style tokenizers, nothing for SmolLM2).

``chat_template``
    Uses the tokenizer's own ``apply_chat_template``.  The full conversation is rendered
    to text and encoded with ``add_special_tokens=False`` (token-exact with
    ``apply_chat_template(tokenize=True)`` for templates that write their own special
    tokens).  Weights come from rendering prefixes of the conversation: message *i* spans
    the characters between the rendering of ``messages[:i]`` and ``messages[:i+1]``; an
    assistant message is trained from the end of the generation prompt
    (``messages[:i]`` with ``add_generation_prompt=True``) through its end-of-turn token
    (e.g. ``<|im_end|>``; what the template writes after it, like a newline, is not
    trained).  Each prefix must be a text prefix and a token prefix of the full
    rendering; templates that rewrite earlier turns (e.g. ones that drop past reasoning)
    raise :class:`RendererError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Callable

import numpy as np
import tinker

__all__ = [
    "TRAIN_ON_CHOICES",
    "ChatTemplateRenderer",
    "Renderer",
    "RendererError",
    "RoleColonRenderer",
    "get_renderer",
    "normalize_messages",
    "register_renderer",
    "renderer_names",
]

#: Accepted values of ``train_on_what``.
#: ``all_assistant_messages``: every assistant message (and its end-of-turn marker).
#: ``last_assistant_message``: only the last assistant message.
#: ``all_messages``: every message, role headers included (everything but leading BOS).
TRAIN_ON_CHOICES = ("all_assistant_messages", "last_assistant_message", "all_messages")

KNOWN_ROLES = ("system", "user", "assistant", "tool")


class RendererError(ValueError):
    """A conversation cannot be rendered (bad message, bad option, template breaks prefixes)."""


Message = dict[str, str]


def normalize_messages(messages: Any) -> list[Message]:
    """Validate messages and return them as a list of plain ``{"role", "content"}`` dicts.

    Args:
        messages: a sequence of mappings with string ``role`` and ``content``, or any object
            with a ``messages`` attribute holding one (e.g. ``recipes.datasets.Conversation``).

    Raises:
        RendererError: empty conversation, a message that is not a mapping, a missing or
            non-string ``role``/``content``, or a role outside ``system|user|assistant|tool``.
    """
    messages = getattr(messages, "messages", messages)
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise RendererError(f"messages must be a list of {{role, content}} dicts, got {type(messages).__name__}")
    if not messages:
        raise RendererError("messages is empty")
    out: list[Message] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise RendererError(f"messages[{i}] must be a dict with role and content, got {type(msg).__name__}")
        role, content = msg.get("role"), msg.get("content")
        if not isinstance(role, str) or role not in KNOWN_ROLES:
            raise RendererError(f"messages[{i}].role: unknown role {role!r} (expected one of {', '.join(KNOWN_ROLES)})")
        if not isinstance(content, str):
            raise RendererError(f"messages[{i}].content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def _check_train_on(train_on_what: str) -> None:
    if train_on_what not in TRAIN_ON_CHOICES:
        raise RendererError(f"train_on_what={train_on_what!r} is not one of {', '.join(TRAIN_ON_CHOICES)}")


def _trained_message_mask(messages: list[Message], train_on_what: str) -> list[bool]:
    """Which messages are training targets under ``train_on_what`` (one bool per message)."""
    if train_on_what == "all_messages":
        return [True] * len(messages)
    assistant_idx = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not assistant_idx:
        raise RendererError("conversation has no assistant message to train on")
    if train_on_what == "last_assistant_message":
        return [i == assistant_idx[-1] for i in range(len(messages))]
    return [m["role"] == "assistant" for m in messages]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _leading_special_tokens(tokenizer: Any) -> list[int]:
    """Tokens the tokenizer puts before any text when ``add_special_tokens=True`` (e.g. [BOS])."""
    probe = "x"
    with_sp = list(tokenizer.encode(probe, add_special_tokens=True))
    without = _encode(tokenizer, probe)
    for start in range(len(with_sp) - len(without) + 1):
        if with_sp[start : start + len(without)] == without:
            return with_sp[:start]
    return []


class Renderer:
    """Base class.  Subclasses implement the three operations documented in the module."""

    name: str = ""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def build_supervised_example(
        self, messages: Any, train_on_what: str = "all_assistant_messages"
    ) -> tuple[tinker.ModelInput, np.ndarray]:
        """Render a whole conversation for supervised training.

        Returns:
            ``(model_input, weights)``: the N tokens as a ``tinker.ModelInput`` and float32
            weights of shape ``(N,)`` (1.0 on trained tokens, 0.0 elsewhere).

        Raises:
            RendererError: invalid messages or ``train_on_what``, no assistant message when
                one is needed, or a template that violates the prefix property.
        """
        raise NotImplementedError

    def build_generation_prompt(self, messages: Any) -> tinker.ModelInput:
        """Tokens of ``messages`` followed by the header of a new assistant turn.

        Raises:
            RendererError: invalid messages.
        """
        raise NotImplementedError

    def get_stop_sequences(self) -> list[str] | list[int]:
        """Stop strings or stop token ids ending an assistant turn (for ``SamplingParams.stop``)."""
        raise NotImplementedError

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, bool]:
        """Decode sampled tokens into an assistant message.

        Returns:
            ``(message, ended)``: ``{"role": "assistant", "content": text}`` with the stop
            sequence removed, and whether a stop sequence was found (False = truncated).
        """
        raise NotImplementedError


class RoleColonRenderer(Renderer):
    """``User: ...\\n\\nAssistant: ...`` format for base models (see module docstring)."""

    name = "role_colon"
    STOP = "\n\nUser:"

    def __init__(self, tokenizer: Any):
        super().__init__(tokenizer)
        self._prefix = _leading_special_tokens(tokenizer)

    @staticmethod
    def _header(role: str) -> str:
        return f"{role.capitalize()}:"

    @staticmethod
    def _body(content: str) -> str:
        return f" {content}\n\n"

    def build_supervised_example(
        self, messages: Any, train_on_what: str = "all_assistant_messages"
    ) -> tuple[tinker.ModelInput, np.ndarray]:
        msgs = normalize_messages(messages)
        _check_train_on(train_on_what)
        trained = _trained_message_mask(msgs, train_on_what)
        tokens: list[int] = list(self._prefix)
        weights: list[float] = [0.0] * len(tokens)
        prev_trained_assistant = False
        for msg, train in zip(msgs, trained):
            header = _encode(self.tokenizer, self._header(msg["role"]))
            # The header after a trained assistant turn is its end-of-turn marker.
            header_w = 1.0 if (train and train_on_what == "all_messages") or prev_trained_assistant else 0.0
            body = _encode(self.tokenizer, self._body(msg["content"]))
            tokens += header + body
            weights += [header_w] * len(header) + [1.0 if train else 0.0] * len(body)
            prev_trained_assistant = train and msg["role"] == "assistant"
        if prev_trained_assistant:
            tail = _encode(self.tokenizer, self._header("user"))
            tokens += tail
            weights += [1.0] * len(tail)
        return tinker.ModelInput.from_ints(tokens), np.asarray(weights, dtype=np.float32)

    def build_generation_prompt(self, messages: Any) -> tinker.ModelInput:
        msgs = normalize_messages(messages)
        tokens = list(self._prefix)
        for msg in msgs:
            tokens += _encode(self.tokenizer, self._header(msg["role"]))
            tokens += _encode(self.tokenizer, self._body(msg["content"]))
        tokens += _encode(self.tokenizer, self._header("assistant"))
        return tinker.ModelInput.from_ints(tokens)

    def get_stop_sequences(self) -> list[str]:
        return [self.STOP]

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, bool]:
        text = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
        ended = self.STOP in text
        if ended:
            text = text[: text.index(self.STOP)]
        return {"role": "assistant", "content": text.removeprefix(" ")}, ended


class ChatTemplateRenderer(Renderer):
    """Renderer driven by ``tokenizer.apply_chat_template`` (see module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        template_kwargs: extra keyword arguments for ``apply_chat_template`` (e.g.
            ``{"enable_thinking": False}``).

    Raises:
        RendererError: the tokenizer has no chat template.
    """

    name = "chat_template"

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None):
        super().__init__(tokenizer)
        if not getattr(tokenizer, "chat_template", None):
            raise RendererError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat "
                "template; use the 'role_colon' renderer for base models"
            )
        self.template_kwargs = dict(template_kwargs or {})
        self._stop: list[int] | None = None

    def _render(self, messages: list[Message], add_generation_prompt: bool) -> str:
        if not messages and not add_generation_prompt:
            return ""
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.template_kwargs
        )
        if not isinstance(text, str):  # defensive: some versions return a list for batches
            raise RendererError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
        return text

    def _boundary_token(self, full_text: str, full_tokens: list[int], prefix_text: str, what: str) -> int:
        """Number of leading tokens of ``full_tokens`` that encode ``prefix_text``."""
        if not full_text.startswith(prefix_text):
            raise RendererError(
                f"chat template breaks the prefix property at {what}: rendering a prefix of the "
                "conversation is not a text prefix of the full rendering (the template rewrites "
                "earlier turns); use another renderer or template_kwargs"
            )
        if not prefix_text:
            return 0
        prefix_tokens = _encode(self.tokenizer, prefix_text)
        if full_tokens[: len(prefix_tokens)] != prefix_tokens:
            raise RendererError(
                f"chat template breaks the token prefix property at {what}: the tokens of the "
                "prefix differ from the start of the full conversation's tokens (a merge across "
                "the turn boundary)"
            )
        return len(prefix_tokens)

    def build_supervised_example(
        self, messages: Any, train_on_what: str = "all_assistant_messages"
    ) -> tuple[tinker.ModelInput, np.ndarray]:
        msgs = normalize_messages(messages)
        _check_train_on(train_on_what)
        trained = _trained_message_mask(msgs, train_on_what)
        full_text = self._render(msgs, add_generation_prompt=False)
        tokens = _encode(self.tokenizer, full_text)
        weights = np.zeros(len(tokens), dtype=np.float32)
        for i, (msg, train) in enumerate(zip(msgs, trained)):
            if not train:
                continue
            where = f"messages[{i}] ({msg['role']})"
            end = self._boundary_token(full_text, tokens, self._render(msgs[: i + 1], False), where)
            if msg["role"] == "assistant" and train_on_what != "all_messages":
                start_text = self._render(msgs[:i], add_generation_prompt=True)
                start = self._boundary_token(full_text, tokens, start_text, where)
                # Train up to and including the end-of-turn token, not on what follows it
                # (e.g. the newline after <|im_end|>): the sampler stops there.
                (stop,) = self.get_stop_sequences()
                if stop in tokens[start:end]:
                    end = start + tokens[start:end].index(stop) + 1
            else:
                start_text = self._render(msgs[:i], add_generation_prompt=False)
                start = self._boundary_token(full_text, tokens, start_text, where)
            weights[start:end] = 1.0
        return tinker.ModelInput.from_ints(tokens), weights

    def build_generation_prompt(self, messages: Any) -> tinker.ModelInput:
        msgs = normalize_messages(messages)
        return tinker.ModelInput.from_ints(_encode(self.tokenizer, self._render(msgs, add_generation_prompt=True)))

    def get_stop_sequences(self) -> list[int]:
        """End-of-turn token id found by rendering a probe reply; falls back to EOS.

        Returns:
            A one-element list of token ids (e.g. ``[id of <|im_end|>]``).

        Raises:
            RendererError: neither an end-of-turn special token nor an EOS token exists.
        """
        if self._stop is None:
            self._stop = [self._find_end_of_turn_token()]
        return list(self._stop)

    def _find_end_of_turn_token(self) -> int:
        probe = "PROBE-REPLY-7"
        conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}]
        try:
            text = self._render(conv, add_generation_prompt=False)
        except Exception:  # template refuses the probe: fall back to EOS
            text = ""
        if probe in text:
            after = _encode(self.tokenizer, text[text.rindex(probe) + len(probe) :])
            special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
            special |= set(getattr(self.tokenizer, "added_tokens_decoder", {}) or {})
            for tok in after:
                if tok in special:
                    return int(tok)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            raise RendererError("cannot find an end-of-turn token: template writes none and tokenizer has no EOS")
        return int(eos)

    def parse_response(self, tokens: Sequence[int]) -> tuple[Message, bool]:
        tokens = list(tokens)
        (stop,) = self.get_stop_sequences()
        ended = stop in tokens
        if ended:
            tokens = tokens[: tokens.index(stop)]
        text = self.tokenizer.decode(tokens, skip_special_tokens=False)
        return {"role": "assistant", "content": text}, ended


_REGISTRY: dict[str, Callable[..., Renderer]] = {
    RoleColonRenderer.name: RoleColonRenderer,
    ChatTemplateRenderer.name: ChatTemplateRenderer,
}


def register_renderer(name: str, factory: Callable[..., Renderer]) -> None:
    """Register ``factory(tokenizer, **kwargs) -> Renderer`` under ``name`` (overwrites)."""
    _REGISTRY[name] = factory


def renderer_names() -> list[str]:
    """Names accepted by :func:`get_renderer`, sorted."""
    return sorted(_REGISTRY)


def get_renderer(name: str, tokenizer: Any, **kwargs: Any) -> Renderer:
    """Build the renderer registered under ``name`` for ``tokenizer``.

    Args:
        name: ``"role_colon"`` or ``"chat_template"`` (or a name added by
            :func:`register_renderer`).
        tokenizer: a Hugging Face tokenizer (e.g. ``TrainingClient.get_tokenizer()``).
        **kwargs: passed to the renderer (``template_kwargs`` for ``chat_template``).

    Raises:
        RendererError: unknown name (the message lists the accepted names), or the
            tokenizer lacks what the renderer needs (a chat template).
    """
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise RendererError(f"unknown renderer {name!r}; accepted: {', '.join(renderer_names())}") from None
    return factory(tokenizer, **kwargs)
