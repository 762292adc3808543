"""Evaluations as Prefect tasks: one cached task per (weights, benchmark, settings), its examples
mapped in batches.

- ``evaluate-benchmark`` (:func:`evaluate_benchmark`): loads the benchmark's examples, maps
  ``eval-batch`` over batches of ``batch_size`` examples (on the flow's task runner, or Ray/Dask
  through :mod:`prefect_tinker.tasks.runners`), aggregates the sample rows
  (:func:`~prefect_tinker.recipes.evals.summarize`) and writes ``eval_samples`` then
  ``eval_results`` to the eval store. Cached across flow runs under (row identity: run id, step,
  checkpoint; sampler path; renderer; the benchmark's fingerprint -- its settings and the content
  of local data files; the eval store root; the backend; the task's source): re-running over a
  growing training run evaluates only checkpoints it has not seen, and a cached evaluation writes
  and samples nothing. An evaluation that ran emits ``prefect-tinker.eval.completed``
  (:mod:`prefect_tinker.tasks.events`).
- ``eval-batch`` (:func:`eval_batch`): samples and grades one batch in any worker (the sampling
  client, tokenizer and renderer are re-created there from the credentials block and the
  sampler path); cached too, so a retried evaluation redoes only the batches that failed.
- ``evaluate-inspect`` (:func:`evaluate_inspect`): an inspect-ai task against the weights; its
  scores as ``eval_results`` rows. Cached like ``evaluate-benchmark``.
- ``sampler-from-state`` (:func:`sampler_from_state`): sampler weights for a state checkpoint
  (a training client is created from the state and saves them).

Call ``evaluate_benchmark`` / ``evaluate_inspect`` directly in a flow (not ``.submit``): their
batches are then mapped on the flow's task runner, which is what spreads them over workers.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect import task, unmapped
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, Field

from prefect_tinker.recipes.evals.benchmarks import BenchmarkSpec
from prefect_tinker.recipes.evals.examples import Example, load_examples
from prefect_tinker.recipes.evals.runner import evaluate_examples, metrics_dict, summarize
from prefect_tinker.recipes.evals.specs import InspectSpec
from prefect_tinker.tasks.clients import result as watched_result
from prefect_tinker.tasks.clients import sampling_client
from prefect_tinker.tasks.events import emit_eval_completed
from prefect_tinker.tasks.limits import RateLimitedSampler, sampling_slot
from prefect_tinker.tasks.policies import RETRY_OPTIONS, cached_options
from prefect_tinker.tasks.runners import TaskRunnerFields, map_task

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = [
    "EvalTarget",
    "eval_batch",
    "evaluate_benchmark",
    "evaluate_inspect",
    "renderer_for",
    "sampler_from_state",
]

#: ``interval`` in ``config_json``: how ``accuracy_ci95_low/high`` were computed.
INTERVAL = "wilson score 95%, examples as units"


class EvalTarget(BaseModel):
    """The weights one evaluation runs on, and the identity of its rows.

    Attributes:
        run_id: ``eval_results.run_id`` (the training run of a checkpoint; the eval run's name for a
            base model or a path no training run recorded).
        step: optimizer steps of the weights (None for a base model).
        checkpoint: ``eval_results.checkpoint``: the ``tinker://`` sampler path or the base model name.
        sampler: what the sampling client is made from: the path, or ``base:<model>``.
        renderer: the resolved renderer name.
        label: a short name for task runs and artifacts (``<run>@<step>`` or the model).
    """

    run_id: str
    step: int | None = None
    checkpoint: str
    sampler: str
    renderer: str
    label: str = Field(default="", exclude=True)

    def identity(self) -> dict[str, Any]:
        """The fields that decide the rows (everything but the label)."""
        return self.model_dump(mode="json")


def _digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


_renderers: dict[tuple[str, str, str], Any] = {}
_renderers_lock = threading.Lock()


def renderer_for(credentials: TinkerCredentials, sampler: str, name: str) -> Any:
    """The renderer ``name`` (``auto`` resolved from the tokenizer) for the tokenizer of the
    sampling client of ``sampler``; cached per process.

    Raises:
        OSError: no tokenizer loads; RendererError: an unknown renderer name.
    """
    key = (credentials.backend_identity(), sampler, name)
    with _renderers_lock:
        if key in _renderers:
            return _renderers[key]
    from prefect_tinker.recipes.evals.sampler_tokenizer import sampler_tokenizer
    from prefect_tinker.recipes.renderers import get_renderer

    client = sampling_client(credentials, sampler).client
    renderer = get_renderer(name, sampler_tokenizer(credentials.get_client(), client))
    with _renderers_lock:
        _renderers[key] = renderer
    return renderer


def _batch_key(context: Any, params: dict[str, Any]) -> str:
    return _digest(
        {
            "target": params["target"].identity(),
            "spec": params["spec"].fingerprint(),
            "examples": [ex.id for ex in params["examples"]],
            "where": params["credentials"].backend_identity(),
        }
    )


@task(
    name="eval-batch",
    task_run_name="eval-{spec.name}-{target.label}-batch-{batch_index}",
    **cached_options(_batch_key),
)
def eval_batch(
    credentials: TinkerCredentials,
    target: EvalTarget,
    spec: BenchmarkSpec,
    examples: list[Example],
    batch_index: int = 0,
) -> list[dict[str, Any]]:
    """Sample and grade ``examples`` on ``target``; returns their ``eval_samples`` rows
    (examples x ``spec.num_samples``, see :func:`~prefect_tinker.recipes.evals.evaluate_examples`).

    Raises:
        RuntimeError: every example of the batch errored (a broken backend never reads as 0%).
    """
    # the SDK's own client: its futures honour the per-example timeout (``spec.timeout_s``); each request
    # takes a slot of the backend's sampling rate limit, the batch a slot of its sampling limit (if they exist)
    client = RateLimitedSampler(sampling_client(credentials, target.sampler).client, credentials)
    renderer = renderer_for(credentials, target.sampler, target.renderer)
    with sampling_slot(credentials, f"eval {spec.name} on {target.label or target.checkpoint}"):
        return evaluate_examples(
            client, renderer, spec, examples, run_id=target.run_id, step=target.step, checkpoint=target.checkpoint
        )


def _eval_key(context: Any, params: dict[str, Any]) -> str:
    return _digest(
        {
            "target": params["target"].identity(),
            "spec": params["spec"].fingerprint(),
            "store": str(params["eval_store"]),
            "where": params["credentials"].backend_identity(),
        }
    )


def _eval_store(root: str) -> Any:
    from tinker_blocks.stores import EvalStore

    return EvalStore(root=str(root))


def _outcome(
    target: EvalTarget,
    name: str,
    results: list[dict[str, Any]],
    n: int,
    example_ids: list[str] | None = None,
    num_samples: int | None = None,
) -> dict[str, Any]:
    return {
        "run_id": target.run_id,
        "step": target.step,
        "checkpoint": target.checkpoint,
        "eval_name": name,
        "label": target.label,
        "metrics": metrics_dict(results),
        "num_examples": n,
        "example_ids": example_ids,
        "num_samples": num_samples,
    }


@task(
    name="evaluate-benchmark",
    task_run_name="eval-{spec.name}-{target.label}",
    **cached_options(_eval_key),
)
def evaluate_benchmark(
    credentials: TinkerCredentials,
    target: EvalTarget,
    spec: BenchmarkSpec,
    eval_store: str,
    runner: TaskRunnerFields | None = None,
    batch_size: int = 16,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Evaluate ``spec`` on ``target``; write its rows to the eval store at ``eval_store``.

    Args:
        runner: task-runner settings (:class:`~prefect_tinker.tasks.runners.TaskRunnerFields`) for
            the batches; None: the flow's own runner. Not part of the cache key (results do not
            depend on it).
        batch_size: examples per ``eval-batch`` task (not part of the cache key either).
        config: extra fields for ``config_json`` (e.g. the eval run's name).

    Returns:
        ``{"run_id", "step", "checkpoint", "eval_name", "label", "metrics": {metric: value},
        "num_examples", "example_ids", "num_samples"}``: the ids of the examples this evaluation
        graded and its completions per example (what picks its rows out of ``eval_samples``, where
        other evaluations of the same weights may have written theirs).

    Raises:
        FileNotFoundError / ValueError: from loading the examples; RuntimeError: every example of
        a batch errored.
    """
    t0 = time.perf_counter()
    examples = load_examples(spec)
    batches = [examples[i : i + batch_size] for i in range(0, len(examples), max(1, batch_size))]
    futures = map_task(
        runner, eval_batch, unmapped(credentials), unmapped(target), unmapped(spec), batches, list(range(len(batches)))
    )
    samples = [row for fut in futures for row in fut.result()]
    body = {
        "benchmark": spec.model_dump(mode="json"),
        "fingerprint": spec.fingerprint(),
        "renderer": target.renderer,
        "sampler": target.sampler,
        "interval": INTERVAL,
        "batches": len(batches),
        **(config or {}),
    }
    results = summarize(
        spec,
        samples,
        run_id=target.run_id,
        step=target.step,
        checkpoint=target.checkpoint,
        seconds=time.perf_counter() - t0,
        config=body,
    )
    store = _eval_store(eval_store)
    store.write_rows("eval_samples", samples)  # the samples first: a result row means its samples exist
    store.write_rows("eval_results", results)
    outcome = _outcome(target, spec.name, results, len(examples), [str(ex.id) for ex in examples], spec.num_samples)
    _completed(target, outcome, config)
    return outcome


def _completed(target: EvalTarget, outcome: dict[str, Any], config: dict[str, Any] | None) -> None:
    """The ``prefect-tinker.eval.completed`` event of an evaluation (``config``'s ``line``,
    ``eval_run``, ``store`` and ``backend``, when given, go with it)."""
    extra = config or {}
    emit_eval_completed(
        checkpoint=target.checkpoint,
        benchmark=outcome["eval_name"],
        run_id=target.run_id,
        step=target.step,
        metrics=outcome["metrics"],
        num_examples=outcome["num_examples"],
        line=extra.get("line"),
        eval_run=extra.get("eval_run"),
        store=extra.get("store"),
        backend=extra.get("backend"),
    )


def _inspect_key(context: Any, params: dict[str, Any]) -> str:
    return _digest(
        {
            "target": params["target"].identity(),
            "spec": params["spec"].fingerprint(),
            "store": str(params["eval_store"]),
            "backend": params.get("backend_args"),
            "where": params["credentials"].backend_identity(),
        }
    )


def default_inspect_log_dir() -> str:
    """``$PREFECT_TINKER_HOME/inspect-logs`` (default ``~/.prefect-tinker/inspect-logs``)."""
    home = os.environ.get("PREFECT_TINKER_HOME") or str(Path.home() / ".prefect-tinker")
    return str(Path(home).expanduser() / "inspect-logs")


@task(
    name="evaluate-inspect",
    task_run_name="inspect-{spec.name}-{target.label}",
    **cached_options(_inspect_key),
)
def evaluate_inspect(
    credentials: TinkerCredentials,
    target: EvalTarget,
    spec: InspectSpec,
    eval_store: str,
    backend_args: dict[str, Any] | None = None,
    log_dir: str | None = None,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run the inspect-ai task of ``spec`` on ``target`` (in this process, through
    :func:`~prefect_tinker.inspect_provider.run_inspect_task`); write one ``eval_results`` row per
    ``<scorer>/<metric>`` (``num_samples`` = samples scored), plus ``accuracy`` when exactly one
    scorer reports an accuracy. No ``eval_samples`` rows: the samples are in inspect's log
    (``log_dir``, default :func:`default_inspect_log_dir`).

    Raises:
        ImportError: inspect-ai is not installed; RuntimeError: the inspect evaluation failed.
    """
    from prefect_tinker.inspect_provider import run_inspect_task

    t0 = time.perf_counter()
    model = target.checkpoint if target.sampler.startswith("base:") else target.sampler
    args = {**(backend_args or {}), **spec.model_args, "renderer": target.renderer}
    scores = run_inspect_task(
        spec.task,
        model,
        model_args=args,
        task_args=spec.task_args,
        limit=spec.limit,
        log_dir=log_dir or default_inspect_log_dir(),
        **spec.eval_kwargs(),
    )
    n = int(scores.pop("samples", 0))
    accuracies = [v for k, v in scores.items() if k.endswith("/accuracy")]
    if len(accuracies) == 1:
        scores["accuracy"] = accuracies[0]
    scores["seconds"] = time.perf_counter() - t0
    body = json.dumps(
        {
            "inspect": spec.model_dump(mode="json"),
            "fingerprint": spec.fingerprint(),
            "renderer": target.renderer,
            "sampler": target.sampler,
            **(config or {}),
        },
        sort_keys=True,
        default=str,
    )
    results = [
        {
            "run_id": target.run_id,
            "step": target.step,
            "checkpoint": target.checkpoint,
            "eval_name": spec.name,
            "metric": m,
            "value": float(v),
            "num_samples": n,
            "config_json": body,
        }
        for m, v in scores.items()
    ]
    _eval_store(eval_store).write_rows("eval_results", results)
    outcome = _outcome(target, spec.name, results, n)
    _completed(target, outcome, config)
    return outcome


@task(name="sampler-from-state", task_run_name="sampler-from-{name}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def sampler_from_state(credentials: TinkerCredentials, state_path: str, name: str) -> str:
    """Sampler weights of the state checkpoint ``state_path`` (``tinker://.../weights/...``): a
    training client is created from the state and saves them as ``name``; returns their
    ``tinker://.../sampler_weights/<name>`` path.

    Raises:
        tinker errors: the state does not exist on this backend (a user error, not retried).
    """
    service = credentials.get_client()
    client = watched_result(
        credentials, service.create_training_client_from_state(state_path), f"a training client from {state_path}"
    )
    return watched_result(credentials, client.save_weights_for_sampler(name), f"sampler weights of {state_path}").path
