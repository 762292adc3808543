"""Aggregate statistics of graded samples: unbiased pass@k and the Wilson score interval.

- :func:`pass_at_k`: the unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models
  Trained on Code" (arXiv:2107.03374), section 2.1: with ``n`` samples of which ``c`` are correct,
  ``pass@k = 1 - C(n - c, k) / C(n, k)``, computed in the numerically stable product form
  ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (no large binomials).
- :func:`wilson_interval`: the Wilson score interval for a binomial proportion (E. B. Wilson 1927,
  "Probable inference, the law of succession, and statistical inference", JASA 22:209-212): the
  set of proportions ``p`` that a two-sided score test at level ``1 - confidence`` does not reject.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

__all__ = ["pass_at_k", "mean_pass_at_k", "wilson_interval"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: the probability that at least one of ``k`` samples drawn
    without replacement from ``n`` generated samples (``c`` of them correct) is correct.

    Args:
        n: samples generated (>= 1); c: correct among them (0..n); k: 1..n.

    Returns:
        A float in [0, 1]; 1.0 when ``n - c < k`` (every k-subset holds a correct sample).

    Raises:
        ValueError: ``n < 1``, ``c`` outside ``[0, n]`` or ``k`` outside ``[1, n]``.
    """
    if n < 1 or not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs n >= 1, 0 <= c <= n, 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(correct_counts: Sequence[int], n: int, k: int) -> float:
    """Mean of :func:`pass_at_k` over problems, each with ``n`` samples and ``correct_counts[i]``
    correct ones. Raises ValueError on an empty list or bad counts."""
    if not correct_counts:
        raise ValueError("mean_pass_at_k needs at least one problem")
    return sum(pass_at_k(n, int(c), k) for c in correct_counts) / len(correct_counts)


def wilson_interval(successes: float, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval ``(low, high)`` for the proportion ``successes / n``.

    ``successes`` may be fractional (``n * p_hat`` for an estimated proportion such as a mean of
    per-problem accuracies); ``n`` is the number of independent units.

    Raises:
        ValueError: ``n < 1``, ``successes`` outside ``[0, n]`` or ``confidence`` outside (0, 1).
    """
    if n < 1 or not 0 <= successes <= n or not 0 < confidence < 1:
        raise ValueError(
            f"wilson_interval needs n >= 1, 0 <= successes <= n, 0 < confidence < 1; "
            f"got successes={successes}, n={n}, confidence={confidence}"
        )
    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    z2n = z * z / n
    centre = (p + z2n / 2) / (1 + z2n)
    half = z / (1 + z2n) * math.sqrt(p * (1 - p) / n + z2n / (4 * n))
    low = 0.0 if successes == 0 else max(0.0, centre - half)  # exact ends (rounding leaves ~1e-17)
    high = 1.0 if successes == n else min(1.0, centre + half)
    return low, high
