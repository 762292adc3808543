"""``TinkerModelAPI``: an inspect-ai model API over a Tinker sampling client and our renderers.

``inspect eval TASK.py --model tinker/<model>`` where ``<model>`` is a base model name (``tiny``,
``HuggingFaceTB/SmolLM2-135M-Instruct``, ``base:<name>``) or a ``tinker://<run>/sampler_weights/<name>``
path. Model args (``-M key=value``):

``renderer``           ``auto`` (default: guessed from the tokenizer's chat template) or a renderer name
``credentials_block``  a saved ``TinkerCredentials`` block (takes precedence)
``--model-base-url``   (inspect's option, not ``-M``: ``-M base_url`` collides with it) a
                       self-hosted Tinker-compatible server or the hosted service; the API key
                       from ``TINKER_API_KEY`` (or ``--model-api-key``)
``local_root``         folder of the embedded local server (default ``$PREFECT_TINKER_HOME`` or
                       ``~/.prefect-tinker``), the backend when neither of the above is given
``max_connections``    requests in flight (default 8)

Generation config: ``max_tokens`` (default 1024), ``temperature`` (default 1.0), ``top_p``,
``top_k``, ``seed``, ``num_choices`` (samples of one request) and ``stop_seqs`` (cut on the client,
after the renderer's own end-of-turn stop, so they work with stop-token renderers too).
Chats are rendered by our renderers (system/user/assistant/tool messages, assistant tool calls,
tool schemas for renderers with tool support); replies are parsed back with ``parse_response``:
stop reason ``stop`` for a stop sequence or EOS, ``max_tokens`` for a truncated reply,
``tool_calls`` when the renderer parsed tool calls.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from typing import Any

import anyio
import tinker
from inspect_ai.model import (
    ChatCompletionChoice,
    ChatMessage,
    ChatMessageAssistant,
    GenerateConfig,
    ModelAPI,
    ModelOutput,
    ModelUsage,
)
from inspect_ai.tool import ToolCall, ToolChoice, ToolInfo

__all__ = ["TinkerModelAPI", "credentials_for", "to_messages"]

DEFAULT_MAX_TOKENS = 1024


def credentials_for(
    credentials_block: str | None = None,
    base_url: str | None = None,
    api_key: str | None = None,
    local_root: str | None = None,
) -> Any:
    """The ``TinkerCredentials`` the flows would use: a saved block, else ``base_url`` (key from
    ``api_key`` or ``TINKER_API_KEY``), else the embedded local server under ``local_root``.

    Raises:
        ValueError: no block of that name.
    """
    from tinker_blocks import TinkerCredentials

    if credentials_block:
        try:
            return TinkerCredentials.load(credentials_block)
        except ValueError as exc:
            raise ValueError(f"no TinkerCredentials block named {credentials_block!r}") from exc
    if base_url:
        return TinkerCredentials(base_url=base_url, api_key=api_key or os.environ.get("TINKER_API_KEY"))
    return TinkerCredentials(local=True, local_root=local_root)


def _tool_call_dict(call: ToolCall) -> dict[str, Any]:
    return {"type": "function", "id": call.id, "function": {"name": call.function, "arguments": call.arguments}}


def to_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """inspect-ai chat messages as our message dicts (text content; tool calls and results)."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text}
        if m.role == "assistant" and m.tool_calls:
            msg["tool_calls"] = [_tool_call_dict(c) for c in m.tool_calls]
        if m.role == "tool":
            msg.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.function)) if v})
        out.append(msg)
    return out


def _tool_schema(tool: ToolInfo) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": tool.description,
            "parameters": tool.parameters.model_dump(exclude_none=True),
        },
    }


def _inspect_tool_calls(calls: list[dict[str, Any]], offset: int) -> list[ToolCall]:
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") or call
        args = fn.get("arguments", {})
        error = None
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError as exc:
                args, error = {}, f"arguments are not JSON: {exc}"
        out.append(
            ToolCall(
                id=str(call.get("id") or f"call_{offset}_{i}"),
                function=str(fn.get("name", "")),
                arguments=args if isinstance(args, dict) else {"value": args},
                parse_error=error,
            )
        )
    return out


def _cut_at_stops(text: str, stops: list[str] | None) -> tuple[str, bool]:
    cuts = [text.find(s) for s in (stops or []) if s and s in text]
    return (text[: min(cuts)], True) if cuts else (text, False)


class TinkerModelAPI(ModelAPI):
    """inspect-ai model API for Tinker (see the module docstring for model args)."""

    def __init__(
        self,
        model_name: str,
        base_url: str | None = None,
        api_key: str | None = None,
        config: GenerateConfig = GenerateConfig(),  # noqa: B008 (inspect-ai API)
        *,
        renderer: str = "auto",
        credentials_block: str | None = None,
        local_root: str | None = None,
        max_connections: int = 8,
        **model_args: Any,
    ) -> None:
        super().__init__(model_name, base_url, api_key, ["TINKER_API_KEY"], config)
        if model_args:
            raise ValueError(
                f"unknown model args for tinker/: {sorted(model_args)}; accepted: renderer, "
                "credentials_block, local_root, max_connections (the server URL: --model-base-url)"
            )
        # Clients are made on the first generate: inspect also builds providers only to look up model
        # info (get_model_info), which must not start or connect to a server.
        self._settings = (credentials_block, base_url, self.api_key, local_root)
        self._renderer_name = renderer
        self._max_connections = int(max_connections)
        self._client: Any = None
        self._renderer: Any = None
        self._lock = threading.Lock()

    def _ensure(self) -> Any:
        """The renderer, creating the sampling client and renderer on first use (blocking)."""
        with self._lock:
            if self._client is None:
                from prefect_tinker.recipes.evals.sampler_tokenizer import sampler_tokenizer
                from prefect_tinker.recipes.renderers import get_renderer

                service = credentials_for(*self._settings).get_client()
                name = self.model_name
                if name.startswith("tinker://"):
                    future = service.create_sampling_client(model_path=name)
                else:
                    future = service.create_sampling_client(base_model=name.removeprefix("base:"))
                client = future.result()
                self._renderer = get_renderer(self._renderer_name, sampler_tokenizer(service, client))
                self._client = client
            return self._renderer

    def max_connections(self) -> int:
        return self._max_connections

    def _sample(self, prompt: tinker.ModelInput, n: int, params: tinker.SamplingParams) -> Any:
        return self._client.sample(prompt=prompt, num_samples=n, sampling_params=params).result()

    async def generate(
        self, input: list[ChatMessage], tools: list[ToolInfo], tool_choice: ToolChoice, config: GenerateConfig
    ) -> ModelOutput:
        r = await anyio.to_thread.run_sync(self._ensure)
        schemas = [_tool_schema(t) for t in tools] or None
        prompt = r.build_generation_prompt(to_messages(input), tools=schemas)
        stop = r.get_stop_sequences()
        if config.stop_seqs and all(isinstance(s, str) for s in stop):
            stop = list(stop) + list(config.stop_seqs)  # string stops: let the server stop early too
        params = tinker.SamplingParams(
            max_tokens=config.max_tokens or DEFAULT_MAX_TOKENS,
            temperature=1.0 if config.temperature is None else config.temperature,
            top_p=1.0 if config.top_p is None else config.top_p,
            top_k=-1 if config.top_k is None else config.top_k,
            seed=config.seed,
            stop=stop,
        )
        n = config.num_choices or 1
        resp = await anyio.to_thread.run_sync(functools.partial(self._sample, prompt, n, params))
        choices, out_tokens = [], 0
        for i, seq in enumerate(resp.sequences):
            out_tokens += len(seq.tokens)
            parsed = r.parse_response(list(seq.tokens))
            text, cut = _cut_at_stops(parsed.message.get("content") or "", config.stop_seqs)
            calls = _inspect_tool_calls(parsed.message.get("tool_calls") or [], i) if tools else []
            if calls:
                reason = "tool_calls"
            elif parsed.termination.value == "truncated" and not cut:
                reason = "max_tokens"
            else:
                reason = "stop"
            message = ChatMessageAssistant(
                content=text, tool_calls=calls or None, model=self.model_name, source="generate"
            )
            choices.append(ChatCompletionChoice(message=message, stop_reason=reason))
        n_in = prompt.length
        return ModelOutput(
            model=self.model_name,
            choices=choices,
            usage=ModelUsage(input_tokens=n_in, output_tokens=out_tokens, total_tokens=n_in + out_tokens),
        )
