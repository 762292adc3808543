"""Checkpoint files of the local engine (safetensors + json), written atomically.

Layout of a checkpoint directory ``root/checkpoints/<model_id>/{weights,sampler_weights}/<name>/``:

- ``adapter_model.safetensors``: LoRA tensors keyed as peft's ``get_peft_model_state_dict`` names
  them (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), fp32;
- ``adapter_config.json``: the peft ``LoraConfig`` (``PeftModel.from_pretrained`` loads the dir);
- ``tinker_state.json``: engine metadata (kind, model_id, name, base_model, lora_rank, lora_alpha,
  train_mlp/train_attn/train_unembed, seed, step);
- ``optimizer.safetensors`` (state checkpoints only): AdamW state per parameter key:
  ``<key>::step`` (float32 scalar), ``<key>::exp_avg``, ``<key>::exp_avg_sq``.

Round trips are bit-exact (tensors are stored in their own dtype).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path

import torch

from .errors import EngineUserError

STATE_FILE = "tinker_state.json"
ADAPTER_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"


def write_checkpoint(
    final: Path,
    params: Mapping[str, torch.Tensor],
    adapter_config: dict,
    meta: dict,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """Write a checkpoint directory at ``final`` (replacing an existing one) via a temp dir and
    a rename, so readers never see half-written files.  ``params``: key -> parameter;
    ``optimizer``: the AdamW whose state to store (None: adapter only).  Returns ``final``."""
    from safetensors.torch import save_file

    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        sd = {k: p.detach().to("cpu").contiguous().clone() for k, p in params.items()}
        save_file(sd, str(tmp / ADAPTER_FILE))
        cfg = {k: (sorted(v) if isinstance(v, (set, frozenset)) else v) for k, v in adapter_config.items()}
        (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=1, default=str))
        if optimizer is not None:
            osd = {}
            for k, p in params.items():
                s = optimizer.state.get(p)
                if not s:  # no step taken for this parameter yet
                    continue
                osd[f"{k}::step"] = torch.as_tensor(s["step"], dtype=torch.float32).detach().cpu().clone()
                osd[f"{k}::exp_avg"] = s["exp_avg"].detach().cpu().contiguous().clone()
                osd[f"{k}::exp_avg_sq"] = s["exp_avg_sq"].detach().cpu().contiguous().clone()
            save_file(osd, str(tmp / OPTIMIZER_FILE))
        (tmp / STATE_FILE).write_text(json.dumps(meta, indent=1))
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def checkpoint_info(path: Path) -> dict:
    """Read ``tinker_state.json`` of a checkpoint directory written by this engine: ``{"kind":
    "weights"|"sampler_weights", "model_id", "name", "base_model", "lora_rank", "train_mlp",
    "train_attn", "train_unembed", "seed", "step", ...}``.  EngineUserError if absent/invalid."""
    path = Path(path)
    try:
        meta = json.loads((path / STATE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise EngineUserError(f"{str(path)!r} is not a tinker_local checkpoint directory ({e})") from e
    for k in ("base_model", "lora_rank", "train_mlp", "train_attn", "train_unembed"):
        if k not in meta:
            raise EngineUserError(f"checkpoint {str(path)!r}: {STATE_FILE} lacks {k!r}")
    if not (path / ADAPTER_FILE).is_file():
        raise EngineUserError(f"checkpoint {str(path)!r} has no {ADAPTER_FILE}")
    return meta


def read_adapter(path: Path, params: Mapping[str, torch.Tensor], model_id: str) -> dict[str, torch.Tensor]:
    """Load the adapter tensors of checkpoint ``path`` and check they fit ``params`` (same keys
    and shapes); EngineUserError naming the checkpoint and ``model_id`` otherwise."""
    from safetensors.torch import load_file

    sd = load_file(str(Path(path) / ADAPTER_FILE))
    if set(sd) != set(params) or any(tuple(sd[k].shape) != tuple(params[k].shape) for k in sd):
        raise EngineUserError(f"checkpoint {str(path)!r} has LoRA rank/targets that do not match model_id {model_id!r}")
    return sd


def read_optimizer_state(path: Path, params: Mapping[str, torch.Tensor]) -> dict[torch.Tensor, dict]:
    """AdamW ``state`` entries (param -> {"step", "exp_avg", "exp_avg_sq"}) from checkpoint
    ``path``; parameters saved before their first step get none.  EngineUserError if the
    checkpoint has no optimizer file (sampler weights)."""
    from safetensors.torch import load_file

    f = Path(path) / OPTIMIZER_FILE
    if not f.is_file():
        raise EngineUserError(
            f"checkpoint {str(path)!r} has no optimizer state (sampler weights?); load it without optimizer"
        )
    osd = load_file(str(f))
    state = {}
    for k, p in params.items():
        if f"{k}::exp_avg" in osd:
            state[p] = {
                "step": osd[f"{k}::step"].clone(),
                "exp_avg": osd[f"{k}::exp_avg"].to(p.device).clone(),
                "exp_avg_sq": osd[f"{k}::exp_avg_sq"].to(p.device).clone(),
            }
    return state
