"""From trajectory groups to training datums: advantages, datums, KL penalty, rollout statistics.

- advantage estimators (:class:`AdvantageEstimator`, registered in :data:`ADVANTAGE_ESTIMATORS`,
  selected by the RL config's ``advantage_estimator``; plugins add theirs with
  :func:`register_advantage_estimator` or the entry-point group ``prefect_tinker.advantages``):
  ``group_mean`` (the default, :func:`compute_advantages`) and ``leave_one_out`` (RLOO: the baseline
  of each member is the mean reward of the others, Ahmadian et al. 2024 "Back to Basics", sec. 3.2).
- :func:`compute_advantages`: group-centred advantages ``A_i = R_i - mean_G(R)`` (GRPO, Shao et
  al. 2024 "DeepSeekMath", sec. 4.1.2; without the division by the group's standard deviation by
  default, as in the Tinker cookbook and Dr. GRPO, Liu et al. 2025; ``normalize_std=True``
  restores it).
- :func:`remove_constant_reward_groups`: groups whose members all got the same reward have zero
  advantages and teach nothing; drop them.
- :func:`trajectory_to_datums`: one ``tinker.Datum`` per run of transitions whose observations
  extend the previous ones (a single-turn episode -> one datum): model input ``tokens[:-1]``,
  ``target_tokens = tokens[1:]``, ``logprobs`` = the sampler's logprobs on action tokens (0
  elsewhere), ``advantages`` = ``A`` on action tokens (0 elsewhere), plus the action mask (not
  sent). With every action's ``sequence_id`` known, the datum also carries its provenance
  (:meth:`RLDatum.to_datum` with ``provenance=True``: ``Datum.with_provenance`` spans naming the
  sampled sequences, as the ``stable_reinforce`` loss needs; Tinker docs, "StableReinforce",
  https://tinker-docs.thinkingmachines.ai/tinker/losses/stable-reinforce/). Losses sum over
  tokens (Tinker docs, "Loss functions"), so observation tokens with zero advantage contribute
  nothing.
- :func:`apply_kl_penalty`: per-token penalty against a reference model, folded into the
  advantages as in the Tinker cookbook: ``A_t += coef * (mean_kl - (q_t - ref_t))`` on action
  tokens, where ``q_t - ref_t`` is the sampled-token log-ratio (a k1 estimate of KL(sampler||ref)).
- :func:`rollout_metrics` and :func:`sample_train_kl`: step statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import tinker

from prefect_tinker.recipes.media import model_input_from_tokens
from prefect_tinker.recipes.registry import Registry
from prefect_tinker.recipes.rl.types import Trajectory, TrajectoryGroup

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "GroupMeanBaseline",
    "LeaveOneOutBaseline",
    "RLDatum",
    "register_advantage_estimator",
    "compute_advantages",
    "remove_constant_reward_groups",
    "trajectory_to_datums",
    "groups_to_datums",
    "apply_kl_penalty",
    "rollout_metrics",
    "sample_train_kl",
]


@dataclass
class RLDatum:
    """A training datum and its bookkeeping.

    Attributes:
        tokens: the full sequence (L,) the datum was cut from (observation + action tokens).
        mask: float32 (L-1,), 1.0 where ``target_tokens`` is an action token.
        sampler_logprobs: float32 (L-1,), the sampler's logprob of each target (0 off the mask).
        advantages: float32 (L-1,), the per-token advantage (0 off the mask).
        group_index, member: where the trajectory sits (for logging).
        spans: where each run of ``tokens`` came from, tiling all L of them: ``("prompt" |
            "sampled", sequence_id, offset, length)`` (a run of the prompt, or of the sampled
            tokens, of the sampled sequence ``sequence_id``); None when an action's sequence id
            is unknown.
    """

    tokens: list[int]
    mask: np.ndarray
    sampler_logprobs: np.ndarray
    advantages: np.ndarray
    group_index: int = 0
    member: int = 0
    spans: list[tuple[str, str, int, int]] | None = None

    def to_datum(self, provenance: bool = False, objective_inputs: Sequence[str] = ()) -> tinker.Datum:
        """The ``tinker.Datum`` (inputs ``target_tokens`` int64, ``logprobs`` and ``advantages``
        float32, all of shape (L-1,)) for the policy-gradient losses; with ``provenance``, its
        ``Datum.with_provenance`` spans (the model input's tile ``tokens[:-1]``, the loss inputs'
        tile ``target_tokens = tokens[1:]``). With ``objective_inputs`` (names of
        :data:`~prefect_tinker.recipes.rl.losses.OBJECTIVE_INPUTS`), the inputs of a custom
        objective instead: ``target_tokens`` and each named one, float32 (L-1,).

        Raises:
            ValueError: ``provenance`` asked for, but the datum's actions have no sequence ids
                (sampled without them, or by an environment that samples on its own); an unknown
                objective input.
        """
        if objective_inputs:
            arrays = {"advantages": self.advantages, "sampling_logprobs": self.sampler_logprobs, "mask": self.mask}
            unknown = [n for n in objective_inputs if n not in arrays]
            if unknown:
                raise ValueError(f"RL datums have no objective inputs {unknown}; they offer {sorted(arrays)}")
            inputs = {
                n: tinker.TensorData.from_numpy(np.ascontiguousarray(arrays[n], dtype=np.float32))
                for n in objective_inputs
            }
            return tinker.Datum(
                model_input=model_input_from_tokens(self.tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": tinker.TensorData.from_numpy(np.asarray(self.tokens[1:], dtype=np.int64)),
                    **inputs,
                },
            )
        datum = tinker.Datum(
            model_input=model_input_from_tokens(self.tokens[:-1]),  # media observations: their chunks
            loss_fn_inputs={
                "target_tokens": tinker.TensorData.from_numpy(np.asarray(self.tokens[1:], dtype=np.int64)),
                "logprobs": tinker.TensorData.from_numpy(np.ascontiguousarray(self.sampler_logprobs, dtype=np.float32)),
                "advantages": tinker.TensorData.from_numpy(np.ascontiguousarray(self.advantages, dtype=np.float32)),
            },
        )
        if not provenance:
            return datum
        if self.spans is None:
            raise ValueError(
                f"group {self.group_index} member {self.member}: provenance needs the sequence_id "
                "of every sampled action, and this trajectory has actions without one (an environment "
                "that samples on its own, or a server that returns no sequence ids)"
            )
        n = len(self.tokens)
        return datum.with_provenance(
            model_input=_provenance(self.spans, 0, n - 1), loss_fn_inputs=_provenance(self.spans, 1, n)
        )


def _provenance(spans: Sequence[tuple[str, str, int, int]], start: int, stop: int) -> list:
    """The SDK spans of positions ``[start, stop)`` of a sequence tiled by ``spans``."""
    out, pos = [], 0
    for kind, sequence_id, offset, length in spans:
        lo, hi = max(pos, start), min(pos + length, stop)
        if hi > lo:
            make = tinker.PromptProvenanceSpan if kind == "prompt" else tinker.SampledProvenanceSpan
            out.append(make(sequence_id=sequence_id, offset=offset + lo - pos, length=hi - lo))
        pos += length
    return out


def compute_advantages(rewards_G: Sequence[float], normalize_std: bool = False, eps: float = 1e-6) -> np.ndarray:
    """Group-centred advantages (G,) float64: ``R - mean(R)``, computed in float32 with torch as
    tinker-cookbook 0.6.1 does (``rl/data_processing.py: compute_advantages``; so that the same
    rewards give the same bits), then divided by ``std(R) + eps`` when ``normalize_std``
    (population std, float64). An empty group gives an empty array."""
    r = np.asarray(rewards_G, dtype=np.float64)
    if r.size == 0:
        return r
    import torch  # here, not at the top: reading RL data needs no torch

    r32 = torch.tensor(r.tolist(), dtype=torch.float32)
    adv = (r32 - r32.mean()).double().numpy()
    if normalize_std:
        adv = adv / (r.std() + eps)
    return adv


class AdvantageEstimator:
    """Per-trajectory advantages of one group from its total rewards.

    Subclasses set ``name`` and ``description`` and implement :meth:`__call__`.

    Args:
        normalize_std: divide the advantages by the group's reward std (+1e-6), as in the
            original GRPO (the config's ``normalize_advantages_std``).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def __init__(self, normalize_std: bool = False):
        self.normalize_std = normalize_std

    def __call__(self, rewards_G: Sequence[float]) -> np.ndarray:
        """Advantages (G,) float64 of a group's total rewards (G,)."""
        raise NotImplementedError


#: Advantage estimators by name; plugins add theirs through the ``prefect_tinker.advantages`` group.
ADVANTAGE_ESTIMATORS: Registry[type[AdvantageEstimator]] = Registry("advantage estimator", "prefect_tinker.advantages")


def register_advantage_estimator(cls: type[AdvantageEstimator]) -> type[AdvantageEstimator]:
    """Class decorator: register ``cls`` under ``cls.name`` in :data:`ADVANTAGE_ESTIMATORS`."""
    return ADVANTAGE_ESTIMATORS.register(cls.name, cls)


@register_advantage_estimator
class GroupMeanBaseline(AdvantageEstimator):
    """``group_mean``: ``R_i - mean_G(R)`` (:func:`compute_advantages`)."""

    name = "group_mean"
    description = "reward minus the group's mean reward (GRPO / Dr. GRPO)"

    def __call__(self, rewards_G: Sequence[float]) -> np.ndarray:
        return compute_advantages(rewards_G, self.normalize_std)


@register_advantage_estimator
class LeaveOneOutBaseline(AdvantageEstimator):
    """``leave_one_out``: ``R_i - mean_{j != i} R_j = G/(G-1) (R_i - mean_G(R))`` (RLOO); a group
    of one gets advantage 0."""

    name = "leave_one_out"
    description = "reward minus the mean reward of the other group members (RLOO)"

    def __call__(self, rewards_G: Sequence[float]) -> np.ndarray:
        r = np.asarray(rewards_G, dtype=np.float64)
        if r.size <= 1:
            return np.zeros_like(r)
        adv = (r - r.mean()) * (r.size / (r.size - 1))
        return adv / (r.std() + 1e-6) if self.normalize_std else adv


def remove_constant_reward_groups(
    groups: Sequence[TrajectoryGroup], atol: float = 1e-9
) -> tuple[list[TrajectoryGroup], int]:
    """Groups whose total rewards are not all equal, and how many were removed.

    When every group is constant, returns all of them (training on zero advantages is a no-op
    but keeps the step's bookkeeping uniform) and the count removed as 0.
    """
    kept = [g for g in groups if np.ptp(np.asarray(g.total_rewards() or [0.0])) > atol]
    if not kept:
        return list(groups), 0
    return kept, len(groups) - len(kept)


def trajectory_to_datums(traj: Trajectory, advantage: float, group_index: int = 0, member: int = 0) -> list[RLDatum]:
    """Datums of one trajectory with a scalar ``advantage`` on its action tokens.

    Transitions are merged into one sequence while each observation extends the sequence so far
    (observation + actions of the previous transitions); otherwise a new datum starts.

    Raises:
        ValueError: a transition whose logprobs and tokens differ in length.
    """
    out: list[RLDatum] = []
    tokens: list[int] = []
    lps: list[float] = []
    mask: list[float] = []
    spans: list[tuple[str, str, int, int]] = []
    traced = all(t.sequence_id for t in traj.transitions)  # provenance only when every action is named

    def flush() -> None:
        if len(tokens) >= 2 and any(mask[1:]):
            m = np.asarray(mask[1:], dtype=np.float32)
            out.append(
                RLDatum(
                    list(tokens),
                    m,
                    np.asarray(lps[1:], dtype=np.float32) * m,
                    (m * advantage).astype(np.float32),
                    group_index,
                    member,
                    list(spans) if traced else None,
                )
            )

    for t in traj.transitions:
        if len(t.action_logprobs) != len(t.action_tokens):
            raise ValueError(
                f"transition has {len(t.action_tokens)} action tokens but {len(t.action_logprobs)} logprobs"
            )
        ob = list(t.observation)
        if tokens and ob[: len(tokens)] == tokens:
            new_ob = ob[len(tokens) :]
        else:
            flush()
            tokens, lps, mask, spans = [], [], [], []
            new_ob = ob
        if new_ob:  # the new observation tokens are the end of this action's prompt
            spans.append(("prompt", t.sequence_id, len(ob) - len(new_ob), len(new_ob)))
        if t.action_tokens:
            spans.append(("sampled", t.sequence_id, 0, len(t.action_tokens)))
        tokens += new_ob + list(t.action_tokens)
        lps += [0.0] * len(new_ob) + [float(x) for x in t.action_logprobs]
        mask += [0.0] * len(new_ob) + [1.0] * len(t.action_tokens)
    flush()
    return out


def groups_to_datums(
    groups: Sequence[TrajectoryGroup], normalize_std: bool = False, estimator: AdvantageEstimator | None = None
) -> tuple[list[RLDatum], list[np.ndarray]]:
    """Datums of every trajectory of ``groups`` and the advantages of each group (G,) float64,
    from ``estimator`` (default :class:`GroupMeanBaseline` with ``normalize_std``)."""
    estimator = estimator or GroupMeanBaseline(normalize_std)
    datums: list[RLDatum] = []
    advs: list[np.ndarray] = []
    for g in groups:
        adv_G = estimator(g.total_rewards())
        advs.append(adv_G)
        for i, (traj, a) in enumerate(zip(g.trajectories_G, adv_G, strict=True)):
            datums.extend(trajectory_to_datums(traj, float(a), g.group_index, i))
    return datums, advs


def apply_kl_penalty(datums: Sequence[RLDatum], ref_logprobs_D: Sequence[np.ndarray], coef: float) -> dict[str, float]:
    """Fold a KL penalty against a reference model into the datums' advantages (in place).

    Args:
        datums: D datums.
        ref_logprobs_D: per datum, the reference model's logprobs of ``target_tokens`` (L-1,).
        coef: penalty coefficient (0 -> only the metric is computed).

    Returns:
        ``{"kl_policy_ref": mean over action tokens of (q - ref)}`` (nats per token).

    The arithmetic is float32 torch in tinker-cookbook 0.6.1's order (``rl/metrics.py:
    incorporate_kl_penalty``: per-datum sums added one after the other, ``coef * mask`` times
    ``mean - diff``), so the same logprobs give the same advantages to the bit.

    Raises:
        ValueError: a reference array of the wrong length.
    """
    import torch  # here, not at the top: reading RL data needs no torch

    masks, diffs = [], []
    for d, ref in zip(datums, ref_logprobs_D, strict=True):
        ref_t = torch.tensor(np.asarray(ref, dtype=np.float64).tolist(), dtype=torch.float32)
        if tuple(ref_t.shape) != d.mask.shape:
            raise ValueError(f"reference logprobs have shape {tuple(ref_t.shape)}, expected {d.mask.shape}")
        mask = torch.from_numpy(np.ascontiguousarray(d.mask, dtype=np.float32))
        masks.append(mask)
        diffs.append((torch.from_numpy(np.ascontiguousarray(d.sampler_logprobs, dtype=np.float32)) - ref_t) * mask)
    total, n = torch.zeros((), dtype=torch.float32), torch.zeros((), dtype=torch.float32)
    for k, (diff, mask) in enumerate(zip(diffs, masks, strict=True)):
        total, n = (diff.sum(), mask.sum()) if k == 0 else (total + diff.sum(), n + mask.sum())
    mean_kl = total / n if float(n) > 0 else torch.zeros((), dtype=torch.float32)
    if coef:
        for d, diff, mask in zip(datums, diffs, masks, strict=True):
            adv = torch.from_numpy(np.ascontiguousarray(d.advantages, dtype=np.float32))
            d.advantages = (adv + coef * mask * (mean_kl - diff)).numpy()
    return {"kl_policy_ref": float(mean_kl)}


def sample_train_kl(datums: Sequence[RLDatum], trainer_logprobs_D: Sequence[np.ndarray]) -> dict[str, float]:
    """Sampler-vs-trainer divergence on action tokens, from the trainer's logprobs p and the
    sampler's q of the same targets: ``kl_sample_train_v1 = mean(q - p)`` and
    ``kl_sample_train_v2 = mean(0.5 (q - p)^2)`` (nats per token), and ``entropy`` =
    ``mean(-q)``, the sampled-token estimate of the sampler's entropy (nats per token)."""
    n = v1 = v2 = ent = 0.0
    for d, p in zip(datums, trainer_logprobs_D, strict=True):
        p = np.asarray(p, dtype=np.float64).reshape(-1)[: d.mask.shape[0]]
        diff = (d.sampler_logprobs - p) * d.mask
        n += float(d.mask.sum())
        v1 += float(diff.sum())
        v2 += float((0.5 * diff**2).sum())
        ent += float((-d.sampler_logprobs * d.mask).sum())
    n = max(n, 1.0)
    return {"kl_sample_train_v1": v1 / n, "kl_sample_train_v2": v2 / n, "entropy": ent / n}


def rollout_metrics(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """Step statistics of rollouts: ``reward_mean``/``reward_std`` (over trajectories), the mean
    of every env metric (``correct``, ``format``, ...), ``tokens_per_turn`` (action tokens per
    transition), ``turns_per_episode``, ``truncated_rate`` (``stop_reason == "length"``),
    ``trajectories``, ``groups``."""
    rewards, turns, tokens, truncated = [], [], [], []
    env: dict[str, list[float]] = {}
    for g in groups:
        rewards += g.total_rewards()
        for traj, gm in zip(g.trajectories_G, g.metrics_G, strict=True):
            turns.append(len(traj.transitions))
            for t in traj.transitions:
                tokens.append(len(t.action_tokens))
                truncated.append(float(t.stop_reason == "length"))
                for k, v in t.metrics.items():
                    env.setdefault(k, []).append(float(v))
            for k, v in gm.items():
                env.setdefault(k, []).append(float(v))
    out = {
        "reward_mean": float(np.mean(rewards)) if rewards else float("nan"),
        "reward_std": float(np.std(rewards)) if rewards else float("nan"),
        "tokens_per_turn": float(np.mean(tokens)) if tokens else 0.0,
        "turns_per_episode": float(np.mean(turns)) if turns else 0.0,
        "truncated_rate": float(np.mean(truncated)) if truncated else 0.0,
        "trajectories": float(len(rewards)),
        "groups": float(len(groups)),
    }
    for k, values in env.items():
        out[f"{k}_rate" if k in ("correct", "format") else k] = float(np.mean(values))
    return out
