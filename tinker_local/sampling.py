"""Autoregressive sampling with a KV cache, in fp32, for the local engine.

``sample_tokens`` runs one prefill over the prompt (batch 1), repeats the cache ``num_samples``
times and decodes all samples in one batch.  The returned per-token logprobs are those of the
model's own distribution (temperature 1, before top-k/top-p filtering) — the same numbers a
``forward`` over the sampled sequence gives (fp32: within ~1e-5) — so they can serve directly as
the behaviour logprobs ``q`` of importance-sampling losses.

Random draws use a CPU ``torch.Generator`` seeded with ``seed``: the same model, prompt,
parameters and seed give the same samples on any device.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch

from .errors import EngineUserError


@dataclass
class StopSpec:
    """Stop conditions: token ids (the stop token is kept in the output) and strings (matched in
    the decoded sampled text; the output ends with the token completing the string)."""

    token_ids: frozenset[int]
    strings: tuple[str, ...]


def make_stop_spec(stop, eos_ids: set[int]) -> StopSpec:
    """Normalise Tinker's ``stop``: None -> the model's ``eos_ids``; ``[]`` -> never stop early;
    a str / int or a list mixing strings (matched in decoded text) and token ids.
    EngineUserError for any other entry."""
    if stop is None:
        return StopSpec(frozenset(eos_ids), ())
    if isinstance(stop, (str, int)) and not isinstance(stop, bool):
        stop = [stop]
    ids, strs = set(), []
    for s in stop:
        if isinstance(s, str):
            if s:
                strs.append(s)
        elif isinstance(s, (int, np.integer)) and not isinstance(s, bool):
            ids.add(int(s))
        else:
            raise EngineUserError(f"stop entries must be strings or token ids, got {s!r}")
    return StopSpec(frozenset(ids), tuple(strs))


def _cache_kwarg(model) -> str:
    """Name of the KV-cache argument of ``model.forward`` (transformers 5.x: ``cache``)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _out_cache(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def _choose(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
            gen: torch.Generator) -> torch.Tensor:
    """Draw one token per row from fp32 CPU ``logits`` (S, V); returns int64 (S,)."""
    if temperature <= 0.0:
        return logits.argmax(dim=-1)
    scaled = logits / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly before each token
        drop_sorted = before >= top_p
        drop_sorted[:, 0] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def sample_tokens(model, tokenizer, prompt: list[int], *, num_samples: int, max_tokens: int,
                  temperature: float, top_k: int, top_p: float, seed: int, stop: StopSpec,
                  device: torch.device, prompt_logprobs: bool = False,
                  topk_prompt_logprobs: int = 0, decode_threads: int | None = None) -> dict:
    """Sample ``num_samples`` continuations of ``prompt`` (token ids, len P >= 1).

    Returns ``{"sequences": [{"tokens": [...], "logprobs": [...], "stop_reason": "stop"|"length"}],
    "prompt_logprobs": list (len P, entry 0 None) | None, "topk_prompt_logprobs": list of
    (len P, entry 0 None, others [(token_id, logprob)] * k) | None}``.
    The caller handles autocast (none: fp32) and adapter selection.  ``decode_threads``: torch
    threads for the token-by-token phase (the prefill keeps the caller's setting); small decode
    steps run faster on one thread, since OpenMP synchronisation dominates them.
    """
    ids = torch.tensor([prompt], dtype=torch.long, device=device)
    want_prompt = prompt_logprobs or topk_prompt_logprobs > 0
    try:
        out = model(input_ids=ids, use_cache=True, logits_to_keep=0 if want_prompt else 1)
    except TypeError:  # architectures without logits_to_keep
        out = model(input_ids=ids, use_cache=True)
    logits = out.logits[0].float()
    result: dict = {"prompt_logprobs": None, "topk_prompt_logprobs": None}
    if want_prompt:
        logp = torch.log_softmax(logits[:-1], dim=-1)  # (P-1, V): position i predicts prompt[i+1]
        if prompt_logprobs:
            tgt = ids[0, 1:].unsqueeze(-1)
            vals = logp.gather(-1, tgt).squeeze(-1).cpu().tolist()
            result["prompt_logprobs"] = [None] + vals
        if topk_prompt_logprobs > 0:
            k = min(topk_prompt_logprobs, logp.shape[-1])
            tv, ti = torch.topk(logp, k, dim=-1)
            tv, ti = tv.cpu().tolist(), ti.cpu().tolist()
            result["topk_prompt_logprobs"] = [None] + [list(zip(i, v)) for i, v in zip(ti, tv)]
    last = logits[-1:].expand(num_samples, -1)  # (S, V)
    cache = _out_cache(out)
    if num_samples > 1 and hasattr(cache, "batch_repeat_interleave"):
        cache.batch_repeat_interleave(num_samples)
    elif num_samples > 1:
        raise RuntimeError("model cache does not support batch_repeat_interleave")

    if decode_threads and device.type == "cpu":
        torch.set_num_threads(decode_threads)
    gen = torch.Generator(device="cpu").manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    toks: list[list[int]] = [[] for _ in range(num_samples)]
    lps: list[list[float]] = [[] for _ in range(num_samples)]
    reasons = ["length"] * num_samples
    done = [False] * num_samples
    window = max((len(s) for s in stop.strings), default=0) * 4 + 8
    for step in range(max_tokens):
        lf = last.float().cpu()
        logp = torch.log_softmax(lf, dim=-1)
        nxt = _choose(lf, temperature, top_k, top_p, gen)
        nlp = logp.gather(-1, nxt.unsqueeze(-1)).squeeze(-1)
        nxt_l, nlp_l = nxt.tolist(), nlp.tolist()
        for i in range(num_samples):
            if done[i]:
                continue
            toks[i].append(nxt_l[i])
            lps[i].append(nlp_l[i])
            if nxt_l[i] in stop.token_ids:
                done[i], reasons[i] = True, "stop"
            elif stop.strings:
                text = tokenizer.decode(toks[i][-window:], skip_special_tokens=False)
                if any(s in text for s in stop.strings):
                    done[i], reasons[i] = True, "stop"
        if all(done) or step == max_tokens - 1:
            break
        out = model(input_ids=nxt.to(device).unsqueeze(-1), use_cache=True, **{_cache_kwarg(model): cache})
        cache = _out_cache(out)
        last = out.logits[:, -1]
    result["sequences"] = [
        {"tokens": toks[i], "logprobs": lps[i], "stop_reason": reasons[i]} for i in range(num_samples)
    ]
    return result
