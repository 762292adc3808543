"""What the student is trained on: reverse-KL advantages and top-K soft targets.

**On-policy distillation** (Agarwal et al. 2024, "On-Policy Distillation of Language Models",
arXiv:2306.13649; Thinking Machines, "On-Policy Distillation", 2025): the student samples, the
teacher scores the sampled tokens, and every completion token gets the advantage

    A_t = -kl_penalty_coef * (log p_student(x_t) - log p_teacher(x_t))

(the negative per-token reverse-KL estimate), optionally discounted over the tokens that follow
(``A_t <- sum_{s >= t} gamma^(s-t) A_s``, :func:`discounted_future_sum`), trained with the
``importance_sampling`` (or ``ppo``) loss. :func:`kl_advantages`.

**Top-K soft targets** (forward KL restricted to the teacher's K most likely tokens; Tinker's
``(N, K)`` ``cross_entropy``): at each distilled position the teacher's top-K logprobs are
renormalised over the K tokens, ``q_k = exp(l_k - logsumexp(l))``; ``target_tokens[i, :] `` are
the K ids and ``weights[i, :]`` the ``q_k``, so the server's loss ``-(weights * logp).sum()`` is
``sum_i CE(q_i, p_student)``. Ids outside the student's vocabulary are dropped before the
renormalisation, missing slots padded with id 0 and weight 0. :func:`soft_targets`.

**Reverse KL over the K slots** (SDFT with ``reverse=true``): ``sum_k p~_k (log p~_k - log q_k)``
with ``p~`` the student renormalised over the same slots, differentiated exactly in torch on the
client (:class:`ReverseKLLoss`, for ``forward_backward_custom``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["ReverseKLLoss", "SoftTargets", "discounted_future_sum", "kl_advantages", "soft_targets"]


def discounted_future_sum(x: np.ndarray, gamma: float) -> np.ndarray:
    """``y_t = sum_{s >= t} gamma^(s-t) x_s`` over a 1-D array (float64)."""
    x = np.asarray(x, dtype=np.float64)
    out, acc = np.zeros_like(x), 0.0
    for t in range(len(x) - 1, -1, -1):
        acc = x[t] + gamma * acc
        out[t] = acc
    return out


def kl_advantages(
    student_logprobs: np.ndarray, teacher_logprobs: np.ndarray, mask: np.ndarray, *, coef: float, discount: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Per-token distillation advantages of one datum (see the module docstring).

    Args:
        student_logprobs: the sampler's logprobs of the targets (N,), nats.
        teacher_logprobs: the teacher's logprobs of the same targets (N,) (0 off the mask).
        mask: 1.0 on completion targets that have a teacher counterpart (N,).
        coef: ``kl_penalty_coef``; discount: ``kl_discount_factor`` (0 = none).

    Returns:
        ``(advantages, reverse_kl)``, float64 (N,), both 0 off the mask.  Without a discount they
        are computed in float32, in tinker-cookbook 0.6.1's order (``distillation/train_on_policy.py:
        incorporate_kl_penalty``: ``kl = (s - t) * m``, ``adv = (-coef * m) * kl``), so the same
        logprobs give the same advantages to the bit.

    Raises:
        ValueError: arrays of different shapes.
    """
    s, t, m = (np.asarray(a, dtype=np.float32) for a in (student_logprobs, teacher_logprobs, mask))
    if not s.shape == t.shape == m.shape:
        raise ValueError(f"shapes differ: student {s.shape}, teacher {t.shape}, mask {m.shape}")
    kl = (s - t) * m
    if discount > 0:
        return discounted_future_sum(-coef * kl.astype(np.float64), discount) * m, kl.astype(np.float64)
    return ((np.float32(-coef) * m) * kl).astype(np.float64), kl.astype(np.float64)


@dataclass
class SoftTargets:
    """``(N, K)`` soft targets of one datum.

    Attributes:
        target_tokens: int64 (N, K); weights: float32 (N, K) (rows sum to 1 on distilled
        positions, 0 elsewhere); positions: distilled rows; entropy_sum: sum over them of the
        renormalised teacher entropy ``-sum_k q_k log q_k`` (nats); dropped: ids dropped for being
        outside the vocabulary.
    """

    target_tokens: np.ndarray
    weights: np.ndarray
    positions: int = 0
    entropy_sum: float = 0.0
    dropped: int = 0


def soft_targets(
    topk_ids: np.ndarray,
    topk_logprobs: np.ndarray,
    pairs: Sequence[tuple[int, int]],
    *,
    n_targets: int,
    k: int,
    vocab_size: int,
) -> SoftTargets:
    """Soft targets from the teacher's top-K rows (see the module docstring).

    Args:
        topk_ids, topk_logprobs: the teacher's top-K per target of its sequence (L_t - 1, K'),
            int / float; empty slots have id < 0 or logprob -inf.
        pairs: ``(student target, teacher target)`` of the distilled positions.
        n_targets: N, the student datum's targets; k: K, columns of the result.
        vocab_size: ids >= this (or < 0) are dropped.

    Raises:
        ValueError: a pair outside either sequence.
    """
    ids = np.asarray(topk_ids, dtype=np.int64)
    lps = np.asarray(topk_logprobs, dtype=np.float64)
    tt = np.zeros((n_targets, k), dtype=np.int64)
    w = np.zeros((n_targets, k), dtype=np.float32)
    out = SoftTargets(tt, w)
    for s, t in pairs:
        if not (0 <= s < n_targets and 0 <= t < len(ids)):
            raise ValueError(f"pair ({s}, {t}) outside the student's {n_targets} or the teacher's {len(ids)} targets")
        row_ids, row_lp = ids[t, :k], lps[t, :k]
        keep = (row_ids >= 0) & (row_ids < vocab_size) & np.isfinite(row_lp)
        out.dropped += int(((row_ids >= vocab_size) & np.isfinite(row_lp)).sum())
        if not keep.any():
            continue
        # renormalised in float32 with torch, as tinker-cookbook 0.6.1's SDFT does (distillation/sdft.py:
        # build_topk_distillation_datums): the same teacher rows give the same weights to the bit
        import torch  # here, not at the top: reading distillation data needs no torch

        lp32 = torch.tensor(row_lp[keep].tolist(), dtype=torch.float32)
        logq32 = lp32 - torch.logsumexp(lp32, dim=0)
        q, logq = logq32.exp().numpy(), logq32.double().numpy()
        n = len(q)
        tt[s, :n], w[s, :n] = row_ids[keep], q
        out.positions += 1
        out.entropy_sum += float(-(q * logq).sum())
    return out


class ReverseKLLoss:
    """Reverse KL to the teacher over the K slots of soft-target datums, for
    ``forward_backward_custom``: ``loss(datums, logprobs_D) -> (loss, metrics)``.

    ``datums`` carry ``(N, K)`` ``target_tokens`` and ``weights`` = the teacher's renormalised
    ``q`` (0 on padding and off the distilled positions); ``logprobs_D[d]`` are the student's
    logprobs of those ids (N, K). Per distilled position the student is renormalised over its
    valid slots, ``log p~ = log_softmax(logp[valid])``, and the loss adds
    ``sum_k p~_k (log p~_k - log q_k)``; the gradient is the exact one (autograd through
    ``p~``). Metrics: ``kl:sum`` (the loss value), ``positions:sum``, ``student_entropy:sum``.
    """

    def __call__(self, datums: list, logprobs: list) -> tuple[object, dict[str, float]]:
        import torch

        total = torch.zeros((), dtype=torch.float64)
        positions, entropy = 0.0, 0.0
        for d, lp in zip(datums, logprobs, strict=True):
            q = torch.as_tensor(np.asarray(d.loss_fn_inputs["weights"].to_numpy(), dtype=np.float64)).reshape(lp.shape)
            valid = q > 0
            rows = valid.any(dim=-1)
            if not rows.any():
                total = total + 0.0 * lp.sum()
                continue
            lp64 = lp.to(torch.float64)
            masked = torch.where(valid, lp64, torch.full_like(lp64, float("-inf")))
            log_p = torch.log_softmax(masked[rows], dim=-1)
            v = valid[rows]
            log_p = torch.where(v, log_p, torch.zeros_like(log_p))
            p = torch.where(v, log_p.exp(), torch.zeros_like(log_p))
            log_q = torch.where(v, torch.log(q[rows].clamp_min(1e-300)), torch.zeros_like(log_p))
            total = total + (p * (log_p - log_q)).sum()
            positions += float(rows.sum())
            entropy += float(-(p * log_p).sum().detach())
        return total, {"kl:sum": float(total.detach()), "positions:sum": positions, "student_entropy:sum": entropy}
