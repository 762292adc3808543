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

__all__ = ["Evaluator", "NLLEvaluator", "SamplingClientEvaluator", "TrainingClientEvaluator"]


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
