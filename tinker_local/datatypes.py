"""Plain data passed between the engine and its callers (the HTTP server, tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Datum:
    """One training example.  ``tokens``: model input token ids, length N.  ``inputs``: loss-fn
    inputs as numpy arrays: ``target_tokens`` int64 (N,) or (N, K) (position i predicts
    target_tokens[i]); ``weights`` float32 shaped like target_tokens (cross_entropy; default 1);
    ``logprobs``/``advantages`` float32 (N,) for the RL losses."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


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
    None; ``topk_prompt_logprobs``: list of length P (entry 0 None) of ``[(token_id, logprob)]``."""

    sequences: list[dict[str, Any]]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
