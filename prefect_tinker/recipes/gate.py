"""The promotion gate: is the candidate better than the champion on the same items?

Both models answer the same evaluation suite (the same examples of each benchmark, the same
sampling seeds). Each example gets a score per model -- the mean of its samples' ``correct``
(or ``score``) -- and the comparison is over the per-example differences
``d_i = candidate_i - champion_i``, paired, so what the two share (an example's difficulty)
cancels out.

The interval of the mean difference is a *paired percentile bootstrap* (Efron & Tibshirani 1993,
*An Introduction to the Bootstrap*, ch. 13): ``resamples`` times, draw each benchmark's examples
with replacement (stratified by benchmark, so every resample keeps each benchmark's size) and take
the mean difference; the interval's ends are the ``(1 - confidence) / 2`` and ``(1 + confidence) / 2``
quantiles of those means. The suite's difference weighs every example equally; each benchmark also
gets its own difference and interval from the same resamples.

The gate (:class:`GateConfig`) promotes when

- the lower end of the suite's interval is above ``min_lower_bound`` (default 0: better, with the
  chosen confidence), and
- no benchmark listed in ``margins`` got worse by more than its margin (``difference >= -margin``,
  the point estimate).

Pure numpy: no Prefect, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, Field

__all__ = ["GateConfig", "GateDecision", "item_scores", "paired_bootstrap", "decide"]


class GateConfig(BaseModel):
    """When a candidate replaces the champion (see the module docstring)."""

    min_lower_bound: float = Field(
        default=0.0,
        description="Promote only when the lower end of the suite's interval of (candidate - champion) exceeds this.",
    )
    margins: dict[str, float] = Field(
        default_factory=dict,
        description="Benchmark -> largest drop allowed (a fraction, e.g. 0.02): a listed benchmark worse by more "
        "blocks the promotion, whatever the suite says.",
    )
    confidence: float = Field(default=0.95, gt=0, lt=1, description="Coverage of the bootstrap interval.")
    resamples: int = Field(default=2000, ge=100, le=100_000, description="Bootstrap resamples.")
    seed: int = Field(default=0, description="Seed of the bootstrap's resampling.")
    score: Literal["correct", "score"] = Field(
        default="correct", description="Per-sample value compared: correct (0/1) or the grader's score."
    )


class GateDecision(BaseModel):
    """The gate's numbers and verdict.

    Attributes:
        promote: whether the gate holds.
        difference, low, high: the suite's mean (candidate - champion) per example and its interval.
        items: examples compared (over all benchmarks).
        benchmarks: per benchmark ``{difference, low, high, items, candidate, champion, margin, ok}``
            (``candidate`` / ``champion``: mean per-example scores).
        reasons: one line per condition, saying whether it held.
    """

    promote: bool
    difference: float
    low: float
    high: float
    items: int
    benchmarks: dict[str, dict[str, Any]]
    reasons: list[str]
    confidence: float
    resamples: int


def item_scores(rows: Sequence[Mapping[str, Any]], score: str = "correct") -> dict[str, float]:
    """Per-example scores from ``eval_samples`` rows (``example_id``, ``correct`` / ``score``):
    the mean over each example's samples (a missing value counts 0).

    Returns:
        ``{example_id: mean score}``.
    """
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for r in rows:
        ex = str(r["example_id"])
        v = r.get(score)
        sums[ex] = sums.get(ex, 0.0) + (float(v) if v is not None else 0.0)
        counts[ex] = counts.get(ex, 0) + 1
    return {ex: sums[ex] / counts[ex] for ex in sums}


def paired_bootstrap(
    differences: Mapping[str, Sequence[float]], *, resamples: int = 2000, confidence: float = 0.95, seed: int = 0
) -> tuple[tuple[float, float, float], dict[str, tuple[float, float, float]]]:
    """Stratified percentile bootstrap of mean paired differences (module docstring).

    Args:
        differences: benchmark -> per-example differences ``d_i`` (each non-empty).
        resamples: B; confidence: interval coverage in (0, 1); seed: the resampling seed.

    Returns:
        ``((mean, low, high) of the suite, {benchmark: (mean, low, high)})``; the suite's mean
        weighs every example equally.

    Raises:
        ValueError: no differences, or an empty benchmark.
    """
    if not differences:
        raise ValueError("no paired differences to compare")
    rng = np.random.default_rng(seed)
    q = ((1 - confidence) / 2 * 100, (1 + confidence) / 2 * 100)
    total_n = sum(len(d) for d in differences.values())
    suite_sums = np.zeros(resamples)
    per: dict[str, tuple[float, float, float]] = {}
    for name in sorted(differences):
        d = np.asarray(differences[name], dtype=np.float64)
        if d.size == 0:
            raise ValueError(f"benchmark {name!r} has no paired examples")
        sums = d[rng.integers(0, d.size, size=(resamples, d.size))].sum(axis=1)
        suite_sums += sums
        lo, hi = np.percentile(sums / d.size, q)
        per[name] = (float(d.mean()), float(lo), float(hi))
    all_d = np.concatenate([np.asarray(differences[n], dtype=np.float64) for n in sorted(differences)])
    lo, hi = np.percentile(suite_sums / total_n, q)
    return (float(all_d.mean()), float(lo), float(hi)), per


def decide(
    candidate: Mapping[str, Mapping[str, float]], champion: Mapping[str, Mapping[str, float]], gate: GateConfig
) -> GateDecision:
    """Compare per-example scores (:func:`item_scores`) of the two models on each benchmark and
    apply the gate.

    Args:
        candidate, champion: benchmark -> {example_id: score}, the same benchmarks and examples.

    Raises:
        ValueError: the benchmarks or their examples differ between the two (not the same suite),
            or a margin names a benchmark that was not evaluated.
    """
    if set(candidate) != set(champion):
        raise ValueError(f"not the same suite: candidate {sorted(candidate)} vs champion {sorted(champion)}")
    unknown = sorted(set(gate.margins) - set(candidate))
    if unknown:
        raise ValueError(f"gate margins name benchmarks that were not evaluated: {unknown}")
    diffs: dict[str, list[float]] = {}
    for name in sorted(candidate):
        a, b = candidate[name], champion[name]
        if set(a) != set(b):
            only = sorted(set(a) ^ set(b))[:5]
            raise ValueError(f"benchmark {name!r}: the two models answered different examples (e.g. {only})")
        diffs[name] = [a[ex] - b[ex] for ex in sorted(a)]
    (mean, low, high), per = paired_bootstrap(
        diffs, resamples=gate.resamples, confidence=gate.confidence, seed=gate.seed
    )
    pct = f"{gate.confidence:.0%}"
    reasons = [
        f"suite: difference {mean:+.4f}, {pct} interval [{low:+.4f}, {high:+.4f}]; lower end "
        f"{'>' if low > gate.min_lower_bound else '<='} {gate.min_lower_bound:g}"
    ]
    ok = low > gate.min_lower_bound
    benchmarks: dict[str, dict[str, Any]] = {}
    for name, (d, lo, hi) in per.items():
        margin = gate.margins.get(name)
        held = margin is None or d >= -margin
        benchmarks[name] = {
            "difference": d,
            "low": lo,
            "high": hi,
            "items": len(diffs[name]),
            "candidate": float(np.mean(list(candidate[name].values()))),
            "champion": float(np.mean(list(champion[name].values()))),
            "margin": margin,
            "ok": held,
        }
        if margin is not None:
            reasons.append(f"{name}: difference {d:+.4f} {'>=' if held else '<'} -{margin:g} (largest drop allowed)")
            ok = ok and held
    return GateDecision(
        promote=ok,
        difference=mean,
        low=low,
        high=high,
        items=sum(len(d) for d in diffs.values()),
        benchmarks=benchmarks,
        reasons=reasons,
        confidence=gate.confidence,
        resamples=gate.resamples,
    )
