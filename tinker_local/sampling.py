"""Autoregressive sampling with a KV cache for the local engine (fp32, or the decoder under bf16
autocast with bf16 weights; the output head and logprobs always fp32).

``sample_batch`` serves several requests (each: a prompt, ``num_samples``, its own sampling
parameters, seed and stop conditions) with one forward per step: one prefill over all prompts
(left-padded to the longest, with an attention mask and explicit positions when lengths differ),
then the cache rows are repeated ``num_samples`` times per request and all samples decode
together; a request that is done leaves the batch (its cache rows are dropped).

Prefix reuse: requests of one batch with the same prompt share one prefill row (the
``num_samples`` of a request always share theirs), so a GRPO group sent as separate requests is
prefilled once; each result says how many of its prompt tokens were served by another request's
prefill (``prompt_cache_hit_tokens``, counted once per request, not per sample).

The returned per-token logprobs are those of the model's own distribution (temperature 1, before
top-k/top-p filtering) — the same numbers a ``forward`` over the sampled sequence gives (fp32:
within ~1e-5) — so they can serve directly as the behaviour logprobs ``q`` of importance-sampling
losses.  Random draws use one ``torch.Generator`` per request on the compute device, seeded
with its ``seed`` and consumed exactly as if the request ran alone (one uniform number per sampled
row and step, :func:`_choose`): the same model, prompt, parameters and seed give the same samples
in any batch on one kind of device (up to float rounding of padded batches, ~1e-6); a CUDA
generator's stream differs from the CPU's.  Logits, draws and the KV cache stay on the device:
each decode step brings only the drawn tokens and their logprobs (and requested top-k) to the
host.  The cache is written in place into preallocated room (:class:`_GrowingLayer`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer

from .compute import decoder_and_head
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


def _choose(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> torch.Tensor:
    """Draw one token per row from fp32 ``logits`` (S, V) on their device, with ``gen`` (a
    generator of that device); returns int64 (S,).  Temperature 0: the argmax.  Otherwise the
    tokens of ``softmax(logits / temperature)``, restricted to the ``top_k`` most likely and to
    the smallest set holding ``top_p`` of the mass (renormalised), are drawn by inverse transform
    sampling: one uniform ``u`` per row, the first token whose cumulative probability (float64)
    exceeds ``u`` times the total.  That is an exact draw from those probabilities (tokens of
    probability 0 are never drawn) and takes one random number per row, where
    ``torch.multinomial`` takes one per token of the vocabulary (measured: 6 % of a SmolLM2
    decode loop on the CPU)."""
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
    cdf = probs.double().cumsum(dim=-1)
    u = torch.rand((probs.shape[0], 1), generator=gen, dtype=torch.float64, device=probs.device)
    nxt = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)
    return nxt.clamp_(max=probs.shape[-1] - 1).squeeze(-1)


class _GrowingLayer(DynamicLayer):
    """A ``transformers`` ``DynamicLayer`` whose keys and values live in preallocated room: each
    decode step writes its new entries in place instead of concatenating the whole cache again
    (``torch.cat`` per layer and step: 10 % of a SmolLM2 decode loop on the CPU); the room
    doubles when full.  ``keys`` / ``values`` are views of the filled part."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
        super().__init__()
        self.device = keys.device
        self._n = keys.shape[-2]
        self._k = self._alloc(keys, self._n + room)
        self._v = self._alloc(values, self._n + room)
        self.is_initialized = True
        self._views()

    @staticmethod
    def _alloc(x: torch.Tensor, size: int) -> torch.Tensor:
        buf = x.new_empty((*x.shape[:-2], size, x.shape[-1]))
        buf[..., : x.shape[-2], :] = x
        return buf

    def _views(self) -> None:
        self.keys, self.values = self._k[..., : self._n, :], self._v[..., : self._n, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        t = key_states.shape[-2]
        if self._n + t > self._k.shape[-2]:
            size = 2 * (self._n + t)
            self._k, self._v = self._alloc(self.keys, size), self._alloc(self.values, size)
        self._k[..., self._n : self._n + t, :] = key_states
        self._v[..., self._n : self._n + t, :] = value_states
        self._n += t
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._n

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices.to(self.device)], self._v[indices.to(self.device)]
        self._views()


def _with_room(cache, room: int):
    """``cache`` with its plain ``DynamicLayer`` s replaced by :class:`_GrowingLayer` s holding
    ``room`` more positions (other layer kinds, e.g. sliding windows, are left as they are)."""
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list):
        for i, layer in enumerate(layers):
            if type(layer) is DynamicLayer and layer.is_initialized and layer.keys is not None and layer.keys.ndim == 4:
                layers[i] = _GrowingLayer(layer.keys, layer.values, room)
    return cache


@dataclass
class SampleRequest:
    """One request for ``sample_batch``: ``prompt`` token ids (len P >= 1), ``num_samples`` >= 1,
    ``max_tokens`` >= 1 new tokens, ``temperature`` (0 = greedy), ``top_k`` (<= 0: off),
    ``top_p`` in (0, 1], ``seed`` (int), ``stop`` conditions, whether to return the prompt's
    logprobs (``prompt_logprobs``) and its top-``topk_prompt_logprobs`` alternatives, and the
    top-``topk_sample_logprobs`` alternatives at each sampled position.
    ``prompt_logprobs_last_n``: only the last N prompt logprobs are wanted (the prefill keeps the
    logits of the last N + 1 positions of the batch; earlier entries may come back None)."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: StopSpec
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    media: list | None = None  # payloads of the prompt's media (tinker_local.media); sampled alone
    target_prompt: np.ndarray | None = None  # int64 (P - 1, K) token ids to score; -1 = none
    prompt_alt_k: int = 0  # draws per prompt position (SampleRequest.prompt_alt_tokens_k)

    @property
    def wants_prompt(self) -> bool:
        return (
            self.prompt_logprobs
            or self.topk_prompt_logprobs > 0
            or self.target_prompt is not None
            or self.prompt_alt_k > 0
        )

    @property
    def logit_positions(self) -> int | None:
        """Positions (from the end of the prompt) whose prefill logits this request needs: 1 (the
        next token's), ``last_n + 1``, or None (all: every prompt logprob)."""
        if not self.wants_prompt:
            return 1
        if self.target_prompt is not None or self.prompt_alt_k > 0:  # every prompt position
            return None
        return None if self.prompt_logprobs_last_n is None else self.prompt_logprobs_last_n + 1


def kept_positions(reqs: list[SampleRequest], longest: int) -> int:
    """Prompt positions (from the end) whose logits the prefill keeps: the most any request needs
    (:attr:`SampleRequest.logit_positions`), 0 meaning all ``longest``."""
    need = [r.logit_positions for r in reqs]
    known = [n for n in need if n is not None]
    if len(known) < len(need) or max(known) >= longest:
        return 0
    return max(known)


def _split_parts(model) -> tuple[Any, Any, str] | None:
    """``(decoder, output head, the decoder's KV-cache argument name)`` of a llama-like model
    (``tinker_local.compute.decoder_and_head``), or None for others; looked up once per batch."""
    parts = decoder_and_head(model)
    if parts is None:
        return None
    decoder, head = parts
    return decoder, head, _cache_kwarg(decoder)


def _forward(model, ids: torch.Tensor, keep: int, kw: dict, parts: tuple[Any, Any, str] | None) -> tuple:
    """One forward with the KV cache -> (its cache, fp32 logits (B, K, V) of the last K positions;
    K = ``keep``, or all when 0).  With ``parts`` (``_split_parts``), llama-like models run the
    decoder (under the ambient autocast, if any) and then the output head in fp32 on the kept
    positions only; with None (other models, and media models, whose extra inputs and positions
    only the whole model handles) the model's own forward with ``logits_to_keep``."""
    if parts is not None:
        decoder, head, cache_name = parts
        rest = dict(kw)
        for name in ("cache", "past_key_values"):  # the whole model's name for it -> the decoder's
            if name in rest:
                rest[cache_name] = rest.pop(name)
        out = decoder(input_ids=ids, use_cache=True, **rest)
        hidden = out.last_hidden_state
        hidden = hidden if keep == 0 else hidden[:, -keep:]
        with torch.autocast(ids.device.type, enabled=False):
            return _out_cache(out), head(hidden.float()).float()
    try:
        out = model(input_ids=ids, use_cache=True, logits_to_keep=keep, **kw)
    except TypeError:  # architectures without logits_to_keep
        out = model(input_ids=ids, use_cache=True, **kw)
    logits = out.logits if keep == 0 or out.logits.shape[1] == keep else out.logits[:, -keep:]
    return _out_cache(out), logits.float()


ALT_SEED_OFFSET = 0x9E3779B97F4A7C15  # prompt_alt draws use their own generator: samples stay as without them


def _prompt_outputs(req: SampleRequest, logits: torch.Tensor, first: int) -> dict:
    """Prompt logprobs from ``logits`` (P - first, V): those of one unpadded prompt's positions
    ``first .. P-1``; entries ``0 .. first`` are None.  ``target_prompt_logprobs``: float32
    (P - 1, K), the logprob of each requested id at its position, 0.0 where the id is -1.
    ``prompt_alt_tokens``: (ids int64, logprobs float32), both (P - 1, k): k independent draws per
    position at the request's temperature (greedy: the argmax k times), with their temperature-1
    logprobs; drawn from a generator seeded with ``seed + ALT_SEED_OFFSET``."""
    out: dict = {
        "prompt_logprobs": None,
        "topk_prompt_logprobs": None,
        "target_prompt_logprobs": None,
        "prompt_alt_tokens": None,
    }
    if not req.wants_prompt:
        return out
    pad = [None] * (first + 1)
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)  # row i predicts prompt[first + i + 1]
    if req.prompt_logprobs:
        tgt = torch.tensor(req.prompt[first + 1 :], dtype=torch.long, device=logp.device).unsqueeze(-1)
        out["prompt_logprobs"] = pad + logp.gather(-1, tgt).squeeze(-1).cpu().tolist()
    if req.topk_prompt_logprobs > 0:
        k = min(req.topk_prompt_logprobs, logp.shape[-1])
        tv, ti = torch.topk(logp, k, dim=-1)
        out["topk_prompt_logprobs"] = pad + [
            list(zip(i, v, strict=True)) for i, v in zip(ti.cpu().tolist(), tv.cpu().tolist(), strict=True)
        ]
    if req.target_prompt is not None:  # first == 0 here (logit_positions is None)
        ids = torch.as_tensor(req.target_prompt, dtype=torch.long, device=logp.device)
        vals = logp.gather(-1, ids.clamp(min=0))
        out["target_prompt_logprobs"] = torch.where(ids >= 0, vals, torch.zeros_like(vals)).cpu().numpy()
    if req.prompt_alt_k > 0:
        lf = logp.cpu()
        if req.temperature <= 0.0:
            draws = lf.argmax(dim=-1, keepdim=True).expand(-1, req.prompt_alt_k)
        else:
            gen = torch.Generator(device="cpu").manual_seed((int(req.seed) + ALT_SEED_OFFSET) & 0xFFFF_FFFF_FFFF_FFFF)
            probs = torch.softmax(logits[:-1].float().cpu() / req.temperature, dim=-1)
            draws = torch.multinomial(probs, req.prompt_alt_k, replacement=True, generator=gen)
        out["prompt_alt_tokens"] = (draws.numpy().astype(np.int64), lf.gather(-1, draws).numpy())
    return out


@torch.no_grad()
def sample_batch(
    model,
    tokenizer,
    reqs: list[SampleRequest],
    *,
    device: torch.device,
    decode_threads: int | None = None,
    prefill_extra: dict | None = None,
    text_only: bool = True,
) -> list[dict]:
    """Serve ``reqs`` together; returns one dict per request, in order:
    ``{"sequences": [{"tokens": [...], "logprobs": [...], "stop_reason": "stop"|"length",
    "topk_logprobs": [[(token_id, logprob)] * k] per token | None}] * num_samples,
    "prompt_logprobs": list (len P, entry 0 None) | None, "topk_prompt_logprobs":
    list (len P, entry 0 None, others [(token_id, logprob)] * k) | None,
    "target_prompt_logprobs": float32 (P - 1, K) | None, "prompt_alt_tokens": (int64, float32)
    (P - 1, k) | None, "prompt_cache_hit_tokens": int}`` (see ``_prompt_outputs`` and the module
    docstring).

    The caller handles autocast (none: fp32), adapter selection and batch sizes (the prefill
    holds ``len(reqs) x max P`` tokens, and the logits of every position when any request wants
    prompt logprobs, of the last ``max(last_n) + 1`` when all those want only their last N).
    ``decode_threads``: torch threads for the token-by-token phase (small decode steps run
    faster on one thread, since OpenMP synchronisation dominates them).
    ``prefill_extra``: more keyword arguments of the prefill forward (pixel values, DMel frames).
    ``text_only``: False for media models (then every step runs the model's own forward).
    Raises RuntimeError if the model's KV cache cannot select batch rows.
    """
    B = len(reqs)
    owner: list[int] = []  # request -> its prefill row (requests with one prompt share it)
    first_of: dict[tuple[int, ...], int] = {}
    for r in reqs:
        owner.append(first_of.setdefault(tuple(r.prompt), len(first_of)))
    uniq = [list(p) for p in first_of]
    U = len(uniq)
    lens = [len(p) for p in uniq]
    L = max(lens)
    padded = min(lens) != L
    ids = torch.zeros((U, L), dtype=torch.long)
    mask = torch.zeros((U, L), dtype=torch.long)
    for u, p in enumerate(uniq):
        ids[u, L - lens[u] :] = torch.tensor(p, dtype=torch.long)
        mask[u, L - lens[u] :] = 1
    extra: dict = {}
    if padded:  # left padding: masked pads, positions counted from each prompt's first token
        extra = {"attention_mask": mask.to(device), "position_ids": (mask.cumsum(-1) - 1).clamp(min=0).to(device)}
    extra.update(prefill_extra or {})  # media of a single prompt (tinker_local.media.prefill_kwargs)
    parts = _split_parts(model) if prefill_extra is None and text_only else None
    cache, logits = _forward(model, ids.to(device), kept_positions(reqs, L), extra, parts)
    K = logits.shape[1]  # the kept logits cover padded positions L - K .. L - 1
    results = []
    seen: set[int] = set()
    for i, r in enumerate(reqs):
        u = owner[i]
        start = max(L - K, L - lens[u])  # first kept position of prompt u (padded coordinates)
        res = _prompt_outputs(r, logits[u, start - (L - K) :], start - (L - lens[u]))
        res["prompt_cache_hit_tokens"] = lens[u] if u in seen else 0
        seen.add(u)
        results.append(res)

    counts = [r.num_samples for r in reqs]
    rows = torch.repeat_interleave(torch.tensor(owner, dtype=torch.long), torch.tensor(counts))
    if not hasattr(cache, "reorder_cache"):
        raise RuntimeError("model cache does not support selecting batch rows")
    if not torch.equal(rows, torch.arange(U)):
        cache.reorder_cache(rows.to(device))
    cache = _with_room(cache, min(max(r.max_tokens for r in reqs), 256))
    last = logits[:, -1][rows.to(logits.device)]  # (R, V)
    att = mask[rows].to(device) if padded else None  # (R, L + steps)
    pos = torch.tensor(lens, dtype=torch.long)[rows].unsqueeze(-1).to(device) if padded else None  # (R, 1)

    if decode_threads and device.type == "cpu":
        torch.set_num_threads(decode_threads)
    gens = [torch.Generator(device=device).manual_seed(int(r.seed) & 0xFFFF_FFFF_FFFF_FFFF) for r in reqs]
    toks: list[list[list[int]]] = [[[] for _ in range(n)] for n in counts]
    lps: list[list[list[float]]] = [[[] for _ in range(n)] for n in counts]
    # top-k (token, logprob) per sampled position
    tops: list[list[list[list[tuple[int, float]]]]] = [[[] for _ in range(n)] for n in counts]
    reasons = [["length"] * n for n in counts]
    done = [[False] * n for n in counts]
    windows = [max((len(s) for s in r.stop.strings), default=0) * 4 + 8 for r in reqs]
    active = list(range(B))  # requests still decoding, in row order
    kw = _cache_kwarg(model)
    step = 0
    while True:
        lf = last.float()  # (R, V) on the device: only the draws and their logprobs come to the host
        logp = torch.log_softmax(lf, dim=-1)
        nxt_rows = torch.empty(lf.shape[0], dtype=torch.long, device=lf.device)
        a = 0
        for i in active:
            r, b = reqs[i], a + counts[i]
            nxt_rows[a:b] = _choose(lf[a:b], r.temperature, r.top_k, r.top_p, gens[i])
            a = b
        drawn = nxt_rows.tolist()
        drawn_lp = logp.gather(-1, nxt_rows.unsqueeze(-1)).squeeze(-1).tolist()
        keep: list[int] = []
        keep_rows: list[int] = []
        a = 0
        for i in active:
            r, b = reqs[i], a + counts[i]
            top = None
            if r.topk_sample_logprobs > 0:  # same temperature-1 logprobs as the sampled ones
                tv, ti = torch.topk(logp[a:b], min(r.topk_sample_logprobs, logp.shape[-1]), dim=-1)
                top = [list(zip(ids, vs, strict=True)) for ids, vs in zip(ti.tolist(), tv.tolist(), strict=True)]
            for j in range(counts[i]):
                if done[i][j]:
                    continue
                t = drawn[a + j]
                toks[i][j].append(t)
                lps[i][j].append(drawn_lp[a + j])
                if top is not None:
                    tops[i][j].append(top[j])
                if t in r.stop.token_ids:
                    done[i][j], reasons[i][j] = True, "stop"
                elif r.stop.strings:
                    text = tokenizer.decode(toks[i][j][-windows[i] :], skip_special_tokens=False)
                    if any(s in text for s in r.stop.strings):
                        done[i][j], reasons[i][j] = True, "stop"
            if not (all(done[i]) or step >= r.max_tokens - 1):
                keep.append(i)
                keep_rows.extend(range(a, b))
            a = b
        if not keep:
            break
        if len(keep) < len(active):  # drop the rows of finished requests from the batch
            sel = torch.tensor(keep_rows, dtype=torch.long, device=device)
            cache.batch_select_indices(sel)
            nxt_rows = nxt_rows[sel]
            att = att[sel] if att is not None else None
            pos = pos[sel] if pos is not None else None
            active = keep
        step_kw: dict = {kw: cache}
        if att is not None and pos is not None:  # both set for padded prompts
            att = torch.cat([att, torch.ones((att.shape[0], 1), dtype=att.dtype, device=device)], dim=-1)
            step_kw.update(attention_mask=att, position_ids=pos)
            pos = pos + 1
        cache, step_logits = _forward(model, nxt_rows.unsqueeze(-1), 1, step_kw, parts)
        last = step_logits[:, -1]
        step += 1
    for i, res in enumerate(results):
        k = reqs[i].topk_sample_logprobs
        res["sequences"] = [
            {
                "tokens": toks[i][j],
                "logprobs": lps[i][j],
                "stop_reason": reasons[i][j],
                "topk_logprobs": tops[i][j] if k > 0 else None,
            }
            for j in range(counts[i])
        ]
    return results
