"""Renderers: turn chat messages into token sequences for training and sampling.

A renderer owns the mapping between a conversation (a list of ``{"role", "content", ...}``
dicts) and the tokens a model sees.  Every renderer offers:

- ``build_supervised_example(messages, train_on_what, tools=None)`` -> ``(tinker.ModelInput, weights)``
  where ``weights`` is float32 of shape ``(N,)`` aligned with the N tokens (1.0 = trained);
  shifting inputs against targets is done by :func:`prefect_tinker.recipes.datasets.datum_from_example`.
- ``build_generation_prompt(messages, prefill=None, tools=None)`` -> ``tinker.ModelInput`` ending
  where the next assistant reply starts; a token prefix of the supervised example of the
  conversation continued by that reply (every renderer: training tokens = generation prompt
  tokens + reply tokens, also for replies starting with whitespace).
- ``get_stop_sequences()`` -> stop strings or token ids for ``tinker.SamplingParams(stop=...)``.
- ``parse_response(tokens)`` -> ``ParsedResponse(message, termination)`` with termination one of
  ``stop_sequence``, ``end_of_sequence``, ``truncated``, ``malformed`` (:class:`Termination`);
  the message carries ``tool_calls`` when the reply called tools (bad call JSON: ``malformed``,
  never an exception).

``tools``: JSON function schemas (:func:`check_tools`) declared in the renderer family's format:
Hermes/Qwen ``<tools>`` + ``<tool_call>`` for ``chatml``, ``smollm2`` and ``qwen3``
(:mod:`.tools`), Llama 3.1 JSON calls for ``llama3``, the template's own for ``chat_template``.

Untrusted text: message content (and reasoning, tool-call arguments, tool schemas) is encoded as
text, so special-token strings in it (``<|im_start|>``, ``<|eot_id|>``, ``<think>``, ...) never
become control tokens and cannot forge a turn boundary; ``role_colon`` escapes role markers at
line starts.  ``get_renderer(name, tok, special_tokens_in_content=True)`` keeps the old behaviour
for data that relies on it.

``train_on_what`` (:class:`TrainOnWhat`): ``last_assistant_message``, ``last_assistant_turn``,
``all_assistant_messages`` (default), ``all_messages``, ``all_tokens``, ``customized`` (per-message
``trainable`` flags).

Registered names (:func:`get_renderer`; ``"auto"`` resolves through :func:`resolve_renderer_name`):

=========================  ==========================================================
``role_colon``             ``User: ...\\n\\nAssistant: ...`` for base models
``role_colon_cookbook``    tinker-cookbook 0.6.1's ``role_colon`` token for token
``chatml``                 ChatML (``<|im_start|>role\\n...<|im_end|>``), Hermes tool calls
``smollm2``                ChatML with SmolLM2-Instruct's default system prompt
``qwen3``                  Qwen3 with thinking (``<think>``), tool calls and results
``qwen3_disable_thinking`` Qwen3 with an empty think block in the generation prompt
``llama3``                 Llama 3 instruct (``<|start_header_id|>...<|eot_id|>``), 3.1 tools
``chat_template``          the tokenizer's own ``apply_chat_template``
``qwen3_vl_instruct``      hosted Qwen3-VL instruct, via ``tml-renderers`` (images)
``qwen3_vl``               hosted Qwen3-VL thinking, via ``tml-renderers`` (images)
``tml_v0``                 hosted Inkling (TMLv0), via ``tml-renderers`` (images, audio as DMel)
=========================  ==========================================================

Content parts (``[{"type": "image", "image": ...}, {"type": "text", "text": ...},
{"type": "audio", "audio": "clip.wav"}]``, :mod:`.media_parts`): ``chatml``, ``smollm2`` and
``qwen3`` place them as Qwen2-VL does for tokenizers with vision / audio tokens (the ``tiny-vl``
and ``tiny-audio`` presets, local Qwen-VL directories); the ``tml-renderers`` families as the
hosted models expect.  Media positions always get weight 0.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from prefect_tinker.recipes.registry import Registry
from prefect_tinker.recipes.renderers.base import (
    KNOWN_ROLES,
    TRAIN_ON_CHOICES,
    Message,
    ParsedResponse,
    Renderer,
    RendererError,
    Segment,
    Termination,
    TrainOnWhat,
    check_tools,
    normalize_messages,
    trained_message_mask,
)
from prefect_tinker.recipes.renderers.chat_template import ChatTemplateRenderer
from prefect_tinker.recipes.renderers.chatml import ChatMLRenderer, SmolLM2Renderer
from prefect_tinker.recipes.renderers.encoding import Tag, TextEncoder, text_encoder
from prefect_tinker.recipes.renderers.llama3 import Llama3Renderer, llama3_tool_call_json, parse_llama3_tool_calls
from prefect_tinker.recipes.renderers.qwen3 import Qwen3Renderer, qwen3_tools_system_prompt
from prefect_tinker.recipes.renderers.role_colon import RoleColonRenderer, escape_role_markers, unescape_role_markers
from prefect_tinker.recipes.renderers.tml import TmlRenderer
from prefect_tinker.recipes.renderers.tools import (
    format_tool_call,
    parse_hermes_response,
    parse_tool_calls,
    tools_system_prompt,
)

__all__ = [
    "KNOWN_ROLES",
    "TRAIN_ON_CHOICES",
    "ChatMLRenderer",
    "ChatTemplateRenderer",
    "Llama3Renderer",
    "Message",
    "ParsedResponse",
    "Qwen3Renderer",
    "Renderer",
    "RENDERERS",
    "RendererError",
    "RoleColonRenderer",
    "Segment",
    "SmolLM2Renderer",
    "Tag",
    "Termination",
    "TextEncoder",
    "TmlRenderer",
    "TrainOnWhat",
    "check_tools",
    "escape_role_markers",
    "format_tool_call",
    "get_renderer",
    "guess_renderer_name",
    "llama3_tool_call_json",
    "normalize_messages",
    "parse_hermes_response",
    "parse_llama3_tool_calls",
    "parse_tool_calls",
    "qwen3_tools_system_prompt",
    "register_renderer",
    "renderer_names",
    "resolve_renderer_name",
    "text_encoder",
    "tools_system_prompt",
    "trained_message_mask",
    "unescape_role_markers",
]

#: Renderer factories ``factory(tokenizer, **kwargs) -> Renderer`` by name; plugins add theirs
#: through the ``prefect_tinker.renderers`` entry-point group.
RENDERERS: Registry[Callable[..., Renderer]] = Registry("renderer", "prefect_tinker.renderers")
_BUILTIN_RENDERERS: dict[str, Callable[..., Renderer]] = {
    "role_colon": RoleColonRenderer,
    # tinker-cookbook 0.6.1's role_colon, token for token (role_colon's module docstring)
    "role_colon_cookbook": partial(
        RoleColonRenderer, stop_after_every_reply=False, bos="bos_token", special_tokens_in_content=True
    ),
    "chatml": ChatMLRenderer,
    "smollm2": SmolLM2Renderer,
    "qwen3": Qwen3Renderer,
    "qwen3_disable_thinking": partial(Qwen3Renderer, enable_thinking=False),
    "llama3": Llama3Renderer,
    "chat_template": ChatTemplateRenderer,
    # hosted families through tml-renderers (optional extra "multimodal"): images, audio as DMel
    "qwen3_vl_instruct": partial(TmlRenderer, family="qwen3_vl_instruct"),
    "qwen3_vl": partial(TmlRenderer, family="qwen3_vl"),
    "tml_v0": partial(TmlRenderer, family="tml_v0"),
}
for _name, _factory in _BUILTIN_RENDERERS.items():
    RENDERERS.register(_name, _factory)


def register_renderer(name: str, factory: Callable[..., Renderer]) -> None:
    """Register ``factory(tokenizer, **kwargs) -> Renderer`` under ``name`` (overwrites); the same
    as ``RENDERERS.register`` or an entry point of group ``prefect_tinker.renderers``."""
    RENDERERS.register(name, factory)


def renderer_names() -> list[str]:
    """Names accepted by :func:`get_renderer`, sorted."""
    return RENDERERS.names()


def resolve_renderer_name(name: str, tokenizer: Any) -> str:
    """The registered renderer name that ``name`` stands for with ``tokenizer``.

    The one resolver of ``renderer="auto"`` for every recipe (SFT data, RL prompts, evaluation,
    capture); record its result with the run and its checkpoints.

    Args:
        name: ``"auto"`` (:func:`guess_renderer_name` from the tokenizer's chat template) or a
            registered name, returned unchanged.
        tokenizer: a Hugging Face tokenizer (only read for ``"auto"``).

    Raises:
        RendererError: ``name`` is neither ``"auto"`` nor registered (the message lists the names).
    """
    if name == "auto":
        return guess_renderer_name(tokenizer)
    if name not in RENDERERS:
        raise RendererError(f"unknown renderer {name!r}; accepted: auto, {', '.join(renderer_names())}")
    return name


def get_renderer(name: str, tokenizer: Any, **kwargs: Any) -> Renderer:
    """Build the renderer registered under ``name`` for ``tokenizer``.

    Args:
        name: a registered name (see the module docstring), or ``"auto"``
            (:func:`resolve_renderer_name`).
        tokenizer: a Hugging Face tokenizer (e.g. ``TrainingClient.get_tokenizer()``).
        **kwargs: passed to the renderer: ``special_tokens_in_content`` (every renderer; default
            False: message content is encoded as text), ``template_kwargs`` for
            ``chat_template``, ``strip_thinking_from_history`` for the qwen3 renderers,
            ``date_string`` / ``tools_in_user_message`` for ``llama3``.

    Raises:
        RendererError: unknown name (the message lists the accepted names), or the
            tokenizer lacks what the renderer needs (a chat template, special tokens).
    """
    return RENDERERS[resolve_renderer_name(name, tokenizer)](tokenizer, **kwargs)


def _renders_plain_chatml(tokenizer: Any) -> bool:
    """Whether the chat template writes exactly ChatML (no default system prompt, no extras)."""
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    expected = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conv)
    try:
        full = tokenizer.apply_chat_template(conv, tokenize=False)
        prompt = tokenizer.apply_chat_template(conv[1:2], tokenize=False, add_generation_prompt=True)
    except Exception:
        return False
    return full == expected and prompt == "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def guess_renderer_name(tokenizer: Any) -> str:
    """A renderer name for ``tokenizer`` from its chat template.

    ``qwen3`` for templates with ``<|im_start|>`` and ``<think>``, ``smollm2`` for SmolLM's,
    ``chatml`` for Qwen-VL templates (``<|vision_start|>``: images as Qwen2-VL places them),
    ``llama3`` for ``<|start_header_id|>`` ... ``<|eot_id|>``, ``chatml`` for a template that
    renders exactly plain ChatML (e.g. the ``tiny`` preset's), ``chat_template`` for any other
    template, and ``role_colon`` when there is none (a base model).
    """
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        return "role_colon"
    if "<|im_start|>" in template and "<think>" in template:
        return "qwen3"
    if "<|im_start|>" in template and "SmolLM" in template:
        return "smollm2"
    if "<|im_start|>" in template and "<|vision_start|>" in template:  # local Qwen2-VL / Qwen2.5-VL / Qwen3-VL
        return "chatml"
    if "<|start_header_id|>" in template and "<|eot_id|>" in template:
        return "llama3"
    if "<|im_start|>" in template and _renders_plain_chatml(tokenizer):
        return "chatml"
    return "chat_template"
