"""Evaluation as one Prefect flow: benchmarks x checkpoints, results in the eval store.

``prefect-tinker run eval model=M benchmark=NAME ...`` (config: :class:`~prefect_tinker.flows.eval_config.EvalConfig`).

1. Credentials of the backend and the eval store checked writable (``check-store``) -- the
   parts of a run session that apply; the rest (training client, lease, ``runs`` row, resume
   point) belongs to training runs, which this is not.
2. The weights (:func:`resolve_targets`): a base model; a ``tinker://`` path (its run, step and
   renderer from the training store when a run recorded it); ``alias:LINE@ALIAS`` = what the alias
   holds now (a path or a base model); ``run:<id>`` = every sampler
   checkpoint of that run in the training store, in step order -- a state checkpoint without
   sampler weights at its step gets them first (``sampler-from-state``), recorded in the store.
3. For every (weights, benchmark): ``evaluate-benchmark`` (or ``evaluate-inspect``), one task
   cached across flow runs by (weights, benchmark fingerprint, renderer, eval store), its
   examples mapped in ``eval-batch`` tasks of ``batch_size`` examples on the configured task
   runner (``task_runner=thread|ray|dask``). Re-running over a growing run evaluates only the new
   checkpoints; a cached evaluation writes and samples nothing.
4. Artifacts: checkpoints x benchmarks table, accuracy against training step (``report-eval``).

A failed evaluation does not stop the others; the flow fails at the end, naming them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from prefect import get_run_logger

from prefect_tinker.flows.config import resolve_credentials, weights_ref
from prefect_tinker.flows.eval_config import EvalConfig
from prefect_tinker.flows.interrupts import recipe_flow
from prefect_tinker.recipes.evals.specs import InspectSpec
from prefect_tinker.tasks.eval_report import report_eval
from prefect_tinker.tasks.eval_tasks import (
    EvalTarget,
    evaluate_benchmark,
    evaluate_inspect,
    sampler_from_state,
)
from prefect_tinker.tasks.records import check_store, record_checkpoint

if TYPE_CHECKING:
    from tinker_blocks.credentials import TinkerCredentials

__all__ = ["EvalConfig", "eval_flow", "resolve_targets"]


def _resolve_renderer(config: EvalConfig, credentials: TinkerCredentials, sampler: str, recorded: str | None) -> str:
    if config.renderer != "auto":
        return config.renderer
    if recorded:
        return recorded
    from prefect_tinker.recipes.evals.sampler_tokenizer import sampler_tokenizer
    from prefect_tinker.recipes.renderers import resolve_renderer_name
    from prefect_tinker.tasks.clients import sampling_client

    client = sampling_client(credentials, sampler).client
    return resolve_renderer_name("auto", sampler_tokenizer(credentials.get_client(), client))


def _training_store(config: EvalConfig) -> Any:
    from tinker_blocks.stores import TrainingStore

    return TrainingStore(root=config.store)


def _run_targets(config: EvalConfig, credentials: TinkerCredentials, run_id: str) -> list[EvalTarget]:
    rows = _training_store(config).query(
        "SELECT step, kind, name, path, renderer FROM checkpoints WHERE run_id = ? ORDER BY step, time", [run_id]
    )
    if not rows:
        raise ValueError(f"model=run:{run_id}: the training store {config.store} has no checkpoint of run {run_id!r}")
    samplers = {int(r["step"]): r for r in rows if r["kind"] == "sampler"}
    states = {int(r["step"]): r for r in rows if r["kind"] == "state"}
    for step, st in sorted(states.items()):
        if step not in samplers:  # a state only: save its sampler weights and record them with the run
            path = sampler_from_state(credentials, st["path"], st["name"])
            record_checkpoint(config.store, run_id, step, path, "sampler", st["renderer"])
            samplers[step] = {**st, "kind": "sampler", "path": path}
    return [
        EvalTarget(
            run_id=run_id,
            step=step,
            checkpoint=r["path"],
            sampler=r["path"],
            label=f"{run_id}@{step}",
            renderer=_resolve_renderer(config, credentials, r["path"], r["renderer"]),
        )
        for step, r in sorted(samplers.items())
    ]


def _path_target(config: EvalConfig, credentials: TinkerCredentials, path: str) -> EvalTarget:
    """A ``tinker://`` path through the one resolver (its run, step and renderer from ``checkpoints``;
    a state path's sampler twin when the run saved one): a state path without a twin gets its
    sampler weights saved once and recorded with its run, so the next evaluation finds them."""
    weights = weights_ref(config.store, path, "model")
    sampler = weights.checkpoint
    if "/weights/" in sampler:  # a state path and no sampler weights at its step yet
        sampler = sampler_from_state(credentials, sampler, sampler.rstrip("/").rsplit("/", 1)[-1])
        if weights.run_id is not None and weights.step is not None:
            record_checkpoint(config.store, weights.run_id, weights.step, sampler, "sampler", weights.renderer)
    known = weights.run_id is not None
    return EvalTarget(
        run_id=weights.run_id if known else config.run_name,
        step=weights.step,
        checkpoint=sampler,
        sampler=sampler,
        label=f"{weights.run_id}@{weights.step}" if known else path.rstrip("/").rsplit("/", 1)[-1],
        renderer=_resolve_renderer(config, credentials, sampler, weights.renderer),
    )


def resolve_targets(config: EvalConfig, credentials: TinkerCredentials) -> list[EvalTarget]:
    """The weights ``config.model`` names, each once, in the order given (a run's checkpoints in
    step order); see the module docstring.

    Raises:
        ValueError: ``run:<id>`` of a run without checkpoints in the training store, an
            ``alias:`` never set.
    """
    out: list[EvalTarget] = []
    for model in config.models():
        if model.startswith("alias:"):  # what the alias holds now: a checkpoint path or a base model
            model = weights_ref(config.store, model, "model").checkpoint
        if model.startswith("run:"):
            out += _run_targets(config, credentials, model[4:])
        elif model.startswith("tinker://"):
            out.append(_path_target(config, credentials, model))
        else:
            out.append(
                EvalTarget(
                    run_id=config.run_name,
                    step=None,
                    checkpoint=model,
                    sampler=f"base:{model}",
                    label=model,
                    renderer=_resolve_renderer(config, credentials, f"base:{model}", None),
                )
            )
    seen, unique = set(), []
    for t in out:
        key = (t.run_id, t.step, t.checkpoint)
        if key not in seen:
            seen.add(key)
            unique.append(t)
    return unique


@recipe_flow("eval", "eval-{config.run_name}")
def eval_flow(config: EvalConfig) -> dict[str, Any]:
    """Evaluate every benchmark of ``config`` on every weights of ``config.model``; returns a
    summary: ``run_name``, ``evaluated`` / ``cached`` counts, ``results`` (run, step, checkpoint,
    eval name, metrics, cached) and the stores.

    Raises:
        RuntimeError: some evaluations failed (after the others ran and the artifacts were posted).
    """
    log = get_run_logger()
    credentials = resolve_credentials(config.backend)
    eval_root = config.eval_root()
    check_store(eval_root)  # wrong credentials / unwritable store: fail before sampling anything
    specs = config.specs()
    targets = resolve_targets(config, credentials)
    log.info(
        "evaluating %d checkpoint(s) x %d benchmark(s): %s",
        len(targets),
        len(specs),
        ", ".join(t.label for t in targets),
    )
    extra = {
        "eval_run": config.run_name,
        **({"line": config.line} if config.line else {}),
        "store": config.store,
        "backend": config.backend.model_dump(mode="json"),
    }
    backend_args = config.backend.inspect_args()
    outcomes, failures, cached = [], [], 0
    for target in targets:
        for spec in specs:
            if isinstance(spec, InspectSpec):
                state = evaluate_inspect(
                    credentials,
                    target,
                    spec,
                    eval_root,
                    backend_args=backend_args,
                    log_dir=config.inspect_log_dir,
                    config=extra,
                    return_state=True,
                )
            else:
                state = evaluate_benchmark(
                    credentials,
                    target,
                    spec,
                    eval_root,
                    runner=config,
                    batch_size=config.batch_size,
                    config=extra,
                    return_state=True,
                )
            try:
                outcome = state.result()
            except Exception as exc:  # one broken evaluation must not hide the others
                failures.append(f"{spec.name} on {target.label}: {type(exc).__name__}: {exc}")
                log.error("evaluation %s on %s failed: %s", spec.name, target.label, exc)
                continue
            is_cached = state.name == "Cached"
            cached += is_cached
            outcomes.append({**outcome, "cached": is_cached})
            log.info(
                "%s on %s: %s%s",
                spec.name,
                target.label,
                outcome["metrics"].get("accuracy"),
                " (cached)" if is_cached else "",
            )
    report = report_eval(cast(str, config.run_name), outcomes, eval_root)  # the validator set it
    if failures:
        raise RuntimeError(f"{len(failures)} evaluation(s) failed: " + "; ".join(failures))
    return {
        "run_name": config.run_name,
        "evaluated": len(outcomes) - cached,
        "cached": cached,
        "results": outcomes,
        "store": config.store,
        "eval_store": eval_root,
        "accuracy_png": report["png"],
    }
