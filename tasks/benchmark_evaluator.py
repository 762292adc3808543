"""Benchmarks during training: the ``evaluators`` of a recipe's config as sampling-client
evaluators of the step loop.

``StepLoop(session, total, evaluators=[..., *benchmark_evaluators(session)])`` runs each
configured benchmark (or inspect task) on the sampler weights of the evaluated step -- at the
start of a fresh run, every ``eval_every`` steps and at the end -- through the same cached
``evaluate-benchmark`` / ``evaluate-inspect`` tasks as the eval flow
(:mod:`prefect_tinker.tasks.eval_tasks`). Rows land in the eval store at the run's store root,
keyed by the training run and step (``eval_results.run_id`` = the run, ``step``, ``checkpoint`` =
the sampler path); the metrics also come back as ``eval/<benchmark>/<metric>``
(``eval/gsm8k/accuracy``, ``eval/gsm8k/accuracy_ci95_low``, ``eval/gsm8k/pass@1`` ...) and are
recorded in the training store's ``metrics`` at that step, so they appear in the run's curves.
"""

from __future__ import annotations

from typing import Any

from prefect_tinker.recipes.evals.benchmarks import BenchmarkSpec
from prefect_tinker.recipes.evals.specs import InspectSpec
from prefect_tinker.tasks.eval_tasks import EvalTarget, evaluate_benchmark, evaluate_inspect, inspect_backend_args
from prefect_tinker.tasks.evaluators import SamplingClientEvaluator

__all__ = ["BenchmarkEvaluator", "benchmark_evaluators"]

#: Metrics of an evaluation not recorded as training metrics (wall time is no property of the weights).
SKIPPED = ("seconds",)


class BenchmarkEvaluator(SamplingClientEvaluator):
    """A :class:`BenchmarkSpec` or :class:`InspectSpec` evaluated on sampler weights.

    Args:
        spec: what to run.
        run_id: the training run (``eval_results.run_id``).
        renderer: the run's resolved renderer.
        eval_store: eval store root (the run's store root).
        runner: task-runner settings for the batches (:class:`~prefect_tinker.tasks.runners.TaskRunnerFields`), or None.
        backend: the config's ``BackendConfig`` (inspect's provider args), or None.
        batch_size: examples per ``eval-batch`` task.
    """

    def __init__(
        self,
        spec: BenchmarkSpec | InspectSpec,
        *,
        run_id: str,
        renderer: str,
        eval_store: str,
        runner: Any = None,
        backend: Any = None,
        batch_size: int = 16,
    ):
        self.spec, self.run_id, self.renderer, self.eval_store = spec, run_id, renderer, eval_store
        self.runner, self.backend, self.batch_size = runner, backend, batch_size
        self.name = spec.name

    def evaluate(self, credentials: Any, sampler_path: str, step: int) -> dict[str, float]:
        """Run the evaluation on ``sampler_path`` (weights after ``step`` optimizer steps); returns
        ``{"eval/<name>/<metric>": value}``."""
        target = EvalTarget(
            run_id=self.run_id,
            step=step,
            checkpoint=sampler_path,
            sampler=sampler_path,
            renderer=self.renderer,
            label=f"step-{step}",
        )
        config = {"training_run": self.run_id}
        if isinstance(self.spec, InspectSpec):
            out = evaluate_inspect(
                credentials,
                target,
                self.spec,
                self.eval_store,
                backend_args=inspect_backend_args(self.backend),
                config=config,
            )
        else:
            out = evaluate_benchmark(
                credentials,
                target,
                self.spec,
                self.eval_store,
                runner=self.runner,
                batch_size=self.batch_size,
                config=config,
            )
        return {f"eval/{self.name}/{m}": float(v) for m, v in out["metrics"].items() if m not in SKIPPED}


def benchmark_evaluators(session: Any) -> list[BenchmarkEvaluator]:
    """The evaluators of ``session.config.evaluators`` for an open run session (its run id,
    resolved renderer, store root, backend and -- when the config has one -- task runner)."""
    c = session.config
    runner = c if hasattr(c, "task_runner") else None
    return [
        BenchmarkEvaluator(
            spec, run_id=session.run_id, renderer=session.renderer, eval_store=c.store, runner=runner, backend=c.backend
        )
        for spec in getattr(c, "evaluators", None) or []
    ]
