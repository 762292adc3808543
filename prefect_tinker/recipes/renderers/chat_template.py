"""``chat_template``: a renderer driven by any tokenizer's own chat template.

The text is ``apply_chat_template``'s exactly.  Tokens are its joint encoding, with two
differences that keep training and sampling consistent and content untrusted:

- **prefix property**: the text is cut at the end of every assistant message's generation
  prompt (``apply_chat_template(messages[:i], add_generation_prompt=True)``) and the two sides
  are encoded separately, so the generation prompt is a token prefix of the supervised sequence:
  training tokens = generation prompt tokens + reply tokens, also for replies starting with
  whitespace (which a byte-level BPE would otherwise merge with the header's newline, giving a
  token sequence the sampler never produces);
- **content is text**: each message's content and reasoning, tool-call argument strings and
  tool ``description`` strings are found in the rendering (rendered once with random sentinels
  in their place, then matched; the template may trim them or write them as JSON strings) and
  encoded as text, so ``<|im_start|>`` in a message cannot become the control token.  Tool names,
  schema keys and other schema values are written by the template as markup.  A template that
  rewrites content in another way is refused (RendererError); ``special_tokens_in_content=True``
  skips this and encodes the whole rendering as markup (the old behaviour).

Weights come from rendering prefixes:

- an assistant message is trained from its generation-prompt cut through the first end-of-turn
  token after it (e.g. ``<|im_end|>``; what the template writes after it, such as a newline, is
  not trained);
- any other trained message (``customized``) from the end of its own header -- found by rendering
  it with a sentinel as content -- through its end-of-turn token;
- a trained message must render identically whether or not later turns follow it (the rendering
  of the conversation ending with it is a text prefix of the full rendering);
- ``all_messages`` trains every token except a leading BOS the template writes;
  ``all_tokens`` every token.

Each rendered prefix must be a text prefix of the full rendering, else :class:`RendererError`
(templates that rewrite earlier turns when the conversation grows, such as Qwen3's, which drops
past reasoning: use the ``qwen3`` renderer or ``last_assistant_message`` there).

The end-of-turn token is found by rendering a probe reply (falls back to EOS).  With ``tools=``
the template must use them (else RendererError); replies are parsed for Hermes-style
``<tool_call>`` blocks when the template mentions ``<tool_call>``.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tinker

from prefect_tinker.recipes.renderers.base import (
    Message,
    ParsedResponse,
    Renderer,
    RendererError,
    TrainOnWhat,
    check_train_on,
    normalize_messages,
    trained_message_mask,
)
from prefect_tinker.recipes.renderers.role_colon import leading_special_tokens
from prefect_tinker.recipes.renderers.tools import TOOL_CALL_OPEN, parse_hermes_response

__all__ = ["ChatTemplateRenderer"]

_SENTINEL = "\u2063SENTINEL-7f3a\u2063"
_TEMPLATE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


def _candidates(value: str) -> list[str]:
    """Ways a template may write ``value``: as is, trimmed, or as the inside of a JSON string."""
    out = [
        value,
        value.strip(),
        value.lstrip(),
        value.rstrip(),
        value.strip("\n"),
        value.lstrip("\n"),
        value.rstrip("\n"),
        json.dumps(value, ensure_ascii=False)[1:-1],
        json.dumps(value)[1:-1],
    ]
    return list(dict.fromkeys(out))


def _locate(text: str, parts: list[str], cands: list[list[str]]) -> list[tuple[int, int]] | None:
    """Spans ``[(start, end)]`` of ``text == parts[0] + x0 + parts[1] + x1 + ... + parts[m]`` with
    each ``x_k`` one of ``cands[k]``; None if there is no such split.  Depth-first, memoised."""
    m = len(cands)
    if not text.startswith(parts[0]):
        return None
    starts: list[int] = [len(parts[0])]
    spans: list[tuple[int, int]] = []
    choice: list[int] = []
    dead: set[tuple[int, int]] = set()
    k, ci = 0, 0
    while True:
        pos = starts[k]
        if k == m and pos == len(text):
            return spans
        if k < m and (k, pos) not in dead:
            while ci < len(cands[k]):
                end = pos + len(cands[k][ci])
                if text.startswith(cands[k][ci], pos) and text.startswith(parts[k + 1], end):
                    break
                ci += 1
            if ci < len(cands[k]):
                choice.append(ci)
                spans.append((pos, end))
                starts.append(end + len(parts[k + 1]))
                k, ci = k + 1, 0
                continue
        dead.add((k, pos))
        if k == 0:
            return None
        k -= 1
        starts.pop()
        spans.pop()
        ci = choice.pop() + 1


class _Slots:
    """Random sentinels standing in for untrusted strings while the template renders."""

    def __init__(self) -> None:
        self.nonce = secrets.token_hex(6)
        self.values: list[str] = []
        self.pattern = re.compile(f"\ue000{self.nonce}:(\\d+)\ue001")

    def __call__(self, value: str) -> str:
        self.values.append(value)
        return f"\ue000{self.nonce}:{len(self.values) - 1}\ue001"

    def strings(self, value: Any) -> Any:
        """``value`` with every string inside it (dict values, list items) replaced by a sentinel."""
        if isinstance(value, str):
            return self(value)
        if isinstance(value, Mapping):
            return {k: self.strings(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.strings(v) for v in value]
        return value

    def descriptions(self, value: Any) -> Any:
        """``value`` with the strings under ``description`` keys replaced by sentinels."""
        if isinstance(value, Mapping):
            return {
                k: self(v) if k == "description" and isinstance(v, str) else self.descriptions(v)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [self.descriptions(v) for v in value]
        return value

    def message(self, msg: Message) -> Message:
        out = {k: msg[k] for k in _TEMPLATE_KEYS if k in msg}
        out["content"] = self(msg["content"])
        if isinstance(msg.get("reasoning_content"), str):
            out["reasoning_content"] = self(msg["reasoning_content"])
        if msg.get("tool_calls"):
            out["tool_calls"] = [self._call(c) for c in msg["tool_calls"]]
        return out

    def _call(self, call: Mapping[str, Any]) -> dict[str, Any]:
        fn = call.get("function")
        if isinstance(fn, Mapping):
            return {**call, "function": {**fn, "arguments": self.strings(fn.get("arguments", {}))}}
        return {**call, "arguments": self.strings(call.get("arguments", {}))}


class ChatTemplateRenderer(Renderer):
    """Renderer driven by ``tokenizer.apply_chat_template`` (see the module docstring).

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        template_kwargs: extra keyword arguments for ``apply_chat_template`` (e.g.
            ``{"enable_thinking": False}``).
        special_tokens_in_content: see :class:`~prefect_tinker.recipes.renderers.Renderer`.

    Raises:
        RendererError: the tokenizer has no chat template.
    """

    name = "chat_template"
    supports_tools = True

    def __init__(
        self,
        tokenizer: Any,
        template_kwargs: Mapping[str, Any] | None = None,
        *,
        special_tokens_in_content: bool = False,
    ):
        super().__init__(tokenizer, special_tokens_in_content=special_tokens_in_content)
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

    def _content_spans(
        self, msgs: list[Message], text: str, add_generation_prompt: bool, tools: Any
    ) -> list[tuple[int, int]]:
        """Where the untrusted strings of ``msgs`` (and tool descriptions) lie in ``text``."""
        slots = _Slots()
        marked = [slots.message(m) for m in msgs]
        marked_tools = slots.descriptions(list(tools)) if tools else None
        parts = slots.pattern.split(self.render_text(marked, add_generation_prompt, marked_tools))
        cands = [_candidates(slots.values[int(i)]) for i in parts[1::2]]
        spans = _locate(text, parts[0::2], cands)
        if spans is None:
            raise RendererError(
                "the chat template changes message content in a way this renderer cannot follow (it cannot "
                "tell content from markup); use the renderer of this model family, or special_tokens_in_content=True"
            )
        return spans

    def _encode(
        self, msgs: list[Message], add_generation_prompt: bool, tools: Any, marks: Sequence[int] = ()
    ) -> tuple[str, list[int], Callable[[int], int]]:
        """``(text, tokens, token_at)``: the rendering, its tokens (see the module docstring), and
        the index of the first token at or after a cut or mark position of the text."""
        text = self.render_text(msgs, add_generation_prompt, tools)
        if tools and text == self.render_text(msgs, add_generation_prompt, None):
            raise RendererError(
                "the chat template ignores tools=...; use a renderer of the model family "
                "(chatml, smollm2, qwen3, llama3) for its tool format"
            )
        cuts = set()
        for j, msg in enumerate(msgs):
            if msg["role"] == "assistant":
                try:
                    prompt = self.render_text(msgs[:j], True, tools)
                except RendererError:  # a template refusing that prefix: no prompt ends there
                    continue
                if text.startswith(prompt):
                    cuts.add(len(prompt))
        spans = [] if self.special_tokens_in_content else self._content_spans(msgs, text, add_generation_prompt, tools)
        inside: set[int] = set()
        bounds = {0, len(text), *cuts, *marks}
        for a, b in spans:
            bounds |= {a, b}
        bounds_sorted = sorted(bounds)
        for a, b in spans:
            inside.update(p for p in bounds_sorted if a <= p < b)
        tokens: list[int] = []
        first: dict[int, int] = {}
        segment: list[tuple[int, str, bool]] = []

        def flush() -> None:
            runs = self.encoder.pieces([(piece, markup) for _, piece, markup in segment])
            for (start, _, _), run in zip(segment, runs, strict=True):
                first[start] = len(tokens)
                tokens.extend(run)
            segment.clear()

        for a, b in zip(bounds_sorted, bounds_sorted[1:], strict=False):
            if a in cuts:
                flush()
            segment.append((a, text[a:b], a not in inside))
        flush()
        first[len(text)] = len(tokens)
        return text, tokens, first.__getitem__

    def _check_prefix(self, full_text: str, prefix_text: str, what: str) -> int:
        if not full_text.startswith(prefix_text):
            raise RendererError(
                f"chat template breaks the prefix property at {what}: rendering a prefix of the "
                "conversation is not a text prefix of the full rendering (the template rewrites "
                "earlier turns); use the renderer of this model family or template_kwargs"
            )
        return len(prefix_text)

    def _end_of_turn(self, tokens: list[int], start: int) -> int:
        stop = set(self.get_stop_sequences())
        for j in range(start, len(tokens)):
            if tokens[j] in stop:
                return j + 1
        return len(tokens)

    def build_supervised_example(
        self,
        messages: Any,
        train_on_what: str | TrainOnWhat = "all_assistant_messages",
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[tinker.ModelInput, np.ndarray]:
        msgs = normalize_messages(messages)
        mode = check_train_on(train_on_what)
        tools = self._check_tools(tools)
        trained = trained_message_mask(msgs, mode)
        full_text = self.render_text(msgs, False, tools)
        starts: dict[int, int] = {}  # trained message -> text position its weights start at
        if mode not in (TrainOnWhat.ALL_TOKENS, TrainOnWhat.ALL_MESSAGES):
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
                starts[i] = self._check_prefix(full_text, prefix, where)
                # the message must render the same once later turns follow it (else the model is
                # trained on text it never produces, e.g. templates that drop past reasoning)
                self._check_prefix(full_text, self.render_text(msgs[: i + 1], False, tools), where)
        _, tokens, token_at = self._encode(msgs, False, tools, marks=list(starts.values()))
        weights = np.zeros(len(tokens), dtype=np.float32)
        if mode is TrainOnWhat.ALL_TOKENS:
            weights[:] = 1.0
        elif mode is TrainOnWhat.ALL_MESSAGES:
            lead = leading_special_tokens(self.tokenizer)  # the BOS the tokenizer itself would add
            weights[len(lead) if lead and tokens[: len(lead)] == lead else 0 :] = 1.0
        for pos in starts.values():
            start = token_at(pos)
            weights[start : self._end_of_turn(tokens, start)] = 1.0
        if not weights.any():
            raise RendererError(
                f"no trainable token: the messages selected by train_on_what={mode.value!r} render to no tokens"
            )
        return tinker.ModelInput.from_ints(tokens), weights

    def build_generation_prompt(
        self,
        messages: Any,
        prefill: str | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tinker.ModelInput:
        msgs = normalize_messages(messages)
        _, tokens, _ = self._encode(msgs, True, self._check_tools(tools))
        if prefill:
            tokens += self.encode(prefill)
        return tinker.ModelInput.from_ints(tokens)

    def parse_response(self, tokens: Sequence[int]) -> ParsedResponse:
        """Content up to the end-of-turn token; Hermes-style ``tool_calls`` when the template
        writes ``<tool_call>`` (see :func:`~prefect_tinker.recipes.renderers.tools.parse_hermes_response`)."""
        if TOOL_CALL_OPEN in str(self.tokenizer.chat_template):
            return parse_hermes_response(self, tokens)
        return super().parse_response(tokens)

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
