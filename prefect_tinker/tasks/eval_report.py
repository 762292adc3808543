"""The eval flow's artifacts: a table of checkpoints x benchmarks, and accuracy against training
step as a picture.

Both are made from the outcomes of ``evaluate-benchmark`` / ``evaluate-inspect`` (cached ones
included, so a re-run over a growing training run shows every checkpoint) and posted under
stable keys ``eval-<run>-results`` and ``eval-<run>-accuracy``; the picture is also written to
``<eval store root>/reports/eval-<run>/accuracy.png``.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from prefect_tinker.tasks.policies import RETRY_OPTIONS
from prefect_tinker.tasks.reporting import artifact_key, plot_curves, write_png

__all__ = ["accuracy_series", "report_eval", "results_table"]


def _cell(metrics: dict[str, float], n: int) -> str:
    acc = metrics.get("accuracy")
    if acc is None:
        return ", ".join(f"{k}={v:.3g}" for k, v in sorted(metrics.items()) if k != "seconds")[:120]
    lo, hi = metrics.get("accuracy_ci95_low"), metrics.get("accuracy_ci95_high")
    ci = f" [{lo:.3f}, {hi:.3f}]" if lo is not None and hi is not None else ""
    return f"{acc:.3f}{ci} (n={n})"


def results_table(outcomes: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per evaluated weights (run, step, checkpoint), one column per benchmark:
    ``accuracy [ci95 low, high] (n=examples)`` (other metrics for evals without an accuracy)."""
    rows: dict[tuple, dict[str, Any]] = {}
    for o in outcomes:
        key = (o["run_id"], o["step"] if o["step"] is not None else -1, o["checkpoint"])
        row = rows.setdefault(key, {"run": o["run_id"], "step": o["step"], "checkpoint": o["checkpoint"]})
        row[o["eval_name"]] = _cell(o["metrics"], o["num_examples"])
    return [rows[k] for k in sorted(rows, key=lambda k: (k[0], k[1], k[2]))]


def accuracy_series(outcomes: Sequence[dict[str, Any]]) -> dict[str, tuple[list[int], list[float]]]:
    """``"<eval>"`` (or ``"<run>/<eval>"`` with several runs) -> (steps, accuracies) of the outcomes
    with a training step and an accuracy, in step order."""
    points = [o for o in outcomes if o["step"] is not None and "accuracy" in o["metrics"]]
    several = len({o["run_id"] for o in points}) > 1
    series: dict[str, list[tuple[int, float]]] = {}
    for o in points:
        name = f"{o['run_id']}/{o['eval_name']}" if several else o["eval_name"]
        series.setdefault(name, []).append((int(o["step"]), float(o["metrics"]["accuracy"])))
    return {n: ([s for s, _ in sorted(p)], [v for _, v in sorted(p)]) for n, p in sorted(series.items())}


@task(name="report-eval", task_run_name="report-eval-{run_name}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def report_eval(run_name: str, outcomes: list[dict[str, Any]], eval_root: str) -> dict[str, Any]:
    """Post the results table and (when any outcome has a training step) the accuracy picture.

    Returns ``{"rows": n, "png": path or None}``.
    """
    table = results_table(outcomes)
    if table:
        names = sorted({o["eval_name"] for o in outcomes})
        create_table_artifact(
            [
                {**{k: r.get(k) for k in ("run", "step", "checkpoint")}, **{n: r.get(n, "") for n in names}}
                for r in table
            ],
            key=artifact_key("eval", run_name, "results"),
            description=f"Evaluation `{run_name}`: accuracy [95% interval] (examples) per checkpoint and benchmark",
        )
    series = accuracy_series(outcomes)
    if not series:
        return {"rows": len(table), "png": None}
    png = plot_curves(series, f"accuracy by training step ({run_name})")
    path = write_png(eval_root, f"eval-{run_name}", png, "accuracy.png")
    data = base64.b64encode(png).decode("ascii")
    create_markdown_artifact(
        "\n".join(
            [
                f"# Evaluation `{run_name}`: accuracy against training step",
                "",
                f"![accuracy of {run_name}](data:image/png;base64,{data})",
                "",
                f"Picture also at `{path}`.",
            ]
        ),
        key=artifact_key("eval", run_name, "accuracy"),
        description="accuracy by training step",
    )
    return {"rows": len(table), "png": path}
