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

A loss the server has no built-in for defines its objective instead of ``loss_fn``: :meth:`RLLoss.objective`
returns a per-datum torch function ``f(logprobs, *inputs) -> (loss, {"custom/<name>:sum|mean": tensor})``
whose parameters after ``logprobs`` (the trainer's logprobs of the datum's target tokens, float32 (T,))
name inputs of :data:`OBJECTIVE_INPUTS` (each float32 (T,)). The RL loop runs it with the SDK's
``create_custom_loss``: uploaded and computed on the server where it accepts custom losses (one
``forward_backward`` request), otherwise on the client (``forward_backward_custom``: a forward for the
logprobs, the loss and its gradient in torch here, a backward with that gradient); see
:func:`prefect_tinker.tasks.custom_losses.custom_loss`. The function is traced with ``torch.fx``: torch
and math operations only, no branching on tensor values; options enter as Python numbers::

    @register_loss
    class ClippedIS(RLLoss):
        name = "clipped_is"
        class Options(BaseModel):
            epsilon: float = 0.2
        def objective(self):
            lo, hi = 1 - self.options.epsilon, 1 + self.options.epsilon
            def clipped_is(logprobs, advantages, sampling_logprobs, mask):
                ratio = torch.exp(logprobs - sampling_logprobs)
                loss = -(torch.clamp(ratio, lo, hi).detach() * logprobs * advantages * mask).sum()
                return loss, {"custom/ratio:mean": (ratio * mask).sum() / mask.sum().clamp(min=1.0)}
            return clipped_is
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from prefect_tinker.recipes.registry import Registry

__all__ = [
    "LOSSES",
    "ClipThresholds",
    "CispoLoss",
    "DROLoss",
    "GSPOLoss",
    "ImportanceSamplingLoss",
    "NoLossOptions",
    "OBJECTIVE_INPUTS",
    "Objective",
    "PPOLoss",
    "RLLoss",
    "StableReinforceLoss",
    "register_loss",
]


#: The per-datum inputs an objective may read (parameter name: meaning), each float32 (T,) over the
#: datum's T target tokens: the per-token advantage (0 off the actions), the sampler's logprob of
#: each target (0 off the actions) and 1.0 where the target is an action token.
OBJECTIVE_INPUTS: Mapping[str, str] = {
    "advantages": "per-token advantage (0 off the action tokens)",
    "sampling_logprobs": "the sampler's logprob of each target token (0 off the action tokens)",
    "mask": "1.0 where the target token is an action token, else 0.0",
}

#: A per-datum objective: ``f(logprobs, *inputs) -> (scalar loss, {"custom/<name>:sum|mean": scalar})``
#: (the shape ``ServiceClient.create_custom_loss`` takes); per-datum losses are summed.
Objective = Callable[..., tuple[Any, Mapping[str, Any]]]


class NoLossOptions(BaseModel):
    """``loss_options`` of a loss that takes none (any key is an error)."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class ClipThresholds:
    """The run's bounds of the importance ratio (``clip_low_threshold`` < 1 < ``clip_high_threshold``);
    None: not sent, the server's default."""

    low: float | None
    high: float | None


class RLLoss:
    """One registered RL loss (see the module docstring).

    Subclasses set ``name`` (the config's ``loss_fn``), ``description`` and either ``loss_fn`` (the
    server's loss function; override :meth:`loss_fn_config` when it takes a config) or
    :meth:`objective` (the loss as a torch function), optionally ``Options`` (a pydantic model of
    ``loss_options``).

    Args:
        options: the validated ``loss_options`` (default: ``Options()``).
    """

    name: ClassVar[str] = ""
    loss_fn: ClassVar[str] = ""
    description: ClassVar[str] = ""
    Options: ClassVar[type[BaseModel]] = NoLossOptions
    #: True when rollouts must record stability information and datums carry provenance spans.
    provenance: ClassVar[bool] = False

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

    def objective(self) -> Objective | None:
        """The loss as a per-datum torch function (module docstring), or None (the default): the
        server's built-in ``loss_fn``. Built from this loss's options, once per run."""
        return None

    def objective_inputs(self) -> tuple[str, ...]:
        """The :data:`OBJECTIVE_INPUTS` the objective reads, in its parameter order (() without one).

        Raises:
            ValueError: the objective's first parameter is not ``logprobs``, or it reads an input
                that is not in :data:`OBJECTIVE_INPUTS`.
        """
        fn = self.objective()
        if fn is None:
            return ()
        names = list(inspect.signature(fn).parameters)
        if not names or names[0] != "logprobs":
            raise ValueError(f"loss {self.name!r}: the objective's first parameter must be logprobs, got {names}")
        unknown = [n for n in names[1:] if n not in OBJECTIVE_INPUTS]
        if unknown:
            raise ValueError(
                f"loss {self.name!r}: the objective reads {unknown}; RL datums offer {sorted(OBJECTIVE_INPUTS)}"
            )
        return tuple(names[1:])


#: RL losses by name; plugins add theirs through the ``prefect_tinker.losses`` entry-point group.
LOSSES: Registry[type[RLLoss]] = Registry("RL loss", "prefect_tinker.losses")


def register_loss(cls: type[RLLoss]) -> type[RLLoss]:
    """Class decorator: register ``cls`` under ``cls.name`` in :data:`LOSSES` (replacing an earlier one).

    Raises:
        ValueError: empty ``name``, or not exactly one of ``loss_fn`` and ``objective``.
    """
    has_objective = cls.objective is not RLLoss.objective
    if bool(cls.loss_fn) == has_objective:
        raise ValueError(
            f"{cls.__name__}: an RL loss names the server loss function `loss_fn` or defines `objective`, "
            "exactly one of them"
        )
    return LOSSES.register(cls.name, cls)


@register_loss
class ImportanceSamplingLoss(RLLoss):
    """``importance_sampling``: ``-sum_t (p_theta / q) A_t`` over action tokens."""

    name = "importance_sampling"
    loss_fn = "importance_sampling"
    description = "policy gradient with the trainer/sampler importance ratio (no clipping)"


class _ClippedLoss(RLLoss):
    def loss_fn_config(self, clip: ClipThresholds) -> dict[str, float] | None:
        given = {"clip_low_threshold": clip.low, "clip_high_threshold": clip.high}
        return {k: float(v) for k, v in given.items() if v is not None} or None


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


@register_loss
class GSPOLoss(_ClippedLoss):
    """``gspo``: PPO-style clipping of the sequence-level (length-normalised) importance ratio
    (Zheng et al. 2025, "Group Sequence Policy Optimization")."""

    name = "gspo"
    loss_fn = "gspo"
    description = "GSPO sequence-level clipped ratio (clip_low_threshold, clip_high_threshold)"


class DROOptions(BaseModel):
    """``loss_options`` of ``dro``."""

    model_config = ConfigDict(extra="forbid")
    beta: float = Field(default=0.05, ge=0, description="Weight beta of the quadratic penalty 0.5 beta (logp - q)^2.")


@register_loss
class DROLoss(RLLoss):
    """``dro``: direct reward optimisation, a policy-gradient term plus a quadratic penalty on the
    trainer/sampler log-ratio weighted by ``beta`` (Tinker docs, "Loss functions: DRO")."""

    name = "dro"
    loss_fn = "dro"
    description = "DRO with quadratic log-ratio penalty (loss_options.beta, default 0.05)"
    Options = DROOptions
    options: DROOptions

    def loss_fn_config(self, clip: ClipThresholds) -> dict[str, float] | None:
        return {"beta": float(self.options.beta)}


class StableReinforceOptions(BaseModel):
    """``loss_options`` of ``stable_reinforce``."""

    model_config = ConfigDict(extra="forbid")
    kl_coeff: float | None = Field(default=None, ge=0, description="loss_fn_config kl_coeff (None: the server's).")


@register_loss
class StableReinforceLoss(RLLoss):
    """``stable_reinforce``: the Tinker service's off-policy-robust REINFORCE
    (https://tinker-docs.thinkingmachines.ai/tinker/losses/stable-reinforce/). Rollouts sample with
    ``record_stability_info=True`` and each datum carries provenance spans naming the sampled
    ``sequence_id``s."""

    name = "stable_reinforce"
    loss_fn = "stable_reinforce"
    description = "StableReinforce (needs provenance; loss_options.kl_coeff)"
    Options = StableReinforceOptions
    options: StableReinforceOptions
    provenance = True

    def loss_fn_config(self, clip: ClipThresholds) -> dict[str, float] | None:
        kl = self.options.kl_coeff
        return None if kl is None else {"kl_coeff": float(kl)}
