"""Plain data passed between the engine and its callers (the HTTP server, tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class MediaChunk:
    """A non-text chunk of a model input, as received (decoded by ``tinker_local.media``).

    ``kind``: ``"image"`` (``data``: PNG/JPEG bytes), ``"image_asset_pointer"`` (``location``: a
    local file path or ``file://`` URI of a PNG/JPEG) or ``"dmel"`` (``data``: TensorContainer
    bytes of a uint8 DMel tensor (frames, mel bins)).  ``format``: ``"png"`` | ``"jpeg"`` for
    images.  ``expected_tokens``: the token count the client announced (images; None: not
    checked)."""

    kind: str
    data: bytes | None = None
    location: str | None = None
    format: str | None = None
    expected_tokens: int | None = None


@dataclass
class Datum:
    """One training example.  ``tokens``: model input token ids, length N.  ``inputs``: loss-fn
    inputs as numpy arrays: ``target_tokens`` int64 (N,) or (N, K) (position i predicts
    target_tokens[i]); ``weights`` float32 shaped like target_tokens (cross_entropy; default 1);
    ``logprobs``/``advantages`` float32 (N,) for the RL losses.

    ``chunks``: set when the model input holds media: the chunks in order, each a list of token
    ids or a :class:`MediaChunk` (``tokens`` then holds only the text tokens); N is the length
    after the media are expanded into their token positions (``tinker_local.media``)."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]
    chunks: list[Any] | None = field(default=None)


@dataclass
class FwdResult:
    """``outputs[d]["logprobs"]``: float32 logprobs of datum d's target tokens, shaped like its
    target_tokens.  ``metrics``: ``{"loss:sum": float}`` (keys ``name:reduction``)."""

    outputs: list[dict[str, np.ndarray]]
    metrics: dict[str, float]


@dataclass
class SampleResult:
    """``sequences``: ``[{"tokens": list[int], "logprobs": list[float], "stop_reason": "stop" |
    "length"}]`` (one per sample); ``prompt_logprobs``: list of length P with entry 0 None, or
    None; ``topk_prompt_logprobs``: list of length P (entry 0 None) of ``[(token_id, logprob)]``.
    ``target_prompt_logprobs``: float32 (P - 1, K) logprobs of the requested ids (0.0 where the
    id was -1), or None.  ``prompt_alt_tokens``: (token ids int64, logprobs float32), both
    (P - 1, k), or None.  ``prompt_cache_hit_tokens``: prompt tokens served by another request's
    prefill in the same batch (``tinker_local.sampling``)."""

    sequences: list[dict[str, Any]]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    target_prompt_logprobs: np.ndarray | None = None
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None
    prompt_cache_hit_tokens: int = 0
