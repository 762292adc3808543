"""Small compute helpers of the engine: fp32 output head, bf16 support, CPU count."""

from __future__ import annotations

import os

import torch


def fp32_head_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) float32: the decoder under the ambient autocast, the output projection in
    fp32 (llama-like models; others: the model's own forward, upcast)."""
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    head = model.get_output_embeddings()
    special = any(getattr(model.config, k, None) for k in ("final_logit_softcapping", "logit_scale"))
    if decoder is None or head is None or special or decoder is model:
        return model(input_ids=ids, use_cache=False).logits.float()
    hidden = decoder(input_ids=ids, use_cache=False).last_hidden_state
    with torch.autocast(ids.device.type, enabled=False):
        return head(hidden.float()).float()


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
