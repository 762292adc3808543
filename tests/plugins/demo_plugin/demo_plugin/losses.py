"""A new RL loss and a new advantage estimator: each one class and one registration."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from prefect_tinker.plugin import AdvantageEstimator, RLLoss, register_advantage_estimator, register_loss


@register_loss
class SymmetricPPO(RLLoss):
    """PPO whose ratio bounds are ``1 -+ epsilon`` (one option instead of two thresholds)."""

    name = "symmetric_ppo"
    loss_fn = "ppo"
    description = "PPO clipped to [1 - epsilon, 1 + epsilon]"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")
        epsilon: float = Field(default=0.2, gt=0, lt=1, description="Half-width of the ratio's clip range.")

    def loss_fn_config(self, clip):
        return {"clip_low_threshold": 1 - self.options.epsilon, "clip_high_threshold": 1 + self.options.epsilon}


@register_advantage_estimator
class MeanOnly(AdvantageEstimator):
    """``R_i - mean(R)`` written out again (the built-in ``group_mean``, as a plugin would)."""

    name = "mean_only"
    description = "reward minus the group mean"

    def __call__(self, rewards_G):
        r = np.asarray(rewards_G, dtype=np.float64)
        return r - r.mean() if r.size else r
