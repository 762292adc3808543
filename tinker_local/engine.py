"""The torch compute engine behind ``tinker_local``: LoRA training and sampling, no HTTP.

One ``Engine`` owns a folder ``root`` (``root/"models"`` caches preset files,
``root/"checkpoints"/<model_id>/{weights,sampler_weights}/<name>/`` holds checkpoints) and any
number of training models ("model ids"), each a named LoRA adapter over a shared base model.
Each base model is loaded once per canonical name and wrapped in one ``peft.PeftModel`` holding
all adapters (training adapters ``t<n>`` and cached sampler adapters ``s<n>``); every call
activates the adapter it needs, so model ids never see each other's weights, gradients or
optimizer state.  Base weights stay fp32 and frozen.

LoRA: ``lora_alpha = 32`` (scale 32/rank, as in Thinking Machines' "LoRA Without Regret"), no
dropout, A Kaiming-uniform from ``seed`` and B zero (the initial model equals the base).
Targets: ``train_attn`` -> every Linear under an attention block, ``train_mlp`` -> every Linear
under an MLP block, ``train_unembed`` -> the output embedding (``lm_head``) as a LoRA target
(peft supports Linear heads; with tied embeddings the base weight stays shared and frozen).

Numerics: ``dtype="auto"`` trains under bf16 autocast (CUDA, or a CPU with avx512_bf16/AMX) and
otherwise fp32; ``"fp32"`` / ``"bf16"`` force it.  The output projection and the logprob
computation always run in fp32.  Sampling always runs in fp32.

Threading: public methods take one re-entrant lock, so calls from several threads are
serialised (safe, but not parallel); the intended use is one dedicated compute thread.  The
engine sets ``torch.set_num_threads(num_threads)`` (default: CPUs available to the process).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import threading
import uuid
import warnings
from collections import OrderedDict
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import EngineUserError, UnknownModelError
from .losses import REQUIRED_INPUTS, SCALAR_OK, get_loss_fn
from .models import ModelSpec, resolve_model
from .sampling import StopSpec, sample_tokens

__all__ = ["Engine", "Datum", "FwdResult", "SampleResult", "EngineUserError", "UnknownModelError"]

LORA_ALPHA = 32
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,199}$")
_ATTN_HINTS = ("attn", "attention")
_MLP_HINTS = ("mlp", "feed_forward", "ffn")
_STATE_FILE = "tinker_state.json"
_MAX_SAMPLER_ADAPTERS = 8


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
    target_tokens.  ``metrics``: ``{"loss:sum": float, ...}`` keyed ``name:reduction``."""

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


@dataclass
class _Base:
    spec: ModelSpec
    model: Any  # the transformers model (LoRA layers injected in place once peft wraps it)
    tokenizer: Any
    peft: Any = None  # peft.PeftModel once the first adapter exists
    n_params: int = 0
    counter: int = 0
    sampler_adapters: "OrderedDict[tuple, str]" = field(default_factory=OrderedDict)


@dataclass
class _Train:
    model_id: str
    base_name: str  # as given by the caller
    base_key: str  # canonical spec name
    adapter: str
    lora_rank: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    seed: int
    params: "OrderedDict[str, torch.nn.Parameter]"  # peft state-dict key -> parameter
    optimizer: torch.optim.AdamW
    step: int = 0


class Engine:
    """LoRA training and sampling over local base models; see the module docstring."""

    def __init__(self, root: Path, *, device: str | None = None, dtype: str = "auto",
                 num_threads: int | None = None):
        """``root``: folder for checkpoints and the model cache (created).  ``device``: torch
        device string (default "cuda" when available, else "cpu").  ``dtype``: "auto" | "fp32" |
        "bf16" for training/forward compute (ValueError otherwise).  ``num_threads``: torch
        intra-op threads (default: number of CPUs this process may use)."""
        self.root = Path(root)
        (self.root / "checkpoints").mkdir(parents=True, exist_ok=True)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype not in ("auto", "fp32", "bf16"):
            raise ValueError(f"dtype must be 'auto', 'fp32' or 'bf16', got {dtype!r}")
        if dtype == "auto":
            bf16_ok = self.device.type == "cuda" or _cpu_bf16_supported()
            dtype = "bf16" if bf16_ok else "fp32"
        self.dtype = dtype
        self.num_threads = num_threads or _available_cpus()
        torch.set_num_threads(self.num_threads)
        self._lock = threading.RLock()
        self._bases: dict[str, _Base] = {}
        self._models: dict[str, _Train] = {}
        try:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        except Exception:  # pragma: no cover - cosmetic only
            pass

    # ------------------------------------------------------------------ models and adapters

    def load_base_model(self, base_model: str) -> dict:
        """Load ``base_model`` now (e.g. at server start) and return its info dict
        ``{"base_model", "tokenizer_id", "max_context", "vocab_size"}``.  Raises EngineUserError."""
        with self._lock:
            b = self._base(base_model)
            return {"base_model": base_model, "tokenizer_id": b.spec.tokenizer_dir,
                    "max_context": b.spec.max_context, "vocab_size": b.spec.vocab_size}

    def create_model(self, model_id: str, base_model: str, lora_rank: int, *, seed: int | None,
                     train_mlp: bool = True, train_attn: bool = True,
                     train_unembed: bool = True) -> None:
        """Create training model ``model_id``: a fresh LoRA adapter of rank ``lora_rank`` over
        ``base_model`` (loaded on first use), with a fresh AdamW state at step 0.  ``seed`` fixes
        the adapter init (None: random).  Raises EngineUserError for a duplicate/invalid id, an
        unknown base model, rank < 1, or no trainable target."""
        with self._lock:
            _check_name("model_id", model_id)
            if model_id in self._models:
                raise EngineUserError(f"model_id {model_id!r} already exists")
            if not isinstance(lora_rank, int) or lora_rank < 1:
                raise EngineUserError(f"lora_rank must be a positive integer, got {lora_rank!r}")
            if not (train_mlp or train_attn or train_unembed):
                raise EngineUserError("at least one of train_mlp, train_attn, train_unembed must be true")
            b = self._base(base_model)
            seed = int(seed) if seed is not None else secrets.randbelow(2**31)
            cfg = self._lora_config(b, lora_rank, train_mlp, train_attn, train_unembed)
            b.counter += 1
            name = f"t{b.counter}"
            self._add_adapter(b, name, cfg, seed)
            params = OrderedDict()
            for pname, p in b.peft.named_parameters():
                if f".{name}." in pname and "lora_" in pname:
                    params[pname.replace(f".{name}.", ".")] = p
            opt = torch.optim.AdamW(list(params.values()), lr=0.0, betas=(0.9, 0.95), eps=1e-12,
                                    weight_decay=0.0)
            self._models[model_id] = _Train(model_id, base_model, b.spec.name, name, lora_rank,
                                            bool(train_mlp), bool(train_attn), bool(train_unembed),
                                            seed, params, opt)

    def delete_model(self, model_id: str) -> None:
        """Drop ``model_id`` (its adapter and optimizer state); checkpoints on disk stay."""
        with self._lock:
            st = self._train(model_id)
            b = self._bases[st.base_key]
            b.peft.delete_adapter(st.adapter)
            del self._models[model_id]

    def list_models(self) -> list[str]:
        """The ids of the training models that exist now."""
        with self._lock:
            return list(self._models)

    def get_info(self, model_id: str) -> dict:
        """``{"model_id", "base_model", "lora_rank", "arch", "tokenizer_id" (local dir), "max_context",
        "vocab_size", "train_mlp", "train_attn", "train_unembed", "step"}``; EngineUserError if
        the id is unknown."""
        with self._lock:
            st = self._train(model_id)
            b = self._bases[st.base_key]
            spec = b.spec
            return {"model_id": model_id, "base_model": st.base_name, "lora_rank": st.lora_rank,
                    "arch": getattr(b.model.config, "model_type", None),
                    "tokenizer_id": spec.tokenizer_dir, "max_context": spec.max_context,
                    "vocab_size": spec.vocab_size, "train_mlp": st.train_mlp,
                    "train_attn": st.train_attn, "train_unembed": st.train_unembed, "step": st.step}

    # ------------------------------------------------------------------ forward / backward

    def forward(self, model_id: str, datums: list[Datum], loss_fn: str,
                loss_fn_config: dict | None) -> FwdResult:
        """Logprobs and loss of ``datums`` under ``model_id`` without touching gradients.
        See ``forward_backward`` for shapes and errors."""
        return self._run(model_id, datums, loss_fn, loss_fn_config, backward=False)

    def forward_backward(self, model_id: str, datums: list[Datum], loss_fn: str,
                         loss_fn_config: dict | None) -> FwdResult:
        """Like ``forward`` and also accumulate d(loss:sum)/d(adapter params) into the
        gradients (they add up over calls until ``optim_step``).

        Datums may have different lengths (padded internally).  Returns per-datum
        ``{"logprobs": float32 array shaped like target_tokens}`` and ``{"loss:sum": ...}``.
        Raises EngineUserError: unknown model id or loss fn, empty/too-long sequence, token or
        target id outside ``[0, vocab_size)``, missing/mis-shaped loss inputs."""
        return self._run(model_id, datums, loss_fn, loss_fn_config, backward=True)

    def _run(self, model_id, datums, loss_fn, loss_fn_config, backward: bool) -> FwdResult:
        with self._lock:
            self._threads()
            st = self._train(model_id)
            b = self._bases[st.base_key]
            fn = get_loss_fn(loss_fn)
            cfg = dict(loss_fn_config or {})
            prepared = [self._check_datum(i, d, loss_fn, b.spec) for i, d in enumerate(datums)]
            self._activate(b, st)
            outputs: list[dict[str, np.ndarray] | None] = [None] * len(prepared)
            total = 0.0
            vocab = b.spec.vocab_size
            budget = max(256, min(16384, 2**27 // max(vocab, 1)))
            for mb in _microbatches([len(p[0]) for p in prepared], budget):
                with torch.set_grad_enabled(backward):
                    lps = self._logprobs(b, [prepared[i] for i in mb])
                    loss = None
                    for i, lp in zip(mb, lps):
                        inp = prepared[i][2]
                        li = fn(lp, inp, cfg)
                        loss = li if loss is None else loss + li
                        outputs[i] = {"logprobs": lp.detach().float().cpu().numpy()}
                    if backward and loss is not None and loss.requires_grad:
                        loss.backward()
                total += float(loss.detach()) if loss is not None else 0.0
            return FwdResult(outputs=outputs, metrics={"loss:sum": total})

    def _logprobs(self, b: _Base, items) -> list[torch.Tensor]:
        """Run one padded batch; return per item logprobs (N,) / (N, K) float32 with grad."""
        lens = [len(it[0]) for it in items]
        T = max(lens)
        ids = torch.zeros((len(items), T), dtype=torch.long)
        for r, it in enumerate(items):
            ids[r, : lens[r]] = torch.as_tensor(it[0], dtype=torch.long)
        ids = ids.to(self.device)
        with self._autocast():  # right padding + causal attention: pads never reach real tokens
            logits = _fp32_head_logits(b.model, ids)  # (B, T, V) float32
        lse = torch.logsumexp(logits, dim=-1)  # (B, T)
        out = []
        for r, it in enumerate(items):
            tgt = it[1].to(self.device)
            n = lens[r]
            lg, ls = logits[r, :n], lse[r, :n]
            if tgt.ndim == 1:
                out.append(lg.gather(-1, tgt.unsqueeze(-1)).squeeze(-1) - ls)
            else:
                out.append(lg.gather(-1, tgt) - ls.unsqueeze(-1))
        return out

    # ------------------------------------------------------------------ optimizer

    def optim_step(self, model_id: str, *, learning_rate: float, beta1: float = 0.9,
                   beta2: float = 0.95, eps: float = 1e-12, weight_decay: float = 0.0,
                   grad_clip_norm: float = 0.0) -> dict[str, float]:
        """One AdamW step on the accumulated gradients of ``model_id``, then zero them.

        Semantics (Tinker ``AdamParams``): if ``grad_clip_norm > 0`` gradients are scaled by
        ``min(1, grad_clip_norm / (global_norm + 1e-6))`` first; then ``torch.optim.AdamW``
        (decoupled decay ``p -= lr*wd*p``, bias-corrected moments, ``eps`` added to the
        bias-corrected sqrt of the second moment).  Returns ``{"grad_norm:mean": norm before
        clipping, "learning_rate:mean": lr, "step:max": steps taken so far}``.
        Raises EngineUserError for an unknown id or a negative/NaN hyperparameter."""
        with self._lock:
            self._threads()
            st = self._train(model_id)
            for k, v in (("learning_rate", learning_rate), ("eps", eps),
                         ("weight_decay", weight_decay), ("grad_clip_norm", grad_clip_norm)):
                if not (float(v) >= 0.0):
                    raise EngineUserError(f"{k} must be >= 0, got {v!r}")
            for k, v in (("beta1", beta1), ("beta2", beta2)):
                if not (0.0 <= float(v) < 1.0):
                    raise EngineUserError(f"{k} must be in [0, 1), got {v!r}")
            params = list(st.params.values())
            grads = [p.grad for p in params if p.grad is not None]
            norm = float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))) if grads else 0.0
            if grad_clip_norm > 0 and grads:
                torch.nn.utils.clip_grad_norm_(params, max_norm=float(grad_clip_norm))
            for g in st.optimizer.param_groups:
                g.update(lr=float(learning_rate), betas=(float(beta1), float(beta2)),
                         eps=float(eps), weight_decay=float(weight_decay))
            st.optimizer.step()
            st.optimizer.zero_grad(set_to_none=True)
            st.step += 1
            return {"grad_norm:mean": norm, "learning_rate:mean": float(learning_rate),
                    "step:max": float(st.step)}

    # ------------------------------------------------------------------ checkpoints

    def save_state(self, model_id: str, name: str) -> Path:
        """Write adapter weights, AdamW state and step to
        ``root/checkpoints/<model_id>/weights/<name>/`` (``adapter_model.safetensors``,
        ``adapter_config.json`` in peft format, ``optimizer.safetensors``, ``tinker_state.json``)
        atomically, replacing an older one of that name.  Returns the directory."""
        with self._lock:
            st = self._train(model_id)
            _check_name("checkpoint name", name)
            return self._write_ckpt(st, "weights", name, with_optimizer=True)

    def save_sampler_weights(self, model_id: str, name: str) -> Path:
        """Write the adapter only (loadable by ``peft.PeftModel.from_pretrained`` and by
        ``sample``) to ``root/checkpoints/<model_id>/sampler_weights/<name>/``; returns it."""
        with self._lock:
            st = self._train(model_id)
            _check_name("checkpoint name", name)
            return self._write_ckpt(st, "sampler_weights", name, with_optimizer=False)

    def load_state(self, model_id: str, path: Path, *, with_optimizer: bool) -> None:
        """Load a checkpoint written by ``save_state`` (or adapter-only ``save_sampler_weights``
        when ``with_optimizer`` is False) into ``model_id``.  If the id does not exist it is
        created from the checkpoint's base model / rank / targets.  Without optimizer the
        AdamW state and step restart at 0.  Pending gradients are dropped.  Raises
        EngineUserError if the path is not a checkpoint, or is for a different base model or
        LoRA shape, or has no optimizer state when ``with_optimizer``."""
        from safetensors.torch import load_file

        with self._lock:
            path = Path(path)
            meta = checkpoint_info(path)
            if model_id not in self._models:
                self.create_model(model_id, meta["base_model"], int(meta["lora_rank"]),
                                  seed=int(meta.get("seed", 0)), train_mlp=meta["train_mlp"],
                                  train_attn=meta["train_attn"], train_unembed=meta["train_unembed"])
            st = self._train(model_id)
            if self._base(meta["base_model"]).spec.name != st.base_key:
                raise EngineUserError(f"checkpoint {str(path)!r} is for base model {meta['base_model']!r}, "
                                      f"model_id {model_id!r} uses {st.base_name!r}")
            sd = load_file(str(path / "adapter_model.safetensors"))
            if set(sd) != set(st.params) or any(sd[k].shape != st.params[k].shape for k in sd):
                raise EngineUserError(f"checkpoint {str(path)!r} has LoRA rank/targets "
                                      f"(rank {meta['lora_rank']}) that do not match model_id {model_id!r}")
            opt_file = path / "optimizer.safetensors"
            if with_optimizer and not opt_file.is_file():
                raise EngineUserError(f"checkpoint {str(path)!r} has no optimizer state "
                                      "(sampler weights?); load it without optimizer")
            with torch.no_grad():
                for k, p in st.params.items():
                    p.copy_(sd[k].to(p.device, p.dtype))
                    p.grad = None
            params = list(st.params.values())
            st.optimizer = torch.optim.AdamW(params, lr=0.0, betas=(0.9, 0.95), eps=1e-12,
                                             weight_decay=0.0)
            st.step = 0
            if with_optimizer:
                osd = load_file(str(opt_file))
                for k, p in st.params.items():
                    if f"{k}::exp_avg" not in osd:  # saved before this param had a step
                        continue
                    st.optimizer.state[p] = {
                        "step": osd[f"{k}::step"].clone(),
                        "exp_avg": osd[f"{k}::exp_avg"].to(p.device).clone(),
                        "exp_avg_sq": osd[f"{k}::exp_avg_sq"].to(p.device).clone(),
                    }
                st.step = int(meta.get("step", 0))

    def _write_ckpt(self, st: _Train, kind: str, name: str, with_optimizer: bool) -> Path:
        from safetensors.torch import save_file

        b = self._bases[st.base_key]
        final = self.root / "checkpoints" / st.model_id / kind / name
        tmp = final.parent / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True)
        try:
            sd = {k: p.detach().to("cpu").contiguous().clone() for k, p in st.params.items()}
            save_file(sd, str(tmp / "adapter_model.safetensors"))
            cfg = b.peft.peft_config[st.adapter].to_dict()
            cfg["base_model_name_or_path"] = b.spec.model_dir or b.spec.name
            cfg["target_modules"] = sorted(cfg["target_modules"])
            cfg = {k: (sorted(v) if isinstance(v, set) else v) for k, v in cfg.items()}
            (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=1, default=str))
            if with_optimizer:
                osd = {}
                for k, p in st.params.items():
                    s = st.optimizer.state.get(p)
                    if not s:
                        continue
                    osd[f"{k}::step"] = torch.as_tensor(s["step"]).detach().cpu().clone()
                    osd[f"{k}::exp_avg"] = s["exp_avg"].detach().cpu().contiguous().clone()
                    osd[f"{k}::exp_avg_sq"] = s["exp_avg_sq"].detach().cpu().contiguous().clone()
                save_file(osd, str(tmp / "optimizer.safetensors"))
            meta = {"format": 1, "kind": kind, "model_id": st.model_id, "name": name,
                    "base_model": st.base_name, "base_model_canonical": st.base_key,
                    "lora_rank": st.lora_rank, "lora_alpha": LORA_ALPHA, "train_mlp": st.train_mlp,
                    "train_attn": st.train_attn, "train_unembed": st.train_unembed,
                    "seed": st.seed, "step": st.step}
            (tmp / _STATE_FILE).write_text(json.dumps(meta, indent=1))
            if final.exists():
                old = final.parent / f".{name}.old-{uuid.uuid4().hex[:8]}"
                os.rename(final, old)
                shutil.rmtree(old, ignore_errors=True)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return final

    # ------------------------------------------------------------------ sampling

    def sample(self, base_model: str | None, weights_path: Path | None, prompt_tokens: list[int], *,
               num_samples: int, max_tokens: int, temperature: float = 1.0, top_k: int = -1,
               top_p: float = 1.0, seed: int | None = None,
               stop: list[str] | list[int] | str | None = None,
               include_prompt_logprobs: bool = False, topk_prompt_logprobs: int = 0) -> SampleResult:
        """Sample ``num_samples`` continuations of ``prompt_tokens`` (len P >= 1) from the base
        model, or from sampler/state weights at ``weights_path`` (then ``base_model`` may be None:
        the checkpoint names it).  fp32; logprobs as in ``forward``.  ``temperature`` 0 = greedy;
        ``top_k`` <= 0 = off; ``stop``: None = the model's EOS ids, ``[]`` = never stop early,
        strings matched in decoded text, ints as token ids.  ``seed`` None = random.
        Raises EngineUserError: unknown model/path, token outside vocab, prompt + max_tokens
        beyond the context, bad parameter values."""
        with self._lock:
            self._threads()
            if weights_path is not None:
                meta = checkpoint_info(Path(weights_path))
                base_model = base_model or meta["base_model"]
            if not base_model:
                raise EngineUserError("sample needs base_model or weights_path")
            b = self._base(base_model)
            prompt = _check_tokens("prompt_tokens", prompt_tokens, b.spec)
            if not isinstance(num_samples, int) or num_samples < 1:
                raise EngineUserError(f"num_samples must be a positive integer, got {num_samples!r}")
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise EngineUserError(f"max_tokens must be a positive integer, got {max_tokens!r}")
            if len(prompt) + max_tokens - 1 > b.spec.max_context:  # last token is not fed back
                raise EngineUserError(f"prompt length {len(prompt)} + max_tokens {max_tokens} exceeds "
                                      f"the context of {b.spec.name!r} ({b.spec.max_context} tokens)")
            if not (0.0 < float(top_p) <= 1.0):
                raise EngineUserError(f"top_p must be in (0, 1], got {top_p!r}")
            if float(temperature) < 0:
                raise EngineUserError(f"temperature must be >= 0, got {temperature!r}")
            stop_spec = self._stop_spec(b, stop)
            if weights_path is not None:
                self._activate_sampler(b, Path(weights_path), meta)
                ctx = nullcontext()
            else:
                ctx = b.peft.disable_adapter() if b.peft is not None else nullcontext()
            seed = int(seed) if seed is not None else secrets.randbelow(2**63)
            # one thread for small decode steps (params x samples < 5e7 multiply-adds per token)
            small = b.n_params * num_samples < 5e7
            with ctx, torch.no_grad():
                res = sample_tokens(b.model, b.tokenizer, prompt, num_samples=num_samples,
                                    max_tokens=max_tokens, temperature=float(temperature),
                                    top_k=int(top_k), top_p=float(top_p), seed=seed,
                                    stop=stop_spec, device=self.device,
                                    prompt_logprobs=include_prompt_logprobs,
                                    topk_prompt_logprobs=int(topk_prompt_logprobs),
                                    decode_threads=1 if small else None)
            self._threads()
            return SampleResult(res["sequences"], res["prompt_logprobs"], res["topk_prompt_logprobs"])

    def _stop_spec(self, b: _Base, stop) -> StopSpec:
        if stop is None:
            ids = set()
            eos = getattr(b.model.generation_config, "eos_token_id", None)
            for e in (eos if isinstance(eos, (list, tuple)) else [eos]):
                if e is not None:
                    ids.add(int(e))
            if b.tokenizer.eos_token_id is not None:
                ids.add(int(b.tokenizer.eos_token_id))
            return StopSpec(frozenset(ids), ())
        if isinstance(stop, (str, int)):
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

    def _activate_sampler(self, b: _Base, path: Path, meta: dict) -> None:
        from peft import LoraConfig
        from safetensors.torch import load_file

        f = path / "adapter_model.safetensors"
        key = (str(path.resolve()), f.stat().st_mtime_ns)
        name = b.sampler_adapters.get(key)
        if name is None:
            cfg = LoraConfig.from_pretrained(str(path))
            cfg.inference_mode = True
            b.counter += 1
            name = f"s{b.counter}"
            self._add_adapter(b, name, cfg, seed=0)
            sd = load_file(str(f))
            from peft import set_peft_model_state_dict

            res = set_peft_model_state_dict(b.peft, sd, adapter_name=name)
            missing = [k for k in getattr(res, "missing_keys", []) if f".{name}." in k]
            if missing or getattr(res, "unexpected_keys", []):
                b.peft.delete_adapter(name)
                raise EngineUserError(f"weights at {str(path)!r} do not fit base model {b.spec.name!r}")
            b.sampler_adapters[key] = name
            while len(b.sampler_adapters) > _MAX_SAMPLER_ADAPTERS:
                _, old = b.sampler_adapters.popitem(last=False)
                b.peft.delete_adapter(old)
        b.sampler_adapters.move_to_end(key)
        b.peft.set_adapter(name)

    # ------------------------------------------------------------------ internals

    def _threads(self) -> None:
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)

    def _autocast(self):
        if self.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _base(self, base_model: str) -> _Base:
        spec = resolve_model(base_model, self.root / "models")
        b = self._bases.get(spec.name)
        if b is None:
            model, tok = spec.load()
            for p in model.parameters():
                p.requires_grad_(False)
            model.to(self.device).eval()
            spec.vocab_size = int(model.get_input_embeddings().weight.shape[0])
            n_params = sum(p.numel() for p in model.parameters())
            b = self._bases[spec.name] = _Base(spec, model, tok, n_params=n_params)
        return b

    def _train(self, model_id: str) -> _Train:
        st = self._models.get(model_id)
        if st is None:
            raise EngineUserError(f"unknown model_id {model_id!r}")
        return st

    def _lora_config(self, b: _Base, rank: int, mlp: bool, attn: bool, unembed: bool):
        from peft import LoraConfig

        from transformers.pytorch_utils import Conv1D

        head = b.model.get_output_embeddings()
        heads = (head, getattr(head, "base_layer", head))
        targets = []
        for mname, mod in b.model.named_modules():
            if "lora_" in mname or not isinstance(mod, (torch.nn.Linear, Conv1D)):
                continue
            if any(mod is h for h in heads):
                if unembed:
                    targets.append(mname)
                continue
            parts = mname.lower().split(".")
            if attn and any(h in p for p in parts for h in _ATTN_HINTS):
                targets.append(mname)
            elif mlp and any(h in p for p in parts for h in _MLP_HINTS):
                targets.append(mname)
        targets = [t[: -len(".base_layer")] if t.endswith(".base_layer") else t for t in targets]
        if not targets:
            raise EngineUserError(f"no LoRA target modules found in {b.spec.name!r} for "
                                  f"train_mlp={mlp}, train_attn={attn}, train_unembed={unembed}")
        return LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, bias="none",
                          target_modules=sorted(set(targets)), task_type="CAUSAL_LM")

    def _add_adapter(self, b: _Base, name: str, cfg, seed: int) -> None:
        import peft

        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
            torch.manual_seed(seed)
            if b.peft is None:
                b.peft = peft.get_peft_model(b.model, cfg, adapter_name=name)
            else:
                b.peft.add_adapter(name, cfg)
        for pname, p in b.peft.named_parameters():
            if f".{name}." in pname:
                p.data = p.data.to(self.device)
                p.requires_grad_(not cfg.inference_mode)

    def _activate(self, b: _Base, st: _Train) -> None:
        b.peft.set_adapter(st.adapter)
        for p in st.params.values():  # peft may toggle requires_grad on set_adapter
            p.requires_grad_(True)

    def _check_datum(self, i: int, d: Datum, loss_fn: str, spec: ModelSpec):
        toks = _check_tokens(f"datum {i}: model_input", d.tokens, spec)
        n = len(toks)
        inputs = d.inputs or {}
        if "target_tokens" not in inputs:
            raise EngineUserError(f"datum {i}: loss_fn_inputs has no 'target_tokens'")
        tgt = np.asarray(inputs["target_tokens"])
        if tgt.ndim not in (1, 2) or tgt.shape[0] != n or tgt.dtype.kind not in "iu":
            raise EngineUserError(f"datum {i}: target_tokens must be integer (N,) or (N, K) with N = "
                                  f"{n} (model input length), got {tgt.dtype} {tgt.shape}")
        if tgt.size and (tgt.min() < 0 or tgt.max() >= spec.vocab_size):
            bad = int(tgt.min()) if tgt.min() < 0 else int(tgt.max())
            raise EngineUserError(f"datum {i}: target token id {bad} is outside the vocabulary "
                                  f"[0, {spec.vocab_size}) of {spec.name!r}")
        out = {}
        for k, v in inputs.items():
            if k == "target_tokens":
                continue
            a = np.asarray(v, dtype=np.float32)
            if k in SCALAR_OK and a.size == 1:
                out[k] = torch.tensor(float(a.reshape(())), device=self.device)
                continue
            if a.shape != tgt.shape:
                raise EngineUserError(f"datum {i}: loss_fn_inputs[{k!r}] has shape {a.shape}, "
                                      f"expected {tgt.shape} (like target_tokens)")
            out[k] = torch.from_numpy(np.ascontiguousarray(a)).to(self.device)
        for k in REQUIRED_INPUTS.get(loss_fn, ()):
            if k not in out:
                raise EngineUserError(f"datum {i}: loss_fn {loss_fn!r} needs loss_fn_inputs[{k!r}]")
        return toks, torch.from_numpy(tgt.astype(np.int64)), out


def checkpoint_info(path: Path) -> dict:
    """Read ``tinker_state.json`` of a checkpoint directory written by this engine: ``{"kind":
    "weights"|"sampler_weights", "model_id", "name", "base_model", "lora_rank", "train_mlp",
    "train_attn", "train_unembed", "seed", "step", ...}``.  EngineUserError if absent/invalid."""
    path = Path(path)
    try:
        meta = json.loads((path / _STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise EngineUserError(f"{str(path)!r} is not a tinker_local checkpoint directory ({e})") from e
    for k in ("base_model", "lora_rank", "train_mlp", "train_attn", "train_unembed"):
        if k not in meta:
            raise EngineUserError(f"checkpoint {str(path)!r}: {_STATE_FILE} lacks {k!r}")
    return meta


def _fp32_head_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) float32: the decoder under the ambient autocast, the output projection in
    fp32 (for llama-like models; others: the model's own forward, upcast)."""
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings()
    special = any(getattr(model.config, k, None) for k in ("final_logit_softcapping", "logit_scale"))
    if decoder is None or head is None or special or decoder is model:
        return model(input_ids=ids, use_cache=False).logits.float()
    hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
    with torch.autocast(ids.device.type, enabled=False):
        return head(hidden.float()).float()


def _microbatches(lengths: list[int], budget: int) -> list[list[int]]:
    """Group datum indices (longest first) so that batch_size * max_len <= budget (a longer
    single datum still gets its own batch)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups, cur, cur_max = [], [], 0
    for i in order:
        m = max(cur_max, lengths[i])
        if cur and m * (len(cur) + 1) > budget:
            groups.append(cur)
            cur, m = [], lengths[i]
        cur.append(i)
        cur_max = m
    if cur:
        groups.append(cur)
    return groups


def _check_tokens(what: str, tokens, spec: ModelSpec) -> list[int]:
    toks = [int(t) for t in tokens]
    if not toks:
        raise EngineUserError(f"{what} is empty")
    if len(toks) > spec.max_context:
        raise EngineUserError(f"{what} has {len(toks)} tokens, longer than the context of "
                              f"{spec.name!r} ({spec.max_context})")
    lo, hi = min(toks), max(toks)
    if lo < 0 or hi >= spec.vocab_size:
        bad = lo if lo < 0 else hi
        raise EngineUserError(f"{what}: token id {bad} is outside the vocabulary [0, {spec.vocab_size}) "
                              f"of {spec.name!r}")
    return toks


def _check_name(what: str, value) -> None:
    if not isinstance(value, str) or not _NAME_RE.match(value) or ".." in value:
        raise EngineUserError(f"{what} {value!r} must match [A-Za-z0-9][A-Za-z0-9._-]* (no '..', "
                              "at most 200 characters)")


def _available_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def _cpu_bf16_supported() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # pragma: no cover - older torch
        return False
