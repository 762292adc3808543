"""The model a capture server serves: a Tinker sampling client, its tokenizer and renderer.

Sampling goes through the official SDK (``SamplingClient.sample``, awaited), so any backend works:
the embedded local server, a self-hosted Tinker-compatible server or the hosted service.
Concurrent requests are issued concurrently; the backend batches them (``tinker_local`` runs
queued sampling requests of one model in one decode loop).
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import tinker

from prefect_tinker.capture.requests import APIError
from prefect_tinker.recipes.renderers import Renderer, get_renderer

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["ModelSource", "ServedModel", "backend_error", "open_served_model"]

logger = logging.getLogger("prefect_tinker.capture")

#: ``max_tokens`` when the client gives none (capped by what the context leaves).
DEFAULT_MAX_TOKENS = 4096


class ModelSource(Protocol):
    """What a capture server serves from: a :class:`ServedModel` (always itself) or a
    :class:`~prefect_tinker.capture.follow.ModelFollower` (the weights an alias names now)."""

    def current(self) -> ServedModel:
        """The model to answer the next request with (kept by that request to its end)."""
        ...

    def start(self) -> None:
        """Called when the server starts serving."""
        ...

    def stop(self) -> None:
        """Called when the server shuts down."""
        ...


@dataclass
class ServedModel:
    """What one capture server samples from.

    Attributes:
        sampler: a ``tinker.SamplingClient``.
        tokenizer: its Hugging Face tokenizer.
        renderer: the renderer turning chat messages into prompt tokens and sampled tokens back
            into assistant messages (tool calls included for renderers with ``supports_tools``).
        checkpoint: what is sampled: a ``tinker://`` path or a base model name (stored per row).
        names: model names clients may put in ``model`` (the first is listed first by /v1/models).
        max_context: the model's context in tokens (prompt + completion), None if unknown
            (then the backend's own limit answers).
        default_max_tokens: ``max_tokens`` when a request gives none.
    """

    sampler: Any
    tokenizer: Any
    renderer: Renderer
    checkpoint: str
    names: tuple[str, ...]
    max_context: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    _decoded: dict[int, str] = field(default_factory=dict, repr=False)

    # ----- a ModelSource that never changes --------------------------------------------------------
    def current(self) -> ServedModel:
        """Itself: the model opened at start answers every request."""
        return self

    def start(self) -> None:
        """Nothing runs in the background (a :class:`ModelSource` may refresh itself)."""

    def stop(self) -> None:
        """Nothing to stop."""

    # ----- requests ------------------------------------------------------------------------------
    def check_model(self, name: str) -> None:
        """Raises APIError 404 ``model_not_found`` unless ``name`` is one of :attr:`names`."""
        if name not in self.names:
            raise APIError(
                404,
                f"The model {name!r} does not exist on this server; it serves {', '.join(repr(n) for n in self.names)}",
                param="model",
                code="model_not_found",
            )

    def max_tokens_for(
        self, prompt_len: int, requested: int | None, *, param: str = "max_tokens", prompt_param: str = "messages"
    ) -> int:
        """The ``max_tokens`` to sample with for a prompt of ``prompt_len`` tokens: ``requested``,
        else :attr:`default_max_tokens` capped by what the context leaves.

        Raises:
            APIError: 400 ``context_length_exceeded`` when the prompt leaves no room (``param`` =
                ``prompt_param``) or ``requested`` does not fit in :attr:`max_context` (``param``).
        """
        if self.max_context is None:
            return requested or self.default_max_tokens
        room = self.max_context - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens, but the "
                f"prompt is {prompt_len} tokens",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if requested is not None and requested > room:
            raise APIError(
                400,
                f"This model's maximum context length is {self.max_context} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                f"{requested} in the completion)",
                param=param,
                code="context_length_exceeded",
            )
        return requested or min(self.default_max_tokens, room)

    def decode(self, tokens: Sequence[int]) -> str:
        """Text of ``tokens`` (special tokens written out)."""
        return self.tokenizer.decode(list(tokens), skip_special_tokens=False)

    def token_text(self, token: int) -> str:
        """Text of one token (cached)."""
        text = self._decoded.get(token)
        if text is None:
            text = self._decoded[token] = self.decode([token])
        return text

    def eos_ids(self) -> set[int]:
        """End-of-sequence ids: the renderer's and the tokenizer's."""
        ids = set(self.renderer.eos_token_ids())
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def chat_stops(self, user_stops: Sequence[str] | None) -> list[str] | list[int]:
        """``SamplingParams.stop`` for a chat request: the renderer's end-of-turn stops and the
        EOS ids, plus the client's stop strings (then everything as strings, since the Tinker
        API takes either strings or token ids)."""
        base: list[str | int] = list(self.renderer.get_stop_sequences())
        extra = [t for t in sorted(self.eos_ids()) if t not in base]
        if not user_stops and all(isinstance(s, int) for s in base):
            return [int(s) for s in base] + extra
        strs = [s if isinstance(s, str) else self.token_text(int(s)) for s in base + extra]
        return list(dict.fromkeys(strs + list(user_stops or [])))

    def completion_stops(self, user_stops: Sequence[str] | None) -> list[str] | None:
        """``SamplingParams.stop`` for a completion request: None (the model's EOS), or the
        client's stop strings plus the EOS token's text."""
        if not user_stops:
            return None
        return list(dict.fromkeys(list(user_stops) + [self.token_text(t) for t in sorted(self.eos_ids())]))

    async def sample(
        self,
        prompt: list[int],
        *,
        n: int,
        max_tokens: int,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        seed: int | None,
        stop: list[str] | list[int] | None,
        topk: int = 0,
        prompt_logprobs: bool = False,
        topk_prompt: int = 0,
    ) -> Any:
        """Sample ``n`` sequences for ``prompt`` (token ids); returns the SDK's ``SampleResponse``.

        Raises:
            APIError: see :func:`backend_error`.
        """
        params = tinker.SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if temperature is None else float(temperature),
            top_p=1.0 if top_p is None else float(top_p),
            top_k=-1 if not top_k else int(top_k),
            seed=seed,
            stop=stop,
        )
        try:
            return await self.sampler.sample_async(
                prompt=tinker.ModelInput.from_ints(prompt),
                num_samples=n,
                sampling_params=params,
                include_prompt_logprobs=prompt_logprobs,
                topk_prompt_logprobs=topk_prompt,
                topk_sample_logprobs=topk,
            )
        except Exception as exc:
            raise backend_error(exc) from exc


_SUFFIX = re.compile(r"\s+for self\.request_id=.*$", re.S)


def backend_error(exc: BaseException) -> APIError:
    """An SDK failure as an APIError: the backend's user errors (bad parameters, a prompt too long
    for the context) become 400 with the backend's message; anything else 502 ``server_error``."""
    category = str(getattr(exc, "category", "") or "").lower()
    status = getattr(exc, "status_code", None)
    message = _SUFFIX.sub("", str(exc)).removeprefix("Request failed: ")
    if category.endswith("user") or (isinstance(status, int) and 400 <= status < 500 and status not in (408, 429)):
        code = "context_length_exceeded" if "context" in message and "exceed" in message else None
        return APIError(400, f"the sampler refused the request: {message}", code=code)
    logger.warning("sampling failed: %s: %s", type(exc).__name__, message)
    return APIError(
        502,
        f"sampling failed on the backend: {type(exc).__name__}: {message}",
        type="server_error",
        code="backend_error",
    )


def _context_from_capabilities(credentials: TinkerCredentials, base_model: str) -> int | None:
    try:
        with warnings.catch_warnings():  # ServiceClient's copy of RestClient's call: same server, same key
            warnings.simplefilter("ignore", FutureWarning)
            caps = credentials.get_client().get_server_capabilities()
    except Exception:  # older or hosted servers may not list models: not fatal
        return None
    for m in caps.supported_models or []:
        if m.model_name in (base_model, Path(base_model).name) and m.max_context_length:
            return int(m.max_context_length)
    return None


def _context_from_files(tokenizer: Any) -> int | None:
    """``max_position_embeddings`` of a local model folder next to the tokenizer, if any."""
    cfg = Path(str(getattr(tokenizer, "name_or_path", "") or "")) / "config.json"
    try:
        value = json.loads(cfg.read_text()).get("max_position_embeddings")
    except (OSError, ValueError):
        return None
    return int(value) if isinstance(value, int) and value > 0 else None


def _load_tokenizer(sampler: Any, model: str, tokenizer: str | None, cache_dir: str | None) -> Any:
    from prefect_tinker.recipes.tokenizers import resolve_tokenizer

    if tokenizer:
        return resolve_tokenizer(tokenizer, cache_dir)
    try:
        return sampler.get_tokenizer()
    except Exception as exc:  # e.g. a local preset name the SDK cannot load by itself
        try:
            return resolve_tokenizer(sampler.get_base_model() if model.startswith("tinker://") else model, cache_dir)
        except ValueError:
            raise ValueError(
                f"cannot load the tokenizer of {model!r} ({type(exc).__name__}: {exc}); give --tokenizer DIR"
            ) from None


def open_served_model(
    credentials: TinkerCredentials,
    model: str,
    *,
    renderer: str = "auto",
    tokenizer: str | None = None,
    names: Sequence[str] = (),
    max_context: int | None = None,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
) -> ServedModel:
    """Create the sampling client for ``model`` and resolve tokenizer, renderer and context.

    Args:
        credentials: a ``TinkerCredentials`` block.
        model: a base model name (``tiny``, a HF id or directory) or a ``tinker://`` sampler path.
        renderer: a renderer name or ``auto`` (:func:`~prefect_tinker.recipes.renderers.get_renderer`).
        tokenizer: a tokenizer directory / preset / cached HF id overriding the sampler's.
        names: served model names (default: ``model`` itself).
        max_context: context length override; else from the server's capabilities, else the
            model folder's ``config.json``.

    Raises:
        ValueError / RendererError: unknown renderer, tokenizer not loadable; SDK errors for an
        unreachable backend or an unknown checkpoint.
    """
    from prefect_tinker.tasks.clients import sampling_client

    sampler = sampling_client(credentials, model if model.startswith("tinker://") else f"base:{model}")
    cache_dir = str(credentials.resolved_local_root())
    tok = _load_tokenizer(sampler, model, tokenizer, cache_dir)
    rend = get_renderer(renderer, tok)
    ctx = max_context or _context_from_capabilities(credentials, sampler.get_base_model()) or _context_from_files(tok)
    return ServedModel(
        sampler=sampler,
        tokenizer=tok,
        renderer=rend,
        checkpoint=model,
        names=tuple(dict.fromkeys([*names, model])) if names else (model,),
        max_context=ctx,
        default_max_tokens=default_max_tokens,
    )
