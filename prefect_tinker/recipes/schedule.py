"""The one learning-rate schedule of every recipe: linear warmup, then constant, linear or cosine
decay towards a floor.

With peak rate ``lr``, ``W`` warmup steps, ``T`` total steps and floor ``lr_min``:

- warmup (``step < W``): ``lr * (step + 1) / W``;
- then ``f = (step - W) / max(T - W, 1)`` (clipped to [0, 1]) and
  ``lr_min + (lr - lr_min) * d(f)`` with ``d = 1`` (constant), ``1 - f`` (linear) or
  ``(1 + cos(pi f)) / 2`` (cosine; Loshchilov & Hutter 2017, "SGDR", without restarts).

``step`` counts optimizer steps already taken (0-based: the rate of the update that makes step
``step + 1``), so a resumed run gets the same rates.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, Field

__all__ = ["LRScheduleName", "LRScheduleFields", "lr_at"]

LRScheduleName = Literal["constant", "linear", "cosine"]


def lr_at(
    learning_rate: float,
    step: int,
    total: int,
    *,
    schedule: LRScheduleName = "constant",
    warmup_steps: int = 0,
    min_lr: float = 0.0,
) -> float:
    """Learning rate of optimizer step ``step`` (0-based) of ``total`` (see the module docstring).

    Raises:
        ValueError: unknown ``schedule``, negative ``warmup_steps``, or ``min_lr`` above the peak.
    """
    if schedule not in ("constant", "linear", "cosine"):
        raise ValueError(f"lr_schedule must be 'constant', 'linear' or 'cosine', got {schedule!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if min_lr > learning_rate:
        raise ValueError(f"min_lr ({min_lr}) is above learning_rate ({learning_rate})")
    if warmup_steps and step < warmup_steps:
        return learning_rate * (step + 1) / warmup_steps
    if schedule == "constant":
        return learning_rate
    frac = min(max((step - warmup_steps) / max(total - warmup_steps, 1), 0.0), 1.0)
    decay = 1.0 - frac if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
    return min_lr + (learning_rate - min_lr) * decay


class LRScheduleFields(BaseModel):
    """Config fields of the schedule (mixed into every recipe's config)."""

    learning_rate: float = Field(
        default=1e-4, gt=0, description="Peak learning rate (LoRA wants ~10x the full fine-tuning rate)."
    )
    lr_schedule: LRScheduleName = Field(
        default="constant", description="Decay after warmup: constant, linear or cosine."
    )
    warmup_steps: int = Field(default=0, ge=0, description="Optimizer steps of linear warmup from 0 to learning_rate.")
    min_lr: float = Field(default=0.0, ge=0, description="Floor the linear / cosine decay ends at.")

    def lr_at(self, step: int, total: int) -> float:
        """This config's learning rate at optimizer step ``step`` of ``total`` (see :func:`lr_at`)."""
        return lr_at(
            self.learning_rate,
            step,
            total,
            schedule=self.lr_schedule,
            warmup_steps=self.warmup_steps,
            min_lr=self.min_lr,
        )
