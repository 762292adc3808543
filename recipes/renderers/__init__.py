"""Renderers: turn chat messages into token sequences for training and sampling.

A renderer owns the mapping between a conversation (a list of ``{"role", "content", ...}``
dicts) and the tokens a model sees.  Every renderer offers:

- ``build_supervised_example(messages, train_on_what)`` -> ``(tinker.ModelInput, weights)``
  where ``weights`` is float32 of shape ``(N,)`` aligned with the N tokens (1.0 = trained);
  shifting inputs against targets is done by :func:`prefect_tinker.recipes.datasets.datum_from_example`.
- ``build_generation_prompt(messages, prefill=None)`` -> ``tinker.ModelInput`` ending where the
  next assistant reply starts; a token prefix of the supervised example of the conversation
  continued by that reply.
- ``get_stop_sequences()`` -> stop strings or token ids for ``tinker.SamplingParams(stop=...)``.
- ``parse_response(tokens)`` -> ``ParsedResponse(message, termination)`` with termination one of
  ``stop_sequence``, ``end_of_sequence``, ``truncated``, ``malformed`` (:class:`Termination`).

``train_on_what`` (:class:`TrainOnWhat`): ``last_assistant_message``, ``last_assistant_turn``,
``all_assistant_messages`` (default), ``all_messages``, ``all_tokens``, ``customized`` (per-message
``trainable`` flags).

Registered names (:func:`get_renderer`):

=========================  ==========================================================
``role_colon``             ``User: ...\\n\\nAssistant: ...`` for base models
``chatml``                 ChatML (``<|im_start|>role\\n...<|im_end|>``)
``smollm2``                ChatML with SmolLM2-Instruct's default system prompt
``qwen3``                  Qwen3 with thinking (``<think>``), tool calls and results
``qwen3_disable_thinking`` Qwen3 with an empty think block in the generation prompt
``llama3``                 Llama 3 instruct (``<|start_header_id|>...<|eot_id|>``)
``chat_template``          the tokenizer's own ``apply_chat_template``
=========================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

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
    normalize_messages,
    trained_message_mask,
)
from prefect_tinker.recipes.renderers.chat_template import ChatTemplateRenderer
from prefect_tinker.recipes.renderers.chatml import ChatMLRenderer, SmolLM2Renderer
from prefect_tinker.recipes.renderers.llama3 import Llama3Renderer
from prefect_tinker.recipes.renderers.qwen3 import (
    Qwen3Renderer,
    format_tool_call,
    parse_tool_calls,
    qwen3_tools_system_prompt,
)
from prefect_tinker.recipes.renderers.role_colon import RoleColonRenderer

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
    "RendererError",
    "RoleColonRenderer",
    "Segment",
    "SmolLM2Renderer",
    "Termination",
    "TrainOnWhat",
    "format_tool_call",
    "get_renderer",
    "guess_renderer_name",
    "normalize_messages",
    "parse_tool_calls",
    "qwen3_tools_system_prompt",
    "register_renderer",
    "renderer_names",
    "resolve_renderer_name",
    "trained_message_mask",
]

_REGISTRY: dict[str, Callable[..., Renderer]] = {
    "role_colon": RoleColonRenderer,
    "chatml": ChatMLRenderer,
    "smollm2": SmolLM2Renderer,
    "qwen3": Qwen3Renderer,
    "qwen3_disable_thinking": partial(Qwen3Renderer, enable_thinking=False),
    "llama3": Llama3Renderer,
    "chat_template": ChatTemplateRenderer,
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
        name: a registered name (see the module docstring), or ``"auto"`` for
            :func:`guess_renderer_name`.
        tokenizer: a Hugging Face tokenizer (e.g. ``TrainingClient.get_tokenizer()``).
        **kwargs: passed to the renderer (``template_kwargs`` for ``chat_template``;
            ``strip_thinking_from_history`` for the qwen3 renderers).

    Raises:
        RendererError: unknown name (the message lists the accepted names), or the
            tokenizer lacks what the renderer needs (a chat template, special tokens).
    """
    return _REGISTRY[resolve_renderer_name(name, tokenizer)](tokenizer, **kwargs)


def resolve_renderer_name(name: str, tokenizer: Any) -> str:
    """The one resolver of renderer names: ``"auto"`` -> :func:`guess_renderer_name` of
    ``tokenizer``; any other name must be registered.

    Raises:
        RendererError: an unknown name (the message lists the accepted names).
    """
    if name == "auto":
        return guess_renderer_name(tokenizer)
    if name not in _REGISTRY:
        raise RendererError(f"unknown renderer {name!r}; accepted: auto, {', '.join(renderer_names())}")
    return name


def guess_renderer_name(tokenizer: Any) -> str:
    """A renderer name for ``tokenizer`` from its chat template's markers.

    ``qwen3`` for templates with ``<|im_start|>`` and ``<think>``, ``smollm2`` for SmolLM's,
    ``llama3`` for ``<|start_header_id|>``, ``chat_template`` for any other template, and
    ``role_colon`` when there is none (a base model).
    """
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        return "role_colon"
    if "<|im_start|>" in template and "<think>" in template:
        return "qwen3"
    if "<|im_start|>" in template and "SmolLM" in template:
        return "smollm2"
    if "<|start_header_id|>" in template and "<|eot_id|>" in template:
        return "llama3"
    return "chat_template"
