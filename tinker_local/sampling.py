"""Autoregressive sampling with a KV cache, in fp32, for the local engine.

``sample_batch`` serves several requests (each: a prompt, ``num_samples``, its own sampling
parameters, seed and stop conditions) with one forward per step: one prefill over all prompts
(left-padded to the longest, with an attention mask and explicit positions when lengths differ),
then the cache rows are repeated ``num_samples`` times per request and all samples decode
together; a request that is done leaves the batch (its cache rows are dropped).

The returned per-token logprobs are those of the model's own distribution (temperature 1, before
top-k/top-p filtering) — the same numbers a ``forward`` over the sampled sequence gives (fp32:
within ~1e-5) — so they can serve directly as the behaviour logprobs ``q`` of importance-sampling
losses.  Random draws use one CPU ``torch.Generator`` per request, seeded with its ``seed`` and
consumed exactly as if the request ran alone: the same model, prompt, parameters and seed give
the same samples on any device and in any batch (up to float rounding of padded batches, ~1e-6).
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


@dataclass
class SampleRequest:
    """One request for ``sample_batch``: ``prompt`` token ids (len P >= 1), ``num_samples`` >= 1,
    ``max_tokens`` >= 1 new tokens, ``temperature`` (0 = greedy), ``top_k`` (<= 0: off),
    ``top_p`` in (0, 1], ``seed`` (int), ``stop`` conditions, and whether to return the prompt's
    logprobs (``prompt_logprobs``) and its top-``topk_prompt_logprobs`` alternatives."""

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

    @property
    def wants_prompt(self) -> bool:
        return self.prompt_logprobs or self.topk_prompt_logprobs > 0


def _prefill(model, ids: torch.Tensor, keep_all: bool, extra: dict):
    try:
        return model(input_ids=ids, use_cache=True, logits_to_keep=0 if keep_all else 1, **extra)
    except TypeError:  # architectures without logits_to_keep
        return model(input_ids=ids, use_cache=True, **extra)


def _prompt_outputs(req: SampleRequest, logits: torch.Tensor) -> dict:
    """Prompt logprobs from ``logits`` (P, V) of one unpadded prompt."""
    out: dict = {"prompt_logprobs": None, "topk_prompt_logprobs": None}
    if not req.wants_prompt:
        return out
    logp = torch.log_softmax(logits[:-1].float(), dim=-1)  # (P-1, V): row i predicts prompt[i+1]
    if req.prompt_logprobs:
        tgt = torch.tensor(req.prompt[1:], dtype=torch.long, device=logp.device).unsqueeze(-1)
        out["prompt_logprobs"] = [None] + logp.gather(-1, tgt).squeeze(-1).cpu().tolist()
    if req.topk_prompt_logprobs > 0:
        k = min(req.topk_prompt_logprobs, logp.shape[-1])
        tv, ti = torch.topk(logp, k, dim=-1)
        out["topk_prompt_logprobs"] = [None] + [list(zip(i, v)) for i, v in
                                                zip(ti.cpu().tolist(), tv.cpu().tolist())]
    return out


def _left_pad(x: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    """``x`` padded with zeros at the start of ``dim`` to ``length``."""
    extra = length - x.shape[dim]
    if extra <= 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class _Batch:
    """The decoding state of ``sample_batch``: requests (in admission order), their per-sample
    tokens / logprobs / stop state, and the rows of the running batch (``active`` requests in
    row order, ``counts[i]`` rows each): KV ``cache``, next-token logits ``last`` (R, V), and,
    once any row is left-padded, the attention mask ``att`` (R, L) and next positions ``pos``
    (R, 1)."""

    def __init__(self, model, tokenizer, device: torch.device, on_done):
        self.model, self.tokenizer, self.device, self.on_done = model, tokenizer, device, on_done
        self.reqs: list[SampleRequest] = []
        self.results: list[dict] = []
        self.gens, self.toks, self.lps, self.reasons, self.done, self.steps = [], [], [], [], [], []
        self.active: list[int] = []
        self.cache = self.last = self.att = self.pos = None
        self.kw = _cache_kwarg(model)

    @property
    def rows(self) -> int:
        return sum(self.reqs[i].num_samples for i in self.active)

    def can_join(self) -> bool:
        """Whether requests can join now: every cache layer is a plain (full) DynamicLayer."""
        layers = getattr(self.cache, "layers", None)
        return bool(layers) and all(type(la).__name__ == "DynamicLayer" for la in layers)

    def add(self, reqs: list[SampleRequest]) -> None:
        """Prefill ``reqs`` (left-padded together) and append their rows to the batch."""
        B, lens = len(reqs), [len(r.prompt) for r in reqs]
        L = max(lens)
        ids = torch.zeros((B, L), dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, r in enumerate(reqs):
            ids[i, L - lens[i]:] = torch.tensor(r.prompt, dtype=torch.long)
            mask[i, L - lens[i]:] = 1
        padded = min(lens) != L
        extra = {"attention_mask": mask.to(self.device),
                 "position_ids": (mask.cumsum(-1) - 1).clamp(min=0).to(self.device)} if padded else {}
        out = _prefill(self.model, ids.to(self.device), any(r.wants_prompt for r in reqs), extra)
        counts = [r.num_samples for r in reqs]
        rows = torch.repeat_interleave(torch.arange(B), torch.tensor(counts))
        cache = _out_cache(out)
        if not hasattr(cache, "reorder_cache"):
            raise RuntimeError("model cache does not support selecting batch rows")
        if B > 1 or counts[0] > 1:
            cache.reorder_cache(rows.to(self.device))
        last = out.logits[:, -1][rows.to(out.logits.device)]
        att = mask[rows] if padded else None
        pos = torch.tensor(lens, dtype=torch.long)[rows].unsqueeze(-1) if padded else None
        first = len(self.reqs)
        for i, r in enumerate(reqs):
            self.reqs.append(r)
            self.results.append(_prompt_outputs(r, out.logits[i, L - lens[i]:]))
            self.gens.append(torch.Generator(device="cpu").manual_seed(int(r.seed) & 0xFFFF_FFFF_FFFF_FFFF))
            self.toks.append([[] for _ in range(r.num_samples)])
            self.lps.append([[] for _ in range(r.num_samples)])
            self.reasons.append(["length"] * r.num_samples)
            self.done.append([False] * r.num_samples)
            self.steps.append(0)
        if self.cache is None:
            self.cache, self.last, self.att, self.pos = cache, last, att, pos
        else:
            self._merge(cache, last, att, pos)
        self.active += list(range(first, first + B))

    def _merge(self, cache, last, att, pos) -> None:
        """Append rows with their own cache: left-pad the shorter keys/values and masks."""
        n1, l1, l2 = self.last.shape[0], self.cache.get_seq_length(), cache.get_seq_length()
        att1 = self.att if self.att is not None else torch.ones((n1, l1), dtype=torch.long)
        pos1 = self.pos if self.pos is not None else torch.full((n1, 1), l1, dtype=torch.long)
        att2 = att if att is not None else torch.ones((last.shape[0], l2), dtype=torch.long)
        pos2 = pos if pos is not None else torch.full((last.shape[0], 1), l2, dtype=torch.long)
        length = max(l1, l2)
        for a, b in zip(self.cache.layers, cache.layers):
            a.keys = torch.cat([_left_pad(a.keys, length, -2), _left_pad(b.keys, length, -2)], dim=0)
            a.values = torch.cat([_left_pad(a.values, length, -2), _left_pad(b.values, length, -2)], dim=0)
        self.att = torch.cat([_left_pad(att1, length, -1), _left_pad(att2, length, -1)], dim=0)
        self.pos = torch.cat([pos1, pos2], dim=0)
        self.last = torch.cat([self.last, last.to(self.last.device)], dim=0)

    def sample_step(self) -> torch.Tensor | None:
        """Draw one token for every active row, finish requests (``on_done``), drop their rows;
        returns the tokens to feed (R', ) or None when nothing is left."""
        lf = self.last.float().cpu()
        logp = torch.log_softmax(lf, dim=-1)
        nxt_rows = torch.empty(lf.shape[0], dtype=torch.long)
        keep, keep_rows, a = [], [], 0
        for i in self.active:
            r = self.reqs[i]
            b = a + r.num_samples
            nxt = _choose(lf[a:b], r.temperature, r.top_k, r.top_p, self.gens[i])
            nxt_rows[a:b] = nxt
            nlp = logp[a:b].gather(-1, nxt.unsqueeze(-1)).squeeze(-1).tolist()
            for j, (t, v) in enumerate(zip(nxt.tolist(), nlp)):
                if not self.done[i][j]:
                    self._append(i, j, t, v)
            self.steps[i] += 1
            if all(self.done[i]) or self.steps[i] >= r.max_tokens:
                self._finish(i)
            else:
                keep.append(i)
                keep_rows.extend(range(a, b))
            a = b
        if not keep:
            self.active = []
            return None
        if len(keep) < len(self.active):  # drop the rows of finished requests
            sel = torch.tensor(keep_rows, dtype=torch.long)
            self.cache.batch_select_indices(sel.to(self.device))
            nxt_rows = nxt_rows[sel]
            self.att = self.att[sel] if self.att is not None else None
            self.pos = self.pos[sel] if self.pos is not None else None
            self.active = keep
        return nxt_rows

    def _append(self, i: int, j: int, t: int, v: float) -> None:
        r = self.reqs[i]
        self.toks[i][j].append(t)
        self.lps[i][j].append(v)
        if t in r.stop.token_ids:
            self.done[i][j], self.reasons[i][j] = True, "stop"
        elif r.stop.strings:
            window = max(len(x) for x in r.stop.strings) * 4 + 8
            text = self.tokenizer.decode(self.toks[i][j][-window:], skip_special_tokens=False)
            if any(x in text for x in r.stop.strings):
                self.done[i][j], self.reasons[i][j] = True, "stop"

    def _finish(self, i: int) -> None:
        self.results[i]["sequences"] = [
            {"tokens": self.toks[i][j], "logprobs": self.lps[i][j], "stop_reason": self.reasons[i][j]}
            for j in range(self.reqs[i].num_samples)]
        if self.on_done is not None:
            self.on_done(i, self.results[i])

    def forward(self, nxt_rows: torch.Tensor) -> None:
        step_kw: dict = {self.kw: self.cache}
        if self.att is not None:
            self.att = torch.cat([self.att, torch.ones((self.att.shape[0], 1), dtype=self.att.dtype)], dim=-1)
            step_kw.update(attention_mask=self.att.to(self.device), position_ids=self.pos.to(self.device))
            self.pos = self.pos + 1
        out = self.model(input_ids=nxt_rows.to(self.device).unsqueeze(-1), use_cache=True, **step_kw)
        self.cache = _out_cache(out)
        self.last = out.logits[:, -1]


@torch.no_grad()
def sample_batch(model, tokenizer, reqs: list[SampleRequest], *, device: torch.device,
                 decode_threads: int | None = None, admit=None, max_rows: int = 256,
                 on_done=None) -> list[dict]:
    """Serve ``reqs`` together; returns one dict per request, in order:
    ``{"sequences": [{"tokens": [...], "logprobs": [...], "stop_reason": "stop"|"length"}] *
    num_samples, "prompt_logprobs": list (len P, entry 0 None) | None, "topk_prompt_logprobs":
    list (len P, entry 0 None, others [(token_id, logprob)] * k) | None}``.

    ``admit()`` (optional) is called between decode steps while the batch has fewer than
    ``max_rows`` rows and its cache can take rows of another length (plain ``DynamicCache``):
    the requests it returns are prefilled and join the running batch (continuous batching);
    their results follow ``reqs``' in the returned list, in admission order.  ``on_done(i,
    result)`` is called as soon as request ``i`` (that order) has finished.
    The caller handles autocast (none: fp32), adapter selection and prefill sizes (the prefill
    holds ``len(reqs) x max P`` tokens, and all their logits when any request wants prompt
    logprobs).  ``decode_threads``: torch threads for the token-by-token phase (small decode
    steps run faster on one thread, since OpenMP synchronisation dominates them).
    Raises RuntimeError if the model's KV cache cannot select batch rows.
    """
    batch = _Batch(model, tokenizer, device, on_done)
    batch.add(reqs)
    if decode_threads and device.type == "cpu":
        torch.set_num_threads(decode_threads)
    while True:
        nxt = batch.sample_step()
        if nxt is None:
            break
        batch.forward(nxt)
        if admit is not None and batch.rows < max_rows and batch.can_join():
            new = admit()
            if new:
                batch.add(new)
    return batch.results
