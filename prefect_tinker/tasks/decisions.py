"""The decisions recipe's server-facing parts: its custom loss handle and its evaluator.

- :func:`choice_loss_handle`: :func:`~prefect_tinker.recipes.decisions.choice_loss` uploaded with
  ``ServiceClient.create_custom_loss`` (run on the server when it accepts it, as ``tinker_local``
  does; client-side otherwise: :mod:`prefect_tinker.tasks.custom_losses`), for
  ``forward_backward_custom`` in the ``custom-step`` task.
- :class:`DecisionEvaluator`: held-out examples under the current weights (one ``forward`` with
  rank-2 targets gives every label's logprob): ``test/accuracy``, ``test/brier``, ``test/nll``,
  ``test/ece``, ``test/count``; each evaluation also draws the reliability diagram (matplotlib
  PNG, :func:`plot_reliability`), writes it to ``<store>/reports/<run>/reliability-step-<s>.png``
  and posts it as the markdown artifact ``decisions-<run>-reliability``, and writes one
  ``eval_samples`` row per held-out example to the eval store under the same root
  (``eval_name='decisions/test'``, ``step``, ``example_id`` = its index, ``score`` = its Brier score,
  ``correct``, ``extra_json`` = ``{"probs": [...], "target": [...]}``), so intervals over the
  held-out items (a bootstrap of the before/after difference) can be computed with SQL.
"""

from __future__ import annotations

import base64
import io
import json
from typing import TYPE_CHECKING, Any

import numpy as np
from prefect.artifacts import create_markdown_artifact

from prefect_tinker.recipes.decisions import (
    CHOICE_LOSS_RANKS,
    DecisionExample,
    choice_loss,
    choice_probs,
    decision_datum,
    decision_metrics,
    reliability_bins,
)
from prefect_tinker.tasks.clients import TrainingRun
from prefect_tinker.tasks.custom_losses import custom_loss
from prefect_tinker.tasks.evaluators import TrainingClientEvaluator
from prefect_tinker.tasks.policies import quote
from prefect_tinker.tasks.reporting import artifact_key, write_png
from prefect_tinker.tasks.training import forward

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["DecisionEvaluator", "choice_loss_handle", "plot_reliability"]


def choice_loss_handle(credentials: TinkerCredentials) -> Any:
    """What ``forward_backward_custom`` runs for :func:`~prefect_tinker.recipes.decisions.choice_loss`
    on the credentials' service client: its uploaded ``LossHandle``, or the client-side fallback
    (:func:`~prefect_tinker.tasks.custom_losses.custom_loss`), resolved once per service client.

    Raises:
        tinker errors: the upload failed otherwise than by a refusal.
    """
    return custom_loss(credentials, choice_loss, CHOICE_LOSS_RANKS)


def plot_reliability(bins: list[dict[str, float]], title: str) -> bytes:
    """A reliability diagram (PNG bytes): per confidence bin, the accuracy (bars) against the
    diagonal of perfect calibration, and the bin counts (second panel). matplotlib's Agg backend."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5, 6))
    top, bottom = fig.subplots(2, 1, gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    centers = [(b["lo"] + b["hi"]) / 2 for b in bins]
    width = bins[0]["hi"] - bins[0]["lo"]
    acc = [0.0 if not b["count"] else b["accuracy"] for b in bins]
    top.bar(centers, acc, width=width * 0.9, color="tab:blue", label="accuracy")
    top.plot([0, 1], [0, 1], "k--", lw=1, label="perfect calibration")
    conf = [(c, b["confidence"]) for c, b in zip(centers, bins, strict=True) if b["count"]]
    if conf:
        top.plot(*zip(*conf, strict=True), "o", color="tab:orange", label="mean confidence")
    top.set(ylim=(0, 1), ylabel="accuracy", title=title)
    top.legend(loc="upper left", fontsize=8)
    bottom.bar(centers, [b["count"] for b in bins], width=width * 0.9, color="tab:gray")
    bottom.set(xlim=(0, 1), xlabel="confidence (max choice probability)", ylabel="count")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


class DecisionEvaluator(TrainingClientEvaluator):
    """Accuracy, Brier score, NLL and expected calibration error of held-out decision examples,
    and their reliability diagram (module docstring).

    Args:
        examples: held-out :class:`~prefect_tinker.recipes.decisions.DecisionExample` s (D).
        labels: the choices' label tokens (N,).
        store: the run's store root (the PNG goes under ``reports/<run_id>/``); run_id: the run.
        n_bins: confidence bins of the ECE and the diagram.
    """

    name = "decisions"

    def __init__(
        self,
        examples: list[DecisionExample],
        labels: list[int],
        *,
        store: str,
        run_id: str,
        n_bins: int = 10,
        prefix: str = "test",
    ):
        self.labels, self.store, self.run_id, self.n_bins, self.prefix = list(labels), store, run_id, n_bins, prefix
        self.datums = [decision_datum(ex, self.labels) for ex in examples]
        self.targets = np.asarray([ex.target for ex in examples], dtype=np.float64)

    def predictions(self, credentials: TinkerCredentials, run: TrainingRun) -> np.ndarray:
        """The choice distributions (D, N) of the held-out examples under the current weights."""
        out = forward.with_options(task_run_name=f"eval-decisions-step-{run.step}")(
            credentials, run, quote(self.datums)
        )
        n = len(self.labels)
        return np.stack([choice_probs(np.asarray(lp)[-n:]) for lp in out.logprobs])

    def evaluate(self, credentials: TinkerCredentials, run: TrainingRun) -> dict[str, float]:
        if not self.datums:
            return {}
        probs = self.predictions(credentials, run)
        metrics = decision_metrics(probs, self.targets, self.n_bins)
        bins = reliability_bins(probs, self.targets, self.n_bins)
        png = plot_reliability(
            bins, f"{self.run_id} step {run.step}: ECE {metrics['ece']:.3f}, accuracy {metrics['accuracy']:.2f}"
        )
        self._write_samples(run.step, probs)
        path = write_png(self.store, self.run_id, png, f"reliability-step-{run.step}.png")
        data = base64.b64encode(png).decode("ascii")
        create_markdown_artifact(
            f"# Reliability diagram of `{self.run_id}` at step {run.step}\n\n"
            f"![reliability](data:image/png;base64,{data})\n\nAlso at `{path}`. "
            + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
            key=artifact_key("decisions", self.run_id, "reliability"),
            description="reliability diagram",
        )
        return {f"{self.prefix}/{k}": v for k, v in metrics.items()}

    def _write_samples(self, step: int, probs: np.ndarray) -> None:
        from tinker_blocks.stores import EvalStore

        rows = [
            {
                "run_id": self.run_id,
                "eval_name": f"decisions/{self.prefix}",
                "step": step,
                "example_id": str(i),
                "sample_index": 0,
                "score": float(((p - t) ** 2).sum()),
                "correct": bool(p.argmax() == t.argmax()),
                "extra_json": json.dumps({"probs": p.tolist(), "target": t.tolist()}),
            }
            for i, (p, t) in enumerate(zip(probs, self.targets, strict=True))
        ]
        EvalStore(root=self.store).write_rows("eval_samples", rows)
