"""Reading a LoRA adapter in PEFT format (``adapter_model.safetensors`` + ``adapter_config.json``)
as per-module weight deltas.

A LoRA target module ``m`` with ``lora_A`` (r, in) and ``lora_B`` (out, r) changes its weight by
``(alpha / r) * B @ A`` (Hu et al. 2021, "LoRA", arXiv:2106.09685, eq. 3; ``alpha / sqrt(r)`` with
``use_rslora``, Kalajdzievski 2023, arXiv:2312.03732), transposed for GPT-2 style ``Conv1D`` weights
(``fan_in_fan_out``); an embedding target (``lora_embedding_A`` (r, vocab), ``lora_embedding_B``
(dim, r)) by ``(alpha / r) * (B @ A)^T``. ``r`` is read from each module's tensors (so
``rank_pattern`` needs no special case); settings that change the formula in other ways
(``alpha_pattern``, DoRA, LoRA biases, ``modules_to_save``) are refused rather than ignored.
Adapter keys are ``base_model.model.<module>.lora_{A,B}.weight`` (what ``PeftModel.save_pretrained``
and ``tinker_local`` write).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["AdapterError", "LoraAdapter", "LoraDelta", "read_adapter"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
_KEY = re.compile(
    r"^base_model\.model\.(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B)$"
)
_BASE_COPY = re.compile(r"^base_model\.model\.(?P<module>.+)\.base_layer\.weight$")


class AdapterError(ValueError):
    """An adapter that cannot be merged exactly (the message names the file, key or setting)."""


@dataclass
class LoraDelta:
    """One target module's low-rank update.

    Attributes:
        module: the module's path in the model (``model.layers.0.self_attn.q_proj``).
        a: ``lora_A`` (r, in) or ``lora_embedding_A`` (r, vocab), float32.
        b: ``lora_B`` (out, r) or ``lora_embedding_B`` (dim, r), float32.
        scale: ``alpha / r`` (or ``alpha / sqrt(r)``).
        embedding: an embedding target (``lora_embedding_*``).
        fan_in_fan_out: the weight is stored (in, out) (GPT-2 ``Conv1D``).
    """

    module: str
    a: torch.Tensor
    b: torch.Tensor
    scale: float
    embedding: bool = False
    fan_in_fan_out: bool = False

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])

    def delta(self, conv1d: bool = False) -> torch.Tensor:
        """The weight update in the weight's own layout, float32: (out, in) for a Linear, (in, out)
        for a Conv1D (``conv1d``: the module is one, whatever the adapter config says -- PEFT
        switches ``fan_in_fan_out`` on for such modules without saving it), (vocab, dim) for an
        embedding."""
        d = (self.b.float() @ self.a.float()) * self.scale
        return (d.T if (self.embedding or self.fan_in_fan_out or conv1d) else d).contiguous()


@dataclass
class LoraAdapter:
    """A whole adapter: its config, ``{module: LoraDelta}`` and ``base_copies``: ``{weight key:
    tensor}`` of full base weights that PEFT saves next to the factors of embedding-like targets
    (``save_embedding_layers``); a merge checks they equal the base model's."""

    config: dict[str, Any]
    deltas: dict[str, LoraDelta]
    base_copies: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return int(self.config["r"])

    @property
    def alpha(self) -> float:
        return float(self.config["lora_alpha"])


def _read_config(path: Path) -> dict[str, Any]:
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{path}: not a readable adapter config ({exc})") from exc
    if not isinstance(cfg, dict) or str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(
            f"{path}: peft_type must be 'LORA', got {cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r}"
        )
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or isinstance(cfg.get(key), bool) or cfg[key] <= 0:
            raise AdapterError(f"{path}: field {key!r} must be a positive number, got {cfg.get(key)!r}")
    refused = {
        "use_dora": "DoRA",
        "alpha_pattern": "per-module alphas",
        "lora_bias": "LoRA biases",
        "modules_to_save": "fully trained extra modules",
    }
    for key, what in refused.items():
        if cfg.get(key):
            raise AdapterError(f"{path}: {key}={cfg[key]!r} ({what}) is not supported by the exact merge")
    return cfg


def read_adapter(folder: str | Path) -> LoraAdapter:
    """Read ``folder/adapter_config.json`` and ``folder/adapter_model.safetensors``.

    Returns:
        The adapter with one :class:`LoraDelta` per target module (tensors float32).

    Raises:
        AdapterError: a missing file, an unsupported setting, an unknown key, an A without its B,
            tensors that are not 2-D (e.g. fused MoE experts) or whose ranks disagree.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    cfg = _read_config(folder / ADAPTER_CONFIG)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise AdapterError(f"{folder}: no {ADAPTER_WEIGHTS}")
    tensors = load_file(str(weights))
    parts: dict[str, dict[str, torch.Tensor]] = {}
    copies: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        c = _BASE_COPY.match(key)
        if c is not None:
            copies[f"{c['module']}.weight"] = t
            continue
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(
                f"{weights}: unexpected tensor {key!r} (expected base_model.model.<module>.lora_A.weight / "
                "lora_B.weight or lora_embedding_A / lora_embedding_B)"
            )
        if t.ndim != 2:
            raise AdapterError(
                f"{weights}: {key!r} has shape {tuple(t.shape)}; only 2-D LoRA factors can be merged "
                "(3-D expert tensors of MoE models are not supported)"
            )
        parts.setdefault(m["module"], {})[m["part"].split(".")[0].replace("embedding_", "")] = t.float()
    if not parts:
        raise AdapterError(f"{weights}: no LoRA tensors")
    alpha, rslora, fifo = float(cfg["lora_alpha"]), bool(cfg.get("use_rslora")), bool(cfg.get("fan_in_fan_out"))
    deltas = {}
    for module, ab in sorted(parts.items()):
        if set(ab) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{weights}: module {module!r} has {sorted(ab)} but needs both lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        r = a.shape[0]
        if b.shape[1] != r:
            raise AdapterError(
                f"{weights}: module {module!r}: lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}: "
                "their ranks differ"
            )
        embedding = any(k.startswith(f"base_model.model.{module}.lora_embedding_") for k in tensors)
        scale = alpha / math.sqrt(r) if rslora else alpha / r
        deltas[module] = LoraDelta(module, a, b, scale, embedding=embedding, fan_in_fan_out=fifo and not embedding)
    return LoraAdapter(cfg, deltas, copies)
