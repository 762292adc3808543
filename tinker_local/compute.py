"""Small compute helpers of the engine: fp32 output head and logprobs, weights dtype and attention
kernels, bf16 support, CPU count, allocator."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

import torch

from .attention import SEGMENT_ATTENTION, register_segment_attention

logger = logging.getLogger("tinker_local.compute")


def decoder_and_head(model):
    """``(decoder, output head)`` of a llama-like causal LM whose logits are the head applied to the
    decoder's last hidden state, or None for others (no such parts, or logits soft-capping /
    scaling after the head): those run as one forward."""
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings()
    special = any(getattr(model.config, k, None) for k in ("final_logit_softcapping", "logit_scale"))
    if decoder is None or head is None or special or decoder is model:
        return None
    return decoder, head


def fp32_head_logits(model, ids: torch.Tensor, position_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """Logits float32 (B, T, V) of ``ids`` (B, T): the decoder under the ambient autocast, the
    output projection in fp32 (llama-like models; others: the model's own forward, upcast).
    ``position_ids`` (B, T) and ``kwargs`` (a packed row's ``segments``:
    ``tinker_local.packing``) are passed to the model."""
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    parts = decoder_and_head(model)
    if parts is None:
        return model(input_ids=ids, use_cache=False, **kwargs).logits.float()
    decoder, head = parts
    hidden = decoder(input_ids=ids, use_cache=False, **kwargs).last_hidden_state
    with torch.autocast(ids.device.type, enabled=False):
        return head(hidden.float()).float()


def target_logprobs(logits: torch.Tensor, rows: torch.Tensor | None, targets: torch.Tensor) -> torch.Tensor:
    """Logprobs of ``targets`` under ``logits``: float32 (N, K) where ``targets`` is int64 (N, K)
    and row ``n`` is read from logits row ``rows[n]`` (``rows`` None: row n; rows may repeat, as
    for a shared prefix).  ``logits``: (U, V), any float dtype (computed in fp32).

    Forward: one fused log-softmax over the (U, V) logits and one gather of N * K entries, as
    autograd would do it (a gather minus a separate ``logsumexp`` costs several more passes over
    (U, V)).  Backward (:class:`_TargetLogprobs`): the gradient of the logits is written in one
    pass, ``-softmax * (sum of the row's incoming gradients)``, into the saved log-softmax itself,
    then the incoming gradients are added at the targets.  Autograd's own backward of the same
    forward fills a zero (U, V) tensor, scatters into it and runs the log-softmax backward over
    it into a third (U, V) tensor: on SmolLM2's 49,152-token vocabulary and 2,048 tokens that took
    1.0 s against 0.57 s here (one thread), with equal logprobs and logit gradients equal to
    float rounding (6e-8)."""
    V = logits.shape[-1]
    r = torch.arange(targets.shape[0], device=targets.device) if rows is None else rows
    flat = (r.unsqueeze(-1) * V + targets).reshape(-1)
    return _TargetLogprobs.apply(logits, flat).reshape(targets.shape)


class _TargetLogprobs(torch.autograd.Function):
    """``log_softmax(logits).flatten()[flat]`` with a one-pass backward (see
    :func:`target_logprobs`).  Differentiable once: the backward overwrites the saved
    log-softmax (nothing else holds it)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        lsm = torch.log_softmax(logits.float(), dim=-1)
        ctx.save_for_backward(lsm, flat)
        ctx.logits_dtype = logits.dtype
        return lsm.reshape(-1).index_select(0, flat)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        lsm, flat = ctx.saved_tensors
        g = grad.reshape(-1).to(lsm.dtype)
        row_sums = torch.zeros(lsm.shape[0], dtype=lsm.dtype, device=lsm.device)
        row_sums.index_add_(0, torch.div(flat, lsm.shape[-1], rounding_mode="floor"), g)
        out = lsm.exp_().mul_(row_sums.neg_().unsqueeze(-1))  # d/dlogits of every logprob read
        out.view(-1).index_add_(0, flat, g)  # plus the one-hot part at the targets
        return out.to(ctx.logits_dtype), None


def choose_attn_implementation(device: torch.device, weights_dtype: torch.dtype) -> str:
    """The attention kernels a base model is loaded with: ``"flash_attention_2"`` on CUDA when
    the ``flash_attn`` package is installed and the weights are bf16 / fp16 (its kernels take no
    fp32), else ``tinker_local.attention.SEGMENT_ATTENTION`` (SDPA, per segment of a packed row;
    registered with ``transformers`` here).  With flash-attention 2 the engine keeps packed
    datums apart by restarting positions (its varlen kernels) and shares no prefixes; with
    segment attention by the row's segments (``tinker_local.packing``)."""
    import importlib.util

    if (
        device.type == "cuda"
        and weights_dtype in (torch.bfloat16, torch.float16)
        and importlib.util.find_spec("flash_attn") is not None
    ):
        return "flash_attention_2"
    register_segment_attention()
    return SEGMENT_ATTENTION


def to_weights_dtype(model, dtype: torch.dtype) -> None:
    """Cast ``model``'s floating parameters to ``dtype`` in place, except the output head's weight,
    kept (or made) fp32: the engine computes logits and logprobs in fp32.  Buffers stay as they are
    (rotary frequencies are fp32).  A head tied to the input embedding gets an fp32 copy of its
    own (the embedding lookup runs in ``dtype``), and the config no longer ties them, so nothing
    ties them back.  No-op for fp32."""
    if dtype == torch.float32:
        return
    head = model.get_output_embeddings()
    fp32_head = head.weight.detach().float().clone() if head is not None else None
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)
    if head is not None and fp32_head is not None:
        head.weight = torch.nn.Parameter(fp32_head, requires_grad=False)
        model.config.tie_word_embeddings = False
        text = getattr(model.config, "text_config", None)
        if text is not None and hasattr(text, "tie_word_embeddings"):
            text.tie_word_embeddings = False


def available_cpus() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - non-Linux
        return max(1, os.cpu_count() or 1)


def bf16_supported(device: torch.device) -> bool:
    try:
        if device.type == "cuda":
            return bool(torch.cuda.is_bf16_supported())
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - older torch / no driver
        return False


# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3


def keep_freed_memory(top_pad_mb: int = 256, trim_threshold_mb: int = 1024) -> bool:
    """Make glibc malloc keep and reuse freed activation memory instead of returning it.

    A training step allocates and frees the same activation and gradient buffers every time;
    with glibc's defaults, blocks above the mmap threshold (128 KiB, raised dynamically up to
    32 MiB) are mapped and unmapped per use and the heap top is trimmed as soon as it is free,
    so every step page-faults much of its working set in again (measured: ~25,000 minor faults
    per step of a 10M model on 8 x 256 tokens; a few with this).
    Sets ``M_MMAP_THRESHOLD`` to its maximum (32 MiB on 64-bit), ``M_TOP_PAD`` and
    ``M_TRIM_THRESHOLD`` (MiB).  The cost: the process keeps up to ``trim_threshold_mb`` of
    freed memory (its RSS stays near its peak).  Environment ``TINKER_LOCAL_MALLOC=default``
    leaves the allocator alone.  Returns True when applied (glibc only; elsewhere a no-op).
    """
    if os.environ.get("TINKER_LOCAL_MALLOC", "").lower() == "default":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mib = 1 << 20
    ok = all(
        mallopt(k, v) == 1
        for k, v in (
            (_M_MMAP_THRESHOLD, 32 * mib),
            (_M_TOP_PAD, top_pad_mb * mib),
            (_M_TRIM_THRESHOLD, trim_threshold_mb * mib),
        )
    )
    logger.debug("malloc tuning %s", "applied" if ok else "refused")
    return ok
