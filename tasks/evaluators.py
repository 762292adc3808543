"""Evaluators: what the step loop runs every ``eval_every`` steps (and at the start and the end).

Two kinds, by the client they need:

- :class:`TrainingClientEvaluator`: runs on the training client (``forward``, no gradient), e.g.
  :class:`NLLEvaluator` (held-out negative log-likelihood);
- :class:`SamplingClientEvaluator`: runs on sampler weights of the evaluated step (the loop saves
  them when the step has none), e.g. benchmarks that sample and grade.

``evaluate`` returns metric rows ``{full name: value}`` (e.g. ``{"test/nll": 2.31}``) recorded at
the evaluated step in the training store; evaluators that also keep per-sample results write them
to the eval store themselves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import tinker
from prefect.utilities.annotations import quote

from prefect_tinker.tasks.clients import TrainingRun
from prefect_tinker.tasks.training import forward, weights_sum

__all__ = ["Evaluator", "NLLEvaluator", "PreferenceEvaluator", "SamplingClientEvaluator", "TrainingClientEvaluator"]


class Evaluator(ABC):
    """Base class of evaluators (see the module docstring). ``name`` prefixes nothing by itself:
    :meth:`evaluate` returns full metric names."""

    name: str = "eval"


class TrainingClientEvaluator(Evaluator):
    """An evaluator on the training client's current weights."""

    @abstractmethod
    def evaluate(self, credentials: Any, run: TrainingRun) -> dict[str, float]:
        """Metrics of the weights after ``run.step`` optimizer steps."""


class SamplingClientEvaluator(Evaluator):
    """An evaluator on saved sampler weights."""

    @abstractmethod
    def evaluate(self, credentials: Any, sampler_path: str, step: int) -> dict[str, float]:
        """Metrics of the sampler weights ``sampler_path`` (taken after ``step`` optimizer steps)."""


class NLLEvaluator(TrainingClientEvaluator):
    """Mean negative log-likelihood of held-out datums, nats per trained token.

    Returns ``{prefix}/nll`` (``loss:sum`` of a ``cross_entropy`` forward / the sum of weights) and
    ``{prefix}/tokens`` (the sum of weights).

    Args:
        datums: held-out datums (D); weights select the scored tokens.
        prefix: metric prefix (default ``test``).
    """

    name = "nll"

    def __init__(self, datums: list[tinker.Datum], prefix: str = "test"):
        self.datums, self.prefix = list(datums), prefix

    def evaluate(self, credentials: Any, run: TrainingRun) -> dict[str, float]:
        if not self.datums:
            return {}
        out = forward.with_options(task_run_name=f"eval-nll-step-{run.step}")(credentials, run, quote(self.datums))
        tokens = weights_sum(self.datums)
        return {f"{self.prefix}/nll": out.loss_sum / max(tokens, 1e-9), f"{self.prefix}/tokens": tokens}


class PreferenceEvaluator(TrainingClientEvaluator):
    """DPO-family loss and accuracy of held-out comparisons under the current weights.

    Returns ``{prefix}/dpo_loss`` (mean over pairs of ``loss``'s per-pair value),
    ``{prefix}/accuracy`` (fraction of pairs whose chosen log-ratio exceeds the rejected one, ties
    one half: :func:`~prefect_tinker.recipes.preference.pair_accuracy`) and
    ``{prefix}/margin`` (mean ``beta h``); the reference log-probabilities come from the cached
    ``reference-sequence-logprobs`` task.

    Args:
        pairs: held-out :class:`~prefect_tinker.recipes.preference.PairExample` s.
        loss: a :class:`~prefect_tinker.recipes.preference.DPOLoss` template (beta, loss name,
            label smoothing; its reference values are replaced).
        reference: the reference weights; via: ``trainer`` or ``sampler`` (see
            :mod:`prefect_tinker.tasks.reference`).
    """

    name = "preference"

    def __init__(self, pairs: list, *, beta: float, loss: str, label_smoothing: float, reference: str,
                 via: str = "trainer", prefix: str = "test", seed: int | None = None):
        from prefect_tinker.recipes.preference import pair_datums

        self.datums, self.prefix = pair_datums(list(pairs)), prefix
        self.beta, self.loss, self.label_smoothing = beta, loss, label_smoothing
        self.reference, self.via, self.seed = reference, via, seed

    def evaluate(self, credentials: Any, run: TrainingRun) -> dict[str, float]:
        import torch

        from prefect_tinker.recipes.preference import DPOLoss, pair_accuracy
        from prefect_tinker.tasks.reference import reference_sequence_logprobs

        if not self.datums:
            return {}
        ref = reference_sequence_logprobs.with_options(task_run_name=f"reference-{self.prefix}")(
            credentials, self.reference, quote(self.datums), self.via, self.seed)
        out = forward.with_options(task_run_name=f"eval-pairs-step-{run.step}")(credentials, run, quote(self.datums))
        loss = DPOLoss(ref, self.beta, self.loss, self.label_smoothing)
        with torch.no_grad():
            h, _, _ = loss.pair_terms(self.datums, [torch.tensor(lp, dtype=torch.float64) for lp in out.logprobs])
            values = loss.values(h)
        return {f"{self.prefix}/dpo_loss": float(values.mean()), f"{self.prefix}/accuracy": pair_accuracy(h),
                f"{self.prefix}/margin": float((self.beta * h).mean()), f"{self.prefix}/pairs": float(len(h))}
