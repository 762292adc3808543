"""Sampling methods of ``tinker_local.engine.Engine`` (a mixin): validation, batching, adapters.

``Engine.sample_many`` serves several sampling requests at once: requests for the same base
model and the same weights (the base model alone, or one sampler checkpoint) that agree on
whether prompt logprobs are wanted share one prefill and one decode loop
(``tinker_local.sampling.sample_batch``), in chunks bounded by ``MAX_BATCH_ROWS`` sampled rows
and a prefill budget (``MAX_PREFILL_TOKENS`` tokens; ``MAX_PROMPT_LOGITS`` logits when prompt
logprobs are computed).  Each request is validated on its own, so one bad request fails alone.
Sampling runs in the weights' dtype (``EngineCore._sampling_autocast``): fp32 weights (the CPU
default) sample in fp32, so sampled logprobs match an fp32 ``forward``; bf16 weights (CUDA) under
bf16 autocast, the output head and logprobs in fp32 either way.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .adapters import load_sampler_adapter
from .checkpoints import checkpoint_info
from .datatypes import MediaChunk, SampleResult
from .engine_core import EngineCore
from .errors import EngineUserError
from .inputs import check_tokens
from .media import prefill_kwargs, reset_media_state, resolve_chunks
from .sampling import SampleRequest, make_stop_spec, sample_batch

# sampler checkpoints kept loaded per base model; past it the least recently used one's slot takes the next
# checkpoint (a copy of its tensors, ~0.06 s for SmolLM2 r16, where injecting a new adapter took 0.35 s with one
# other adapter resident and 0.9 s with eight: every peft walk grows with the adapters held)
MAX_SAMPLER_ADAPTERS = 4
MAX_BATCH_ROWS = 256  # sampled sequences decoded together
MAX_PREFILL_TOKENS = 16384  # padded prompt tokens in one prefill
MAX_PROMPT_LOGITS = 2**26  # padded prompt tokens x vocab when prompt logprobs are computed
MAX_TOPK_PROMPT_LOGPROBS = 128  # most alternatives per prompt position (larger K: a user error)
MAX_PROMPT_ALT_TOKENS_K = 1024  # most draws per prompt position (prompt_alt_tokens_k)


class SamplingMixin(EngineCore):
    """``sample`` / ``sample_many`` for ``Engine`` (uses its lock, bases, device, threads)."""

    def sample(
        self,
        base_model: str | None,
        weights_path: Path | None,
        prompt_tokens: list[int],
        *,
        num_samples: int,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = -1,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: list[str] | list[int] | str | None = None,
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        prompt_logprobs_last_n: int | None = None,
        target_prompt_logprobs=None,
        prompt_alt_tokens_k: int = 0,
    ) -> SampleResult:
        """Sample ``num_samples`` continuations of ``prompt_tokens`` (len P >= 1; or a list of
        chunks, token lists and ``MediaChunk`` s, for a media model) from the base model, or from
        sampler/state weights at ``weights_path`` (then ``base_model`` may be None:
        the checkpoint names it).  fp32; token logprobs as in ``forward`` (temperature 1, before
        top-k/top-p).  ``temperature`` 0 = greedy; ``top_k`` <= 0 = off; ``stop``: None = the
        model's EOS ids, ``[]`` = never stop early, strings are matched in the decoded sampled
        text, ints are token ids (kept as the last token).  ``seed`` None = random.
        ``topk_sample_logprobs`` k > 0: each sequence also gets ``topk_logprobs``, the k most
        likely (token id, logprob) pairs at every sampled position.  ``prompt_logprobs_last_n``
        N: only the last N prompt logprobs are needed (earlier entries may be None; the prefill
        then keeps fewer logits).  ``target_prompt_logprobs``: int64 array (P - 1, K) of token ids
        whose logprob at prompt position ``i + 1`` is wanted (-1: none); ``prompt_alt_tokens_k`` k:
        k draws per prompt position after the first (``tinker_local.sampling._prompt_outputs``).
        Raises EngineUserError: unknown model/path, base model not matching the weights, token
        outside the vocabulary, P + max_tokens - 1 beyond the context, bad parameter values."""
        (res,) = self.sample_many(
            [
                dict(
                    base_model=base_model,
                    weights_path=weights_path,
                    prompt_tokens=prompt_tokens,
                    num_samples=num_samples,
                    max_tokens=max_tokens,
                    temperature=temperature,
                    top_k=top_k,
                    top_p=top_p,
                    seed=seed,
                    stop=stop,
                    include_prompt_logprobs=include_prompt_logprobs,
                    topk_prompt_logprobs=topk_prompt_logprobs,
                    topk_sample_logprobs=topk_sample_logprobs,
                    prompt_logprobs_last_n=prompt_logprobs_last_n,
                    target_prompt_logprobs=target_prompt_logprobs,
                    prompt_alt_tokens_k=prompt_alt_tokens_k,
                )
            ]
        )
        if isinstance(res, BaseException):
            raise res
        return res

    def sample_many(self, requests: list[dict]) -> list[SampleResult | Exception]:
        """Serve ``requests`` (each a dict of ``sample``'s keyword arguments, including
        ``base_model``, ``weights_path`` and ``prompt_tokens``) with as few batched forwards as
        possible.  Returns, per request in order, its ``SampleResult`` or the exception that
        failed it (``EngineUserError`` for bad input; anything else fails its whole chunk)."""
        with self._lock:
            self._threads()
            results: list = [None] * len(requests)
            groups: dict[tuple, list[tuple[int, SampleRequest]]] = {}
            targets: dict[tuple, tuple] = {}
            for i, kw in enumerate(requests):
                try:
                    b, path, wkey, req = self._prepare_sample(**kw)
                except EngineUserError as e:
                    results[i] = e
                    continue
                key = (b.spec.name, wkey, req.wants_prompt, id(req) if req.media else None)  # media: alone
                groups.setdefault(key, []).append((i, req))
                targets[key] = (b, path)
            try:
                for key, items in groups.items():
                    b, path = targets[key]
                    for chunk in _chunks(items, b.spec.vocab_size):
                        outs: Sequence[dict[str, Any] | Exception]
                        try:
                            outs = self._sample_chunk(b, path, [req for _, req in chunk])
                        except Exception as e:  # fails this chunk only
                            outs = [e] * len(chunk)
                        for (i, _), out in zip(chunk, outs, strict=True):
                            results[i] = (
                                out
                                if isinstance(out, Exception)
                                else SampleResult(
                                    out["sequences"],
                                    out["prompt_logprobs"],
                                    out["topk_prompt_logprobs"],
                                    out["target_prompt_logprobs"],
                                    out["prompt_alt_tokens"],
                                    out["prompt_cache_hit_tokens"],
                                )
                            )
            finally:
                self._threads()
            return results

    def _prepare_sample(
        self,
        base_model,
        weights_path,
        prompt_tokens,
        *,
        num_samples,
        max_tokens,
        temperature=1.0,
        top_k=-1,
        top_p=1.0,
        seed=None,
        stop=None,
        include_prompt_logprobs=False,
        topk_prompt_logprobs=0,
        topk_sample_logprobs=0,
        prompt_logprobs_last_n=None,
        target_prompt_logprobs=None,
        prompt_alt_tokens_k=0,
    ):
        """Validate one request -> (base, weights path | None, weights cache key, SampleRequest)."""
        wkey = None
        if weights_path is not None:
            weights_path = Path(weights_path)
            meta = checkpoint_info(weights_path)
            if base_model and self._canonical(base_model) != self._canonical(meta["base_model"]):
                raise EngineUserError(
                    f"weights {str(weights_path)!r} are for base model {meta['base_model']!r}, not {base_model!r}"
                )
            base_model = base_model or meta["base_model"]
            wkey = (str(weights_path.resolve()), (weights_path / "adapter_model.safetensors").stat().st_mtime_ns)
        if not base_model:
            raise EngineUserError("sample needs base_model or weights_path")
        b = self._base(base_model)
        media = None
        if isinstance(prompt_tokens, list) and any(isinstance(c, (list, MediaChunk)) for c in prompt_tokens):
            prompt_tokens, media = resolve_chunks(self._media(b), prompt_tokens, "prompt", b.spec.name)
        elif self._media(b) is not None:  # text only: still no media placeholder ids in it
            prompt_tokens, media = resolve_chunks(self._media(b), [prompt_tokens], "prompt", b.spec.name)
        prompt = check_tokens("prompt_tokens", prompt_tokens, b.spec.vocab_size, b.spec.max_context, b.spec.name)
        for k, v in (("num_samples", num_samples), ("max_tokens", max_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise EngineUserError(f"{k} must be a positive integer, got {v!r}")
        if len(prompt) + max_tokens - 1 > b.spec.max_context:  # the last token is not fed back
            raise EngineUserError(
                f"prompt length {len(prompt)} + max_tokens {max_tokens} exceeds "
                f"the context of {b.spec.name!r} ({b.spec.max_context} tokens)"
            )
        if not (0.0 < float(top_p) <= 1.0):
            raise EngineUserError(f"top_p must be in (0, 1], got {top_p!r}")
        if not (float(temperature) >= 0.0):
            raise EngineUserError(f"temperature must be >= 0, got {temperature!r}")
        for k, v in (("topk_prompt_logprobs", topk_prompt_logprobs), ("topk_sample_logprobs", topk_sample_logprobs)):
            if int(v) < 0:
                raise EngineUserError(f"{k} must be >= 0, got {v!r}")
        if prompt_logprobs_last_n is not None and (
            isinstance(prompt_logprobs_last_n, bool)
            or not isinstance(prompt_logprobs_last_n, int)
            or prompt_logprobs_last_n < 0
        ):
            raise EngineUserError(
                f"prompt_logprobs_last_n must be a non-negative integer, got {prompt_logprobs_last_n!r}"
            )
        if int(topk_prompt_logprobs) > MAX_TOPK_PROMPT_LOGPROBS:
            raise EngineUserError(
                f"topk_prompt_logprobs must be between 0 and {MAX_TOPK_PROMPT_LOGPROBS} "
                f"(tinker_local's limit), got {topk_prompt_logprobs!r}"
            )
        target = _check_target(target_prompt_logprobs, len(prompt), b.spec.vocab_size)
        if (
            isinstance(prompt_alt_tokens_k, bool)
            or not isinstance(prompt_alt_tokens_k, int)
            or not (0 <= prompt_alt_tokens_k <= MAX_PROMPT_ALT_TOKENS_K)
        ):
            raise EngineUserError(
                f"prompt_alt_tokens_k must be an integer between 0 and {MAX_PROMPT_ALT_TOKENS_K} "
                f"(tinker_local's limit), got {prompt_alt_tokens_k!r}"
            )
        if (target is not None or prompt_alt_tokens_k) and len(prompt) < 2:
            raise EngineUserError("target_prompt_logprobs / prompt_alt_tokens_k need a prompt of at least 2 tokens")
        req = SampleRequest(
            prompt,
            num_samples,
            max_tokens,
            float(temperature),
            int(top_k),
            float(top_p),
            int(seed) if seed is not None else secrets.randbelow(2**63),
            make_stop_spec(stop, _eos_ids(b)),
            bool(include_prompt_logprobs),
            int(topk_prompt_logprobs),
            int(topk_sample_logprobs),
            prompt_logprobs_last_n,
            media=media or None,
            target_prompt=target,
            prompt_alt_k=prompt_alt_tokens_k,
        )
        return b, weights_path, wkey, req

    def _sample_chunk(self, b, path: Path | None, reqs: list[SampleRequest]) -> list[dict]:
        if path is not None:
            self._activate_sampler(b, path)
            ctx = nullcontext()
        else:
            # with no adapter left (all deleted) the LoRA layers add nothing, and peft's
            # disable_adapter would look up the deleted active one; with adapters left, it looks up the
            # model's active adapter by name, which must be one of them (adapters.remove_adapter)
            peft = b.peft
            if peft is not None and peft.peft_config and peft.active_adapter not in peft.peft_config:
                peft.active_adapter = next(iter(peft.peft_config))
            ctx = peft.disable_adapter() if peft is not None and peft.peft_config else nullcontext()
        rows = sum(r.num_samples for r in reqs)
        small = b.n_params * rows < 5e7  # multiply-adds per decode step
        extra = None
        if self._media(b) is not None:
            reset_media_state(b.model)
            if reqs[0].media:  # a media prompt is sampled alone (one prefill with its payloads)
                extra = prefill_kwargs(b.model, self._media(b), reqs[0].prompt, reqs[0].media, self.device)
        with ctx, torch.no_grad(), self._sampling_autocast():
            return sample_batch(
                b.model,
                b.tokenizer,
                reqs,
                device=self.device,
                decode_threads=1 if small else None,
                prefill_extra=extra,
                text_only=self._media(b) is None,
            )

    def _activate_sampler(self, b, path: Path) -> None:
        key = (str(path.resolve()), (path / "adapter_model.safetensors").stat().st_mtime_ns)
        name = b.sampler_adapters.get(key)
        if name is None:
            reuse = None
            if len(b.sampler_adapters) >= MAX_SAMPLER_ADAPTERS:  # the least recently used makes room
                _, reuse = b.sampler_adapters.popitem(last=False)
            b.counter += 1
            reuse_params = b.sampler_params.pop(reuse, None) if reuse else None
            b.peft, name, params = load_sampler_adapter(
                b.peft, b.model, f"s{b.counter}", path, self.device, reuse=reuse, reuse_params=reuse_params
            )
            b.sampler_params[name] = params
            b.active = None
            b.sampler_adapters[key] = name
        b.sampler_adapters.move_to_end(key)
        b.use(name)


def _chunks(items: list[tuple[int, SampleRequest]], vocab: int) -> list[list[tuple[int, SampleRequest]]]:
    """Split one group into batches within ``MAX_BATCH_ROWS`` rows, ``MAX_PREFILL_TOKENS`` padded
    prompt tokens and ``MAX_PROMPT_LOGITS`` kept prefill logits (all positions of a request that
    wants its prompt logprobs, its last N + 1 with ``prompt_logprobs_last_n``; else one). A
    single request larger than the budget gets its own batch."""
    out: list[list] = []
    cur: list = []
    rows = longest = 0
    need: int | None = 0  # most kept positions the batch's requests need (None: all)
    for item in items:
        req = item[1]
        n, p, own = req.num_samples, len(req.prompt), req.logit_positions
        m = max(longest, p)
        k = None if need is None or own is None else max(need, own)
        if cur and (
            rows + n > MAX_BATCH_ROWS
            or m * (len(cur) + 1) > MAX_PREFILL_TOKENS
            or min(m, k or m) * (len(cur) + 1) * vocab > MAX_PROMPT_LOGITS
        ):
            out.append(cur)
            cur, rows, m, k = [], 0, p, own
        cur.append(item)
        rows += n
        longest, need = m, k
    if cur:
        out.append(cur)
    return out


def _eos_ids(b) -> set[int]:
    ids = set()
    eos = getattr(b.model.generation_config, "eos_token_id", None)
    for e in eos if isinstance(eos, (list, tuple)) else [eos]:
        if e is not None:
            ids.add(int(e))
    if b.tokenizer.eos_token_id is not None:
        ids.add(int(b.tokenizer.eos_token_id))
    return ids


def _check_target(target, prompt_len: int, vocab: int) -> np.ndarray | None:
    """``target_prompt_logprobs`` as an int64 (P - 1, K) array; EngineUserError for another
    shape or an id outside ``[-1, vocab)``."""
    if target is None:
        return None
    arr = np.asarray(target)
    if arr.ndim != 2 or arr.shape[0] != prompt_len - 1 or arr.dtype.kind not in "iu":
        raise EngineUserError(
            f"target_prompt_logprobs must be an integer array of shape [len(prompt) - 1, K] = "
            f"[{prompt_len - 1}, K], got {arr.dtype} {list(arr.shape)}"
        )
    if arr.size and (arr.min() < -1 or arr.max() >= vocab):
        bad = int(arr.min()) if arr.min() < -1 else int(arr.max())
        raise EngineUserError(
            f"target_prompt_logprobs: token id {bad} is outside the vocabulary [0, {vocab}) (-1 requests nothing)"
        )
    return arr.astype(np.int64)
