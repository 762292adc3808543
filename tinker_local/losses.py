"""Per-datum loss functions of the local engine (Tinker semantics: summed over tokens).

Every function takes ``lp``, the logprobs of the target tokens under the current model (a
float32 tensor of shape (N,), or (N, K) for soft targets, with grad), the datum's loss inputs as
float32/int64 tensors on the same device, and the request's ``loss_fn_config`` dict, and returns
the scalar loss of that datum.  The engine sums them over datums into ``loss:sum``.

| name | inputs | loss |
|---|---|---|
| cross_entropy | target_tokens, weights (default 1) | -(lp * w).sum() |
| importance_sampling | target_tokens, logprobs q, advantages A | -(exp(lp - q) * A).sum() |
| ppo | + clip_low_threshold, clip_high_threshold (config or inputs; 0.8, 1.2) | -min(r A, clip(r) A).sum() |
| cispo | same as ppo | -(stopgrad(clip(r)) * lp * A).sum() |
| dro | + beta (config, default 0.05) | -(lp A - 0.5 beta (lp - q)^2).sum() |
| gspo | + sequence_ratio_mask (optional), clip thresholds as ppo | -min(s_t A, clip(s_t) A).sum() |

GSPO-token: the sequence log-ratio is the mean of ``lp - q`` over the tokens marked by
``sequence_ratio_mask`` (default: the tokens with a non-zero advantage; none marked -> ratio 1);
every token's ratio ``s_t = exp(sg[seq log-ratio] + lp_t - sg[lp_t])`` carries the sequence
ratio's value and its own token's gradient.

Sources: Tinker docs "Loss functions" (tinker-docs.thinkingmachines.ai/tinker/losses/); PPO
(Schulman et al. 2017, arXiv:1707.06347); CISPO (MiniMax-M1, arXiv:2506.13585); GSPO (Zheng et al.
2025, arXiv:2507.18071).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import EngineUserError

Tensor = torch.Tensor


def cross_entropy(lp: Tensor, inp: dict[str, Tensor], cfg: dict) -> Tensor:
    """``-(lp * weights).sum()``; weights shaped like target_tokens, (N,) or (N, K)."""
    w = inp.get("weights")
    if w is None:
        return -lp.sum()
    return -(lp * w).sum()


def _ratio_inputs(lp: Tensor, inp: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    return inp["logprobs"], inp["advantages"]


def importance_sampling(lp: Tensor, inp: dict[str, Tensor], cfg: dict) -> Tensor:
    """REINFORCE with importance weights: ``-(exp(lp - q) * A).sum()``."""
    q, adv = _ratio_inputs(lp, inp)
    return -(torch.exp(lp - q) * adv).sum()


def _clip_bounds(inp: dict[str, Tensor], cfg: dict) -> tuple[Tensor | float, Tensor | float]:
    low = inp.get("clip_low_threshold", cfg.get("clip_low_threshold", 0.8))
    high = inp.get("clip_high_threshold", cfg.get("clip_high_threshold", 1.2))
    return low, high


def _clip(r: Tensor, low, high) -> Tensor:
    low = torch.as_tensor(low, dtype=r.dtype, device=r.device)
    high = torch.as_tensor(high, dtype=r.dtype, device=r.device)
    return torch.minimum(torch.maximum(r, low), high)


def ppo(lp: Tensor, inp: dict[str, Tensor], cfg: dict) -> Tensor:
    """Clipped-ratio objective: ``-min(r*A, clip(r, low, high)*A).sum()``, r = exp(lp - q)."""
    q, adv = _ratio_inputs(lp, inp)
    low, high = _clip_bounds(inp, cfg)
    r = torch.exp(lp - q)
    clipped = _clip(r, low, high)
    return -torch.minimum(r * adv, clipped * adv).sum()


def cispo(lp: Tensor, inp: dict[str, Tensor], cfg: dict) -> Tensor:
    """Clipped IS-weight policy optimisation: ``-(stopgrad(clip(r)) * lp * A).sum()``."""
    q, adv = _ratio_inputs(lp, inp)
    low, high = _clip_bounds(inp, cfg)
    r = torch.exp(lp - q).detach()
    clipped = _clip(r, low, high)
    return -(clipped * lp * adv).sum()


def dro(lp: Tensor, inp: dict[str, Tensor], cfg: dict) -> Tensor:
    """Direct reward optimisation: ``-(lp*A - 0.5*beta*(lp - q)**2).sum()``; beta from config."""
    q, adv = _ratio_inputs(lp, inp)
    beta = float(cfg.get("beta", 0.05))
    return -(lp * adv - 0.5 * beta * (lp - q) ** 2).sum()


def gspo(lp: Tensor, inp: dict[str, Tensor], cfg: dict) -> Tensor:
    """GSPO-token: PPO's clipped objective with every token's ratio set to the sequence ratio
    ``exp(mean over the masked tokens of (lp - q))`` (value) and its own ``lp`` (gradient)."""
    q, adv = _ratio_inputs(lp, inp)
    low, high = _clip_bounds(inp, cfg)
    mask = inp.get("sequence_ratio_mask")
    marked = (mask != 0) if mask is not None else (adv != 0)
    n = marked.sum()
    lp_sg = lp.detach()
    seq_log_ratio = torch.where(marked, lp_sg - q, torch.zeros_like(lp_sg)).sum() / n.clamp(min=1)
    ratio = torch.exp(seq_log_ratio + lp - lp_sg)
    clipped = _clip(ratio, low, high)
    return -torch.minimum(ratio * adv, clipped * adv).sum()


LOSS_FNS: dict[str, Callable[[Tensor, dict[str, Tensor], dict], Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
}

# loss inputs each function needs besides target_tokens (all shaped like target_tokens)
REQUIRED_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages"),
}
# inputs that may be scalars (broadcast) instead of per-token arrays
SCALAR_OK = {"clip_low_threshold", "clip_high_threshold"}


# Loss types SDK 0.38 declares that this engine refuses by name, with the reason.  ``custom``
# runs through tinker_local.custom_loss (ServiceClient.create_custom_loss), not through this table.
REFUSED: dict[str, str] = {
    "stable_reinforce": (
        "loss_fn 'stable_reinforce' is not implemented by tinker_local: the Tinker documentation "
        "(tinker-docs.thinkingmachines.ai/tinker/losses/stable-reinforce/) describes its inputs (provenance "
        "spans, record_stability_info sampling, loss_fn_config kl_coeff) but not its objective in a form that "
        "can be reproduced; the provenance of this request was checked and is valid. Use 'importance_sampling', "
        "'ppo', 'cispo', 'dro' or 'gspo' with the sampled logprobs instead"
    ),
}


def get_loss_fn(name: str):
    """Return the loss function called ``name``; ``EngineUserError`` naming it if unsupported
    (with the reason for the names in ``REFUSED``)."""
    if name in REFUSED:
        raise EngineUserError(REFUSED[name])
    fn = LOSS_FNS.get(name)
    if fn is None:
        raise EngineUserError(f"unsupported loss_fn {name!r}; supported: {sorted(LOSS_FNS)}")
    return fn
