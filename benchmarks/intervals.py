"""95% percentile-bootstrap intervals for the measurements in the docs, read from a run's store.

- ``rl RUN``: the mean episode reward per step (from the ``trajectories`` table; run with
  ``log_trajectories`` >= the episodes per step so that every episode is there), and the first
  ``--window`` steps against the last ``--window`` steps with the interval of their difference.
  Resampled unit: a group (one problem's rollouts, kept together), within each window.
  ``--field NAME`` takes a per-episode metric from ``metrics_json`` (e.g. ``brier``) instead of
  the reward.
- ``decisions RUN``: held-out accuracy, Brier score and expected calibration error at the first
  and the last evaluation (from the ``eval_samples`` rows the decisions evaluator writes), and the
  interval of each difference by a paired bootstrap over the held-out items (the same resampled
  items at both steps; ECE recomputed on every resample with
  :func:`prefect_tinker.recipes.decisions.decision_metrics`).

Method: Efron & Tibshirani, *An Introduction to the Bootstrap* (1993), percentile intervals;
10,000 resamples, seed 0.

    python benchmarks/intervals.py rl smol-arith --window 3
    python benchmarks/intervals.py rl smol-fc --window 3 --field brier
    python benchmarks/intervals.py decisions smol-dec --store /tmp/smolhome/.prefect-tinker/store
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prefect_tinker.recipes.decisions import decision_metrics  # noqa: E402
from tinker_blocks.store_sql import query_stores  # noqa: E402

RESAMPLES = 10_000


def _ci(samples: np.ndarray) -> str:
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return f"[{lo:+.3f}, {hi:+.3f}]"


def _pooled_means(groups: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """Bootstrap distribution (RESAMPLES,) of the episode mean over ``groups`` resampled whole."""
    sums = np.array([g.sum() for g in groups])
    sizes = np.array([len(g) for g in groups])
    idx = rng.integers(0, len(groups), (RESAMPLES, len(groups)))
    return sums[idx].sum(1) / sizes[idx].sum(1)


def rl_intervals(root: str, run: str, window: int, field: str | None) -> None:
    """Print per-step means and the first-vs-last-window difference (module docstring)."""
    _, rows = query_stores(
        root,
        "SELECT step, batch_index, group_index, reward, metrics_json FROM trajectories WHERE run_id = ? "
        "ORDER BY step, batch_index, group_index, member",
        [run],
    )
    if not rows:
        raise SystemExit(f"no trajectories rows for run {run!r} under {root} (was log_trajectories set?)")
    by_step: dict[int, dict[tuple[int, int], list[float]]] = {}
    for step, batch, group, reward, metrics in rows:
        value = reward if field is None else json.loads(metrics or "{}").get(field)
        if value is not None:
            by_step.setdefault(step, {}).setdefault((batch, group), []).append(float(value))
    rng = np.random.default_rng(0)
    steps = sorted(by_step)
    print(f"{field or 'reward'} per step (mean over episodes, 95% interval resampling groups):")
    for s in steps:
        groups = [np.array(g) for g in by_step[s].values()]
        mean = np.concatenate(groups).mean()
        print(f"  step {s}: {mean:.3f} {_ci(_pooled_means(groups, rng))} ({sum(map(len, groups))} episodes)")
    first = [np.array(g) for s in steps[:window] for g in by_step[s].values()]
    last = [np.array(g) for s in steps[-window:] for g in by_step[s].values()]
    bf, bl = _pooled_means(first, rng), _pooled_means(last, rng)
    mf, ml = np.concatenate(first).mean(), np.concatenate(last).mean()
    print(f"first {window} steps: {mf:.3f} {_ci(bf)} ({len(first)} groups)")
    print(f"last {window} steps: {ml:.3f} {_ci(bl)} ({len(last)} groups)")
    print(f"difference: {ml - mf:+.3f} {_ci(bl - bf)}")


def decision_intervals(root: str, run: str) -> None:
    """Print first vs last evaluation's held-out metrics with paired-bootstrap intervals."""
    _, rows = query_stores(
        root,
        "SELECT step, example_id, extra_json FROM eval_samples WHERE run_id = ? AND eval_name = 'decisions/test' "
        "ORDER BY step, CAST(example_id AS INTEGER)",
        [run],
    )
    if not rows:
        raise SystemExit(f"no decisions eval_samples rows for run {run!r} under {root}")
    steps = sorted({r[0] for r in rows})
    first, last = steps[0], steps[-1]

    def arrays(step: int) -> tuple[np.ndarray, np.ndarray]:
        extra = [json.loads(r[2]) for r in rows if r[0] == step]
        return np.array([e["probs"] for e in extra]), np.array([e["target"] for e in extra])

    (p0, t0), (p1, t1) = arrays(first), arrays(last)
    if not np.array_equal(t0, t1):
        raise SystemExit(f"the held-out items differ between steps {first} and {last}")
    rng = np.random.default_rng(0)
    names = ("accuracy", "brier", "ece")
    draws = {k: [] for k in names}
    for _ in range(RESAMPLES):
        idx = rng.integers(0, len(t0), len(t0))
        m0, m1 = decision_metrics(p0[idx], t0[idx]), decision_metrics(p1[idx], t1[idx])
        for k in names:
            draws[k].append((m0[k], m1[k]))
    m0, m1 = decision_metrics(p0, t0), decision_metrics(p1, t1)
    print(f"{len(t0)} held-out items, step {first} -> step {last} (paired bootstrap over items):")
    for k in names:
        d = np.array(draws[k])
        print(
            f"  {k}: {m0[k]:.3f} {_ci(d[:, 0])} -> {m1[k]:.3f} {_ci(d[:, 1])}, "
            f"difference {m1[k] - m0[k]:+.3f} {_ci(d[:, 1] - d[:, 0])}"
        )


def main() -> None:
    default_root = os.environ.get("PREFECT_TINKER_STORE", str(Path("~/.prefect-tinker/store").expanduser()))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=["rl", "decisions"])
    ap.add_argument("run", help="run id (run_name)")
    ap.add_argument("--store", default=default_root, help="store root (default: $PREFECT_TINKER_STORE or ~/...)")
    ap.add_argument("--window", type=int, default=3, help="rl: steps at the start and at the end compared")
    ap.add_argument("--field", default=None, help="rl: a per-episode metric of metrics_json instead of the reward")
    args = ap.parse_args()
    if args.kind == "rl":
        rl_intervals(args.store, args.run, args.window, args.field)
    else:
        decision_intervals(args.store, args.run)


if __name__ == "__main__":
    main()
