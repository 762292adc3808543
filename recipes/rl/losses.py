"""RL policy-gradient losses: one registered class each, selected by the RL config's ``loss_fn``.

A loss names the Tinker loss function the server computes on the datums (``loss_fn``: one of
the SDK's ``LossFnType``) and builds its ``loss_fn_config`` from the run's clip thresholds and
its own typed options (``loss_options``, validated by the class's ``Options`` model). The datums
are the same for every loss (:meth:`~prefect_tinker.recipes.rl.advantages.RLDatum.to_datum`:
``target_tokens``, sampler ``logprobs``, ``advantages``).

Built in (Tinker docs, "Loss functions"): ``importance_sampling`` (the REINFORCE estimator
corrected by the ratio of trainer to sampler probabilities), ``ppo`` (clipped surrogate,
Schulman et al. 2017 "Proximal Policy Optimization Algorithms") and ``cispo`` (clipped
importance-sampling weights, MiniMax 2025 "MiniMax-M1", sec. 3.1). A plugin adds one with
:func:`register_loss` or an entry point of group ``prefect_tinker.losses``::

    @register_loss
    class TightPPO(RLLoss):
        name = "tight_ppo"
        loss_fn = "ppo"
        class Options(BaseModel):
            epsilon: float = 0.1
        def loss_fn_config(self, clip):
            return {"clip_low_threshold": 1 - self.options.epsilon, "clip_high_threshold": 1 + self.options.epsilon}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from prefect_tinker.recipes.registry import Registry

__all__ = ["LOSSES", "ClipThresholds", "CispoLoss", "ImportanceSamplingLoss", "NoLossOptions", "PPOLoss", "RLLoss",
           "register_loss"]


class NoLossOptions(BaseModel):
    """``loss_options`` of a loss that takes none (any key is an error)."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class ClipThresholds:
    """The run's bounds of the importance ratio (``clip_low_threshold`` < 1 < ``clip_high_threshold``)."""

    low: float
    high: float


class RLLoss:
    """One registered RL loss (see the module docstring).

    Subclasses set ``name`` (the config's ``loss_fn``), ``loss_fn`` (the server's loss function)
    and ``description``, optionally ``Options`` (a pydantic model of ``loss_options``), and
    override :meth:`loss_fn_config` when the server loss takes a config.

    Args:
        options: the validated ``loss_options`` (default: ``Options()``).
    """

    name: ClassVar[str] = ""
    loss_fn: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel]] = NoLossOptions

    def __init__(self, options: BaseModel | None = None):
        self.options = options if options is not None else self.Options()

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> RLLoss:
        """The loss with ``options`` validated by :attr:`Options`.

        Raises:
            ValueError: a bad option, as ``loss_options.<field>: <problem>``.
        """
        try:
            return cls(cls.Options.model_validate(options))
        except ValidationError as exc:
            problems = "; ".join(f"loss_options.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"loss {cls.name!r}: {problems}") from None

    def loss_fn_config(self, clip: ClipThresholds) -> dict[str, float] | None:
        """``loss_fn_config`` sent with every ``forward_backward`` (default None: the server's defaults)."""
        return None


#: RL losses by name; plugins add theirs through the ``prefect_tinker.losses`` entry-point group.
LOSSES: Registry[type[RLLoss]] = Registry("RL loss", "prefect_tinker.losses")


def register_loss(cls: type[RLLoss]) -> type[RLLoss]:
    """Class decorator: register ``cls`` under ``cls.name`` in :data:`LOSSES` (replacing an earlier one).

    Raises:
        ValueError: empty ``name`` or ``loss_fn``.
    """
    if not cls.loss_fn:
        raise ValueError(f"{cls.__name__}: an RL loss needs the server loss function `loss_fn`")
    return LOSSES.register(cls.name, cls)


@register_loss
class ImportanceSamplingLoss(RLLoss):
    """``importance_sampling``: ``-sum_t (p_theta / q) A_t`` over action tokens."""

    name = "importance_sampling"
    loss_fn = "importance_sampling"
    description = "policy gradient with the trainer/sampler importance ratio (no clipping)"


class _ClippedLoss(RLLoss):
    def loss_fn_config(self, clip: ClipThresholds) -> dict[str, float] | None:
        return {"clip_low_threshold": clip.low, "clip_high_threshold": clip.high}


@register_loss
class PPOLoss(_ClippedLoss):
    """``ppo``: the clipped surrogate objective, ratio bounds from the run's clip thresholds."""

    name = "ppo"
    loss_fn = "ppo"
    description = "PPO clipped surrogate (clip_low_threshold, clip_high_threshold)"


@register_loss
class CispoLoss(_ClippedLoss):
    """``cispo``: REINFORCE with clipped, gradient-stopped importance weights."""

    name = "cispo"
    loss_fn = "cispo"
    description = "CISPO clipped importance weights (clip_low_threshold, clip_high_threshold)"
