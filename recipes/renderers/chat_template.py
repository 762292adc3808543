"""``chat_template``: a renderer driven by any tokenizer's own chat template.

Tokens are ``apply_chat_template``'s exactly: the whole conversation is rendered to text and
encoded with ``add_special_tokens=False`` (token-exact with ``apply_chat_template(tokenize=True)``
for templates that write their own special tokens).  Weights come from rendering prefixes:

- an assistant message is trained from the end of the generation prompt of the messages before
  it (``add_generation_prompt=True``) through the first end-of-turn token after that point (e.g.
  ``<|im_end|>``; what the template writes after it, such as a newline, is not trained);
- any other trained message (``customized``) from the end of its own header -- found by rendering
  it with a sentinel as content -- through its end-of-turn token;
- a trained message must render identically whether or not later turns follow it (the rendering
  of the conversation ending with it is a text prefix of the full rendering);
- ``all_messages`` trains every token except a leading BOS the template writes;
  ``all_tokens`` every token.

Each rendered prefix must be a text prefix of the full rendering, else :class:`RendererError`
(templates that rewrite earlier turns when the conversation grows, such as Qwen3's, which drops
past reasoning: use the ``qwen3`` renderer or ``last_assistant_message`` there).  When a BPE token straddles a
prefix boundary (content starting with whitespace that merges with the header's last newline),
the straddling token is trained, and that conversation's generation prompt is then not a token
prefix of its supervised example (the template's own tokenisation wins).

The end-of-turn token is found by rendering a probe reply (falls back to EOS).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tinker

from prefect_tinker.recipes.renderers.base import (
    Message,
    Renderer,
    RendererError,
    TrainOnWhat,
    check_train_on,
    normalize_messages,
    trained_message_mask,
)
from prefect_tinker.recipes.renderers.role_colon import leading_special_tokens

__all__ = ["ChatTemplateRenderer"]

_SENTINEL = "\u2063SENTINEL-7f3a\u2063"
_TEMPLATE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


class ChatTemplateRenderer(Renderer):
    """Renderer driven by ``tokenizer.apply_chat_template`` (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        template_kwargs: extra keyword arguments for ``apply_chat_template`` (e.g.
            ``{"enable_thinking": False}``).

    Raises:
        RendererError: the tokenizer has no chat template.
    """

    name = "chat_template"
    supports_tools = True

    def __init__(self, tokenizer: Any, template_kwargs: Mapping[str, Any] | None = None):
        super().__init__(tokenizer)
        if not getattr(tokenizer, "chat_template", None):
            raise RendererError(
                f"tokenizer {getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)!r} has no chat "
                "template; use the 'role_colon' renderer for base models"
            )
        self.template_kwargs = dict(template_kwargs or {})
        self._stop: list[int] | None = None

    def render_text(self, messages: list[Message], add_generation_prompt: bool, tools: Any = None) -> str:
        """The template's text for ``messages`` (our ``trainable`` flags are not passed on)."""
        if not messages:
            return ""
        clean = [{k: m[k] for k in _TEMPLATE_KEYS if k in m} for m in messages]
        kwargs = dict(self.template_kwargs)
        if tools:
            kwargs["tools"] = list(tools)
        try:
            text = self.tokenizer.apply_chat_template(
                clean, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
            )
        except Exception as exc:  # jinja raise_exception(...) and friends
            raise RendererError(f"the chat template refused the conversation: {exc}") from exc
        if not isinstance(text, str):
            raise RendererError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not str")
        return text

    def _boundary(self, full_text: str, full_tokens: list[int], prefix_text: str, what: str) -> int:
        """Index of the first token of ``full_tokens`` not entirely inside ``prefix_text``."""
        if not full_text.startswith(prefix_text):
            raise RendererError(
                f"chat template breaks the prefix property at {what}: rendering a prefix of the "
                "conversation is not a text prefix of the full rendering (the template rewrites "
                "earlier turns); use the renderer of this model family or template_kwargs"
            )
        prefix_tokens = self.encode(prefix_text)
        k = 0
        while k < len(prefix_tokens) and k < len(full_tokens) and prefix_tokens[k] == full_tokens[k]:
            k += 1
        return k

    def _end_of_turn(self, tokens: list[int], start: int) -> int:
        stop = set(self.get_stop_sequences())
        for j in range(start, len(tokens)):
            if tokens[j] in stop:
                return j + 1
        return len(tokens)

    def build_supervised_example(
        self, messages: Any, train_on_what: str | TrainOnWhat = "all_assistant_messages", *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[tinker.ModelInput, np.ndarray]:
        msgs = normalize_messages(messages)
        mode = check_train_on(train_on_what)
        trained = trained_message_mask(msgs, mode)
        full_text = self.render_text(msgs, False, tools)
        tokens = self.encode(full_text)
        weights = np.zeros(len(tokens), dtype=np.float32)
        if mode is TrainOnWhat.ALL_TOKENS:
            weights[:] = 1.0
        elif mode is TrainOnWhat.ALL_MESSAGES:
            lead = leading_special_tokens(self.tokenizer)  # the BOS the tokenizer itself would add
            weights[len(lead) if lead and tokens[: len(lead)] == lead else 0 :] = 1.0
        else:
            for i, msg in enumerate(msgs):
                if not trained[i]:
                    continue
                where = f"messages[{i}] ({msg['role']})"
                if msg["role"] == "assistant":
                    prefix = self.render_text(msgs[:i], True, tools)
                else:
                    probe = self.render_text(msgs[:i] + [{**msg, "content": _SENTINEL}], False, tools)
                    if _SENTINEL not in probe:
                        raise RendererError(f"the chat template does not write the content of {where}")
                    prefix = probe[: probe.index(_SENTINEL)]
                start = self._boundary(full_text, tokens, prefix, where)
                # the message must render the same once later turns follow it (else the model is
                # trained on text it never produces, e.g. templates that drop past reasoning)
                self._boundary(full_text, tokens, self.render_text(msgs[: i + 1], False, tools), where)
                weights[start : self._end_of_turn(tokens, start)] = 1.0
        if not weights.any():
            raise RendererError(f"no trainable token: the messages selected by train_on_what={mode.value!r} render to no tokens")
        return tinker.ModelInput.from_ints(tokens), weights

    def build_generation_prompt(
        self, messages: Any, prefill: str | None = None, *, tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tinker.ModelInput:
        msgs = normalize_messages(messages)
        tokens = self.encode(self.render_text(msgs, True, tools))
        if prefill:
            tokens += self.encode(prefill)
        return tinker.ModelInput.from_ints(tokens)

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
            text = self.render_text(conv, add_generation_prompt=False)
        except RendererError:  # template refuses the probe: fall back to EOS
            text = ""
        if probe in text:
            after = self.encode(text[text.rindex(probe) + len(probe) :])
            special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
            special |= set(getattr(self.tokenizer, "added_tokens_decoder", {}) or {})
            for tok in after:
                if tok in special:
                    return int(tok)
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            raise RendererError("cannot find an end-of-turn token: template writes none and tokenizer has no EOS")
        return int(eos)
