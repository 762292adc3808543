"""The torch compute engine behind ``tinker_local``: LoRA training and sampling, no HTTP.

One ``Engine`` owns a folder ``root`` (``root/"models"`` caches preset files,
``root/"checkpoints"/<model_id>/{weights,sampler_weights}/<name>/`` holds checkpoints, see
``tinker_local.checkpoints``) and any number of training models ("model ids"), each a named LoRA
adapter over a shared base model.  Each base model is loaded once per canonical name and wrapped
in one ``peft.PeftModel`` holding all adapters (training adapters ``t<n>`` and cached sampler
adapters ``s<n>``, a bounded number of each resident: ``tinker_local.engine_core``); every call
activates the adapter it needs, so model ids never see each other's weights, gradients or
optimizer state.  Base weights stay frozen, in fp32 on the CPU and in the compute dtype on CUDA
(``weights_dtype``; the output head always fp32).  The attention kernels are chosen at load
(flash-attention 2 on CUDA where installed, else SDPA) and recorded (``get_info``).  LoRA details
(targets, alpha 32, init): ``tinker_local.adapters``.

Numerics: ``dtype="auto"`` trains under bf16 autocast (CUDA with bf16, or a CPU with
avx512_bf16/AMX), otherwise fp32; ``"fp32"`` / ``"bf16"`` force it.  The output projection and
the logprobs are always computed in fp32 (one fused log-softmax and a gather:
``tinker_local.compute.target_logprobs``).  Sampling runs in the weights' dtype: in fp32 with fp32
weights (the CPU default; sampled logprobs then match an fp32 ``forward``), under bf16 autocast
with bf16 weights (``tinker_local.engine_sampling``).

Padding-free batches (``tinker_local.packing``): the datums of a micro-batch are laid out back to
back in one row with attention kept inside each (``tinker_local.attention``), and datums
beginning with the same tokens (a DPO pair's prompt, a GRPO group's prompt) compute those tokens
once (``share_prefixes``).

Threading: public methods take one re-entrant lock, so calls from several threads are
serialised (safe, not parallel); the intended use is one dedicated compute thread, so training
and sampling never overlap inside one engine.  The engine sets ``torch.set_num_threads(
num_threads)`` (default: the CPUs this process may use) and restores it at each call; small
work runs on one thread (a forward/backward of fewer than ``SMALL_WORK`` parameter x token
products, a decode step of fewer than 5e7 parameter x row products), where OpenMP barriers cost
more than a second core gives, and where a thread team stalls badly when another process holds
the other cores.  The choice depends only on the work's size, so results stay deterministic.
Several servers (or a server and a torch client) on one machine: give each ``num_threads`` so
that their sum stays within the cores (``serve --threads``).
"""

from __future__ import annotations

import secrets
from pathlib import Path

import numpy as np
import torch

from .adapters import LORA_ALPHA, adapter_params, lora_config, remove_adapter
from .checkpoints import checkpoint_info, read_adapter, read_optimizer_state, write_checkpoint
from .compute import fp32_head_logits, target_logprobs
from .datatypes import Datum, FwdResult, SampleResult
from .engine_core import BaseModelState, TrainingState, new_adamw
from .engine_sampling import SamplingMixin
from .errors import EngineUserError, UnknownModelError
from .inputs import check_datum, check_name, microbatches
from .losses import get_loss_fn
from .media import media_logits, resolve_chunks
from .packing import (
    layout_costs,
    packed_batch,
    packed_logits,
    shared_prefix_units,
    split_microbatches,
    unit_length,
)

SMALL_WORK = 1e9  # parameter x token products below which a forward/backward runs on one thread

__all__ = ["Engine", "Datum", "FwdResult", "SampleResult", "EngineUserError", "UnknownModelError", "checkpoint_info"]


class Engine(SamplingMixin):
    """LoRA training and sampling over local base models; see the module docstring.  Sampling
    (``sample``, ``sample_many``): ``tinker_local.engine_sampling``; the state both use (base
    models, training models, lock, device, threads; ``Engine(root, device=, dtype=,
    num_threads=)``): ``tinker_local.engine_core``."""

    # ------------------------------------------------------------------ models and adapters

    def create_model(
        self,
        model_id: str,
        base_model: str,
        lora_rank: int,
        *,
        seed: int | None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
    ) -> None:
        """Create training model ``model_id``: a fresh LoRA adapter of rank ``lora_rank`` over
        ``base_model`` (loaded on first use), with a fresh AdamW state at step 0.  ``seed`` fixes
        the adapter init (None: random).  Raises EngineUserError for a duplicate/invalid id, an
        unknown base model, rank < 1, or no trainable target."""
        with self._lock:
            check_name("model_id", model_id)
            if model_id in self._models:
                raise EngineUserError(f"model_id {model_id!r} already exists")
            if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 1:
                raise EngineUserError(f"lora_rank must be a positive integer, got {lora_rank!r}")
            if not (train_mlp or train_attn or train_unembed):
                raise EngineUserError("at least one of train_mlp, train_attn, train_unembed must be true")
            b = self._base(base_model)
            seed = int(seed) if seed is not None else secrets.randbelow(2**31)
            cfg = lora_config(
                b.model, lora_rank, mlp=train_mlp, attn=train_attn, unembed=train_unembed, model_name=b.spec.name
            )
            b.counter += 1
            name = f"t{b.counter}"
            self._inject(b, name, cfg, seed)
            params = adapter_params(b.peft, name)
            self._models[model_id] = TrainingState(
                model_id,
                base_model,
                b.spec.name,
                name,
                lora_rank,
                bool(train_mlp),
                bool(train_attn),
                bool(train_unembed),
                seed,
                b.peft.peft_config[name],
                params,
                new_adamw(params),
            )

    def delete_model(self, model_id: str) -> None:
        """Drop ``model_id`` (its adapter and optimizer state); checkpoints on disk stay."""
        with self._lock:
            st = self._train(model_id)
            b = self._bases.get(st.base_key)  # an unloaded base model holds no adapter
            if b is not None and st.adapter in b.resident:
                del b.resident[st.adapter]
                remove_adapter(b.peft, st.adapter)
                b.active = None
            del self._models[model_id]
            if self._kept_forward is not None and self._kept_forward[0] == model_id:
                self._kept_forward = None

    def list_models(self) -> list[str]:
        """The ids of the training models that exist now."""
        with self._lock:
            return list(self._models)

    def get_info(self, model_id: str) -> dict:
        """``{"model_id", "base_model", "lora_rank", "arch", "tokenizer_id" (local dir),
        "max_context", "vocab_size", "train_mlp", "train_attn", "train_unembed", "step",
        "weights_dtype", "attn_implementation"}``;
        EngineUserError if the id is unknown."""
        with self._lock:
            st = self._train(model_id)
            b = self._loaded(st.base_key)
            return {
                "model_id": model_id,
                "base_model": st.base_name,
                "lora_rank": st.lora_rank,
                "arch": getattr(b.model.config, "model_type", None),
                "tokenizer_id": b.spec.tokenizer_dir,
                "max_context": b.spec.max_context,
                "vocab_size": b.spec.vocab_size,
                "train_mlp": st.train_mlp,
                "train_attn": st.train_attn,
                "train_unembed": st.train_unembed,
                "step": st.step,
                "weights_dtype": self.weights_dtype,
                "attn_implementation": b.attn_implementation,
            }

    # ------------------------------------------------------------------ forward / backward

    def forward(self, model_id: str, datums: list[Datum], loss_fn: str, loss_fn_config: dict | None) -> FwdResult:
        """Logprobs and loss of ``datums`` under ``model_id`` without touching gradients.
        See ``forward_backward`` for shapes and errors."""
        return self._run(model_id, datums, loss_fn, loss_fn_config, backward=False)

    def forward_backward(
        self, model_id: str, datums: list[Datum], loss_fn: str, loss_fn_config: dict | None
    ) -> FwdResult:
        """Like ``forward``, and also add d(loss:sum)/d(adapter params) to the gradients (they
        accumulate over calls until ``optim_step``).  ``loss_fn``: a name of
        ``tinker_local.losses`` or a per-datum loss object with ``prepare(i, raw inputs,
        target_tokens, device) -> inputs`` and ``__call__(lp, inputs, cfg) -> scalar loss``
        (``tinker_local.custom_loss.BoundLoss``), which validates its own inputs.

        Datums may have different lengths: on text-only models they are packed padding-free
        into one row per micro-batch with attention kept inside each datum (``tinker_local.packing``; off with
        ``Engine.packing = False``), else right-padded, in micro-batches of a bounded number of
        token slots; and media chunks (``Datum.chunks``: images for vision-language
        models, DMel audio for ``tiny-audio``; ``tinker_local.media``).  Returns per datum
        ``{"logprobs": float32 array shaped like target_tokens}`` and ``{"loss:sum": sum of the
        per-datum losses}``.  All datums are validated before any compute, so a user error
        leaves the gradients untouched.
        Raises EngineUserError: unknown model id or loss fn, empty/too-long sequence, token or
        target id outside ``[0, vocab_size)``, missing/mis-shaped/non-finite loss inputs, media
        the model cannot take or whose token count differs from ``expected_tokens``."""
        return self._run(model_id, datums, loss_fn, loss_fn_config, backward=True)

    def _run(self, model_id, datums, loss_fn, loss_fn_config, backward: bool) -> FwdResult:
        with self._lock:
            st = self._train(model_id)
            b = self._loaded(st.base_key)
            custom = callable(loss_fn)  # a per-datum loss object (tinker_local.custom_loss)
            fn = loss_fn if custom else get_loss_fn(loss_fn)
            cfg = dict(loss_fn_config or {})
            spec = b.spec
            prepared = []
            for i, d in enumerate(datums):
                inputs = {k: v for k, v in d.inputs.items() if k == "target_tokens"} if custom else d.inputs
                tokens, media = d.tokens, None
                if d.chunks or self._media(b) is not None:  # images / audio: tinker_local.media
                    tokens, media = resolve_chunks(
                        self._media(b), d.chunks or [d.tokens], f"datum {i}: model_input", spec.name
                    )
                toks, tgt, inp = check_datum(
                    i,
                    tokens,
                    inputs,
                    "cross_entropy" if custom else loss_fn,
                    spec.vocab_size,
                    spec.max_context,
                    spec.name,
                    self.device,
                )
                prepared.append((toks, tgt, loss_fn.prepare(i, d.inputs, tgt, self.device) if custom else inp, media))
            self._activate(b, st)
            work = b.n_params * sum(len(p[0]) for p in prepared)
            self._threads(1 if work < SMALL_WORK else None)
            outputs: list[dict[str, np.ndarray]] = [{} for _ in prepared]
            total = 0.0
            budget = self.max_batch_tokens or max(256, min(16384, 2**27 // max(spec.vocab_size, 1)))
            packed = self.packing and self._packs(b)
            groups = self._layout(b, [p[0] for p in prepared], budget, packed)
            # The SDK's forward_backward_custom (a client-side loss such as DPO's) sends a forward,
            # then a forward_backward of the same tokens with weights = -d(loss)/d(logprobs).  A
            # forward of one micro-batch therefore runs with autograd on and keeps its graph (no
            # more memory than a forward_backward of it holds); a forward_backward of the same
            # model, tokens and targets before any update takes its logprobs from that graph and
            # only runs backward: one forward pass less per step, the same gradients.
            kept, self._kept_forward = self._kept_forward, None
            reuse = None
            keep = not backward and not custom and len(groups) == 1 and all(p[3] is None for p in prepared)
            key = None
            if keep or (backward and not custom and kept is not None and kept[0] == model_id):
                key = tuple((tuple(p[0]), tuple(p[1].shape), tuple(p[1].reshape(-1).tolist())) for p in prepared)
                if backward and kept is not None and kept[1] == key:
                    reuse = kept[2]
            # a custom loss may fail in a later micro-batch (a limit, a node that raises): the
            # gradients of the earlier ones are then taken back, so a failed request adds none
            saved = (
                {k: None if p.grad is None else p.grad.clone() for k, p in st.params.items()}
                if backward and custom and len(groups) > 1
                else None
            )
            done: list[tuple[list[int], list[torch.Tensor]]] = []
            try:
                for mb in reuse if reuse is not None else groups:
                    with torch.set_grad_enabled(backward or keep):
                        if reuse is not None:
                            items, lps = mb
                        elif packed:
                            items, lps = self._packed_logprobs(b, mb, prepared)
                        else:
                            items = list(mb)
                            lps = self._logprobs(b, [prepared[i] for i in items])
                        loss = sum(fn(lp, prepared[i][2], cfg) for i, lp in zip(items, lps, strict=True))
                        if backward and isinstance(loss, torch.Tensor) and loss.requires_grad:
                            loss.backward()
                    if keep:
                        done.append((items, lps))
                    for i, lp in zip(items, lps, strict=True):
                        outputs[i] = {"logprobs": lp.detach().float().cpu().numpy()}
                    total += float(loss.detach()) if isinstance(loss, torch.Tensor) else float(loss)
                if keep and key is not None:
                    self._kept_forward = (model_id, key, done)
            except Exception:
                if saved is not None:
                    for k, p in st.params.items():
                        p.grad = saved[k]
                raise
            return FwdResult(outputs=outputs, metrics={"loss:sum": total})

    def _layout(self, b: BaseModelState, tokens: list[list[int]], budget: int, packed: bool) -> list[list]:
        """Micro-batches: padded, lists of item indices (one row each); packed, lists of
        ``tinker_local.packing`` units laid out in one row, datums with a common prefix sharing
        it where the model runs segment attention and ``share_prefixes`` is on."""
        lengths = [len(t) for t in tokens]
        if not packed:
            return microbatches(lengths, budget)
        share = self.share_prefixes and self._segments(b)
        units = shared_prefix_units(tokens, layout_costs(b.model.config)) if share else list(range(len(tokens)))
        sizes = [unit_length(u, lengths) for u in units]
        return [[units[u] for u in mb] for mb in split_microbatches(sizes, budget)]

    def _logprobs(self, b: BaseModelState, items) -> list[torch.Tensor]:
        """One right-padded batch -> per item logprobs (N,) / (N, K) float32 (with grad), read
        once over the whole batch by ``tinker_local.compute.target_logprobs``."""
        lens = [len(it[0]) for it in items]
        B, T = len(items), max(lens)
        K = max((it[1].shape[1] if it[1].ndim == 2 else 1) for it in items)
        ids = torch.zeros((B, T), dtype=torch.long)
        tgt = torch.zeros((B, T, K), dtype=torch.long)
        for r, it in enumerate(items):
            ids[r, : lens[r]] = torch.as_tensor(it[0], dtype=torch.long)
            tgt[r, : lens[r], : (it[1].shape[1] if it[1].ndim == 2 else 1)] = it[1].reshape(lens[r], -1)
        ids, tgt = ids.to(self.device), tgt.to(self.device)
        payloads = [p for it in items for p in (it[3] if len(it) > 3 and it[3] else [])]  # row-major
        with self._autocast():  # causal attention + right padding: pads never reach real tokens
            if payloads:
                logits = media_logits(b.model, self._media(b), ids, payloads)  # (B, T, V) float32
            else:
                logits = fp32_head_logits(b.model, ids)  # (B, T, V) float32
        lp = target_logprobs(logits.reshape(B * T, -1), None, tgt.reshape(B * T, K)).reshape(B, T, K)
        out = []
        for r, it in enumerate(items):
            x = lp[r, : lens[r]]
            out.append(x[:, : it[1].shape[1]] if it[1].ndim == 2 else x[:, 0])
        return out

    def _packed_logprobs(self, b: BaseModelState, units: list, prepared) -> tuple[list[int], list[torch.Tensor]]:
        """One padding-free micro-batch (``units`` of ``tinker_local.packing`` over indices into
        ``prepared``, one row) -> (the item indices, their logprobs (N,) / (N, K) float32 with
        grad), read once over all the row's token slots as in ``_logprobs``."""
        pb = packed_batch(units, [p[0] for p in prepared], segments=self._segments(b))
        tgts = [prepared[i][1].reshape(len(prepared[i][0]), -1) for i in pb.items]
        K = max(t.shape[1] for t in tgts)
        tgt = torch.zeros((len(pb.index), K), dtype=torch.long)
        for (a, z), t in zip(pb.spans, tgts, strict=True):
            tgt[a:z, : t.shape[1]] = t
        with self._autocast():
            logits = packed_logits(b.model, pb, self.device)  # (T, V) float32
        lp = target_logprobs(logits, pb.index.to(self.device), tgt.to(self.device))  # (N, K)
        out = []
        for i, (a, z) in zip(pb.items, pb.spans, strict=True):
            soft = prepared[i][1].ndim == 2
            out.append(lp[a:z, : prepared[i][1].shape[1]] if soft else lp[a:z, 0])
        return pb.items, out

    # ------------------------------------------------------------------ optimizer

    def optim_step(
        self,
        model_id: str,
        *,
        learning_rate: float,
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-12,
        weight_decay: float = 0.0,
        grad_clip_norm: float = 0.0,
    ) -> dict[str, float]:
        """One AdamW step on the accumulated gradients of ``model_id``, then zero them.

        Semantics (Tinker ``AdamParams``): if ``grad_clip_norm > 0`` the gradients are scaled by
        ``min(1, grad_clip_norm / (global_norm + 1e-6))`` first; then ``torch.optim.AdamW``
        (decoupled decay ``p -= lr*wd*p``, bias-corrected moments, ``eps`` added to the
        bias-corrected sqrt of the second moment).  Returns ``{"grad_norm:mean": global L2 norm
        before clipping, "learning_rate:mean": lr, "step:max": steps taken so far}``.
        Raises EngineUserError for an unknown id or an out-of-range/NaN hyperparameter."""
        with self._lock:
            st = self._train(model_id)
            # element-wise updates of a LoRA: OpenMP barriers cost more than a second core gives
            self._threads(1 if sum(p.numel() for p in st.params.values()) < 2e7 else None)
            for k, v in (
                ("learning_rate", learning_rate),
                ("eps", eps),
                ("weight_decay", weight_decay),
                ("grad_clip_norm", grad_clip_norm),
            ):
                if not (float(v) >= 0.0 and np.isfinite(float(v))):
                    raise EngineUserError(f"{k} must be a finite number >= 0, got {v!r}")
            for k, v in (("beta1", beta1), ("beta2", beta2)):
                if not (0.0 <= float(v) < 1.0):
                    raise EngineUserError(f"{k} must be in [0, 1), got {v!r}")
            params = list(st.params.values())
            grads = [p.grad for p in params if p.grad is not None]
            norm = (
                float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
                if grads
                else 0.0
            )
            if grad_clip_norm > 0 and grads:
                torch.nn.utils.clip_grad_norm_(params, max_norm=float(grad_clip_norm))
            for g in st.optimizer.param_groups:
                g.update(
                    lr=float(learning_rate),
                    betas=(float(beta1), float(beta2)),
                    eps=float(eps),
                    weight_decay=float(weight_decay),
                )
            self._kept_forward = None  # its graph is of the weights before this step
            st.optimizer.step()
            st.optimizer.zero_grad(set_to_none=True)
            st.step += 1
            return {"grad_norm:mean": norm, "learning_rate:mean": float(learning_rate), "step:max": float(st.step)}

    # ------------------------------------------------------------------ checkpoints

    def save_state(self, model_id: str, name: str) -> Path:
        """Write adapter, AdamW state and step to ``root/checkpoints/<model_id>/weights/<name>/``
        atomically (replacing an older one of that name); returns the directory.  Raises
        EngineUserError for an unknown id or a name that is not ``[A-Za-z0-9][A-Za-z0-9._-]*``."""
        with self._lock:
            st = self._train(model_id)
            check_name("checkpoint name", name)
            return self._write_ckpt(st, "weights", name, with_optimizer=True)

    def save_sampler_weights(self, model_id: str, name: str) -> Path:
        """Write the adapter only (loadable by ``sample``, ``load_state(with_optimizer=False)``
        and ``peft.PeftModel.from_pretrained``) to
        ``root/checkpoints/<model_id>/sampler_weights/<name>/``; returns the directory."""
        with self._lock:
            st = self._train(model_id)
            check_name("checkpoint name", name)
            return self._write_ckpt(st, "sampler_weights", name, with_optimizer=False)

    def save_external_weights(self, model_id: str, name: str) -> Path:
        """Write the adapter in PEFT format (``adapter_model.safetensors`` +
        ``adapter_config.json``, loadable by ``peft.PeftModel.from_pretrained`` onto the base
        model; plus ``tinker_state.json``) to ``root/checkpoints/<model_id>/external_weights/<name>/``;
        returns the directory."""
        with self._lock:
            st = self._train(model_id)
            check_name("checkpoint name", name)
            return self._write_ckpt(st, "external_weights", name, with_optimizer=False)

    def load_state(self, model_id: str, path: Path, *, with_optimizer: bool) -> None:
        """Load checkpoint ``path`` (from ``save_state``; adapter-only ``save_sampler_weights``
        when ``with_optimizer`` is False) into ``model_id``, bit-exactly.  An unknown id is
        created from the checkpoint's base model / rank / targets.  Without optimizer the AdamW
        state and step restart at 0.  Pending gradients are dropped.  Raises EngineUserError if
        the path is not a checkpoint, is for another base model or LoRA shape, or lacks
        optimizer state when ``with_optimizer``."""
        with self._lock:
            path = Path(path)
            meta = checkpoint_info(path)
            created = model_id not in self._models
            if created:
                self.create_model(
                    model_id,
                    meta["base_model"],
                    int(meta["lora_rank"]),
                    seed=int(meta.get("seed") or 0),
                    train_mlp=meta["train_mlp"],
                    train_attn=meta["train_attn"],
                    train_unembed=meta["train_unembed"],
                )
            st = self._train(model_id)
            try:
                if self._canonical(meta["base_model"]) != st.base_key:
                    raise EngineUserError(
                        f"checkpoint {str(path)!r} is for base model "
                        f"{meta['base_model']!r}; model_id {model_id!r} uses "
                        f"{st.base_name!r}"
                    )
                sd = read_adapter(path, st.params, model_id)
                opt_state = read_optimizer_state(path, st.params) if with_optimizer else {}
            except EngineUserError:
                if created:
                    self.delete_model(model_id)
                raise
            self._kept_forward = None  # its graph is of the weights before this load
            with torch.no_grad():
                for k, p in st.params.items():
                    p.copy_(sd[k].to(p.device, p.dtype))
                    p.grad = None
            st.optimizer = new_adamw(st.params)
            st.optimizer.state.update(opt_state)
            st.step = int(meta.get("step", 0)) if with_optimizer else 0

    def _write_ckpt(self, st: TrainingState, kind: str, name: str, with_optimizer: bool) -> Path:
        b = self._loaded(st.base_key)
        cfg = st.config.to_dict()
        cfg["base_model_name_or_path"] = b.spec.model_dir or b.spec.name
        meta = {
            "format": 1,
            "kind": kind,
            "model_id": st.model_id,
            "name": name,
            "base_model": st.base_name,
            "base_model_canonical": st.base_key,
            "lora_rank": st.lora_rank,
            "lora_alpha": LORA_ALPHA,
            "train_mlp": st.train_mlp,
            "train_attn": st.train_attn,
            "train_unembed": st.train_unembed,
            "seed": st.seed,
            "step": st.step,
        }
        final = self.root / "checkpoints" / st.model_id / kind / name
        return write_checkpoint(final, st.params, cfg, meta, optimizer=st.optimizer if with_optimizer else None)
