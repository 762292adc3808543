"""Benchmarks during training: the ``evaluators`` of a recipe's config as sampling-client
evaluators of the step loop.

``StepLoop(session, total, evaluators=[..., *benchmark_evaluators(session.context)])`` runs each
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

from typing import TYPE_CHECKING, Any

from prefect_tinker.recipes.evals.benchmarks import BenchmarkSpec
from prefect_tinker.recipes.evals.specs import InspectSpec
from prefect_tinker.tasks.eval_tasks import EvalTarget, evaluate_benchmark, evaluate_inspect
from prefect_tinker.tasks.evaluators import SamplingClientEvaluator
from prefect_tinker.tasks.run_context import RunContext
from prefect_tinker.tasks.runners import TaskRunnerFields

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

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
        runner: task-runner settings for the batches, or None (the flow's thread pool).
        inspect_backend: provider args of the inspect ``tinker`` model (no secrets).
        batch_size: examples per ``eval-batch`` task.
    """

    def __init__(
        self,
        spec: BenchmarkSpec | InspectSpec,
        *,
        run_id: str,
        renderer: str,
        eval_store: str,
        runner: TaskRunnerFields | None = None,
        inspect_backend: dict[str, Any] | None = None,
        batch_size: int = 16,
    ):
        self.spec, self.run_id, self.renderer, self.eval_store = spec, run_id, renderer, eval_store
        self.runner, self.inspect_backend, self.batch_size = runner, dict(inspect_backend or {}), batch_size
        self.name = spec.name

    def evaluate(self, credentials: TinkerCredentials, sampler_path: str, step: int) -> dict[str, float]:
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
                backend_args=self.inspect_backend,
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


def benchmark_evaluators(ctx: RunContext) -> list[BenchmarkEvaluator]:
    """The evaluators of the run's configured ``evaluators`` (its run id, resolved renderer, store
    root, inspect provider args and task runner, from the run context)."""
    return [
        BenchmarkEvaluator(
            spec,
            run_id=ctx.run_id,
            renderer=ctx.renderer,
            eval_store=ctx.store_root,
            runner=ctx.task_runner,
            inspect_backend=ctx.inspect_backend,
        )
        for spec in ctx.evaluators
    ]
