"""Prefect events of prefect-tinker: what runs, evaluations and the model registry did, linked by
their resources.

- ``prefect-tinker.checkpoint.saved``: resource the ``tinker://`` URI; related: the run, the
  recipe, the model line, the state the sampler weights were saved from;
- ``prefect-tinker.eval.completed``: resource ``prefect-tinker.eval.<benchmark>/<checkpoint>``;
  related: the checkpoint, the run, the benchmark, the model line;
- ``prefect-tinker.run.finished``: resource ``prefect-tinker.run.<run_id>``; related: the recipe,
  the model line, the run's last state and sampler checkpoints;
- ``prefect-tinker.model.promoted`` / ``prefect-tinker.model.rolled-back``: resource
  ``prefect-tinker.model-line.<line>``; related: the checkpoint the alias holds now, the one it held
  before (role ``previous-checkpoint``), the run the weights come from.

A checkpoint's resource id is its ``tinker://`` URI, the key of its Prefect asset, so its
materialization events and these events name the same resource; a base model is
``prefect-tinker.base-model.<name>``. Labels (strings) repeat what an automation may match or
template on: ``prefect-tinker.run``, ``.step``, ``.recipe``, ``.kind``, ``.line``, ``.alias``,
``.checkpoint``, ``.benchmark``, ``.score``, ``.status``. Inside a flow run Prefect adds the flow
run, its flow, deployment and tags as related resources (so automations can match on tags).
Numbers are in the payload too.

Emitting never fails a run: without a Prefect API (or with events off) nothing is sent.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prefect.events import emit_event

__all__ = [
    "CHECKPOINT_SAVED",
    "EVAL_COMPLETED",
    "MODEL_PROMOTED",
    "MODEL_ROLLED_BACK",
    "RUN_FINISHED",
    "checkpoint_resource_id",
    "emit_checkpoint_saved",
    "emit_eval_completed",
    "emit_model_changed",
    "emit_run_finished",
    "line_resource_id",
    "run_resource_id",
]

CHECKPOINT_SAVED = "prefect-tinker.checkpoint.saved"
EVAL_COMPLETED = "prefect-tinker.eval.completed"
RUN_FINISHED = "prefect-tinker.run.finished"
MODEL_PROMOTED = "prefect-tinker.model.promoted"
MODEL_ROLLED_BACK = "prefect-tinker.model.rolled-back"


def checkpoint_resource_id(checkpoint: str) -> str:
    """The resource id of weights: the ``tinker://`` URI, or ``prefect-tinker.base-model.<name>``."""
    return checkpoint if checkpoint.startswith("tinker://") else f"prefect-tinker.base-model.{checkpoint}"


def run_resource_id(run_id: str) -> str:
    """``prefect-tinker.run.<run_id>``."""
    return f"prefect-tinker.run.{run_id}"


def line_resource_id(line: str) -> str:
    """``prefect-tinker.model-line.<line>``."""
    return f"prefect-tinker.model-line.{line}"


def _labels(**values: Any) -> dict[str, str]:
    return {f"prefect-tinker.{k}": str(v) for k, v in values.items() if v is not None}


def _related(pairs: Iterable[tuple[str | None, str, str | None]]) -> list[dict[str, str]]:
    """``(resource id, role, name)`` triples as related resources (None ids left out, each once)."""
    out: list[dict[str, str]] = []
    seen = set()
    for rid, role, name in pairs:
        if rid is None or (rid, role) in seen:
            continue
        seen.add((rid, role))
        res = {"prefect.resource.id": rid, "prefect.resource.role": role}
        if name:
            res["prefect.resource.name"] = name
        out.append(res)
    return out


def _line_related(line: str | None) -> tuple[str | None, str, str | None]:
    return (line_resource_id(line) if line else None, "model-line", line)


def emit_checkpoint_saved(
    path: str,
    *,
    kind: str,
    run_id: str,
    step: int,
    recipe: str,
    line: str | None = None,
    state_path: str | None = None,
    renderer: str | None = None,
    store: str | None = None,
    backend: Mapping[str, Any] | None = None,
) -> Any:
    """``prefect-tinker.checkpoint.saved`` for the checkpoint ``path`` (``kind`` ``state`` or
    ``sampler``) of run ``run_id`` after ``step`` optimizer steps; ``store`` (its training store)
    and ``backend`` (the run's backend config, no secrets) in the payload tell an automation where
    to find it. Returns the event (None when events are off)."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return emit_event(
        CHECKPOINT_SAVED,
        resource={
            "prefect.resource.id": path,
            "prefect.resource.name": name,
            **_labels(kind=kind, run=run_id, step=step, recipe=recipe, line=line),
        },
        related=_related(
            [
                (run_resource_id(run_id), "run", run_id),
                (f"prefect-tinker.recipe.{recipe}", "recipe", recipe),
                _line_related(line),
                (state_path if state_path != path else None, "state", None),
            ]
        ),
        payload={
            "uri": path,
            "kind": kind,
            "run": run_id,
            "step": int(step),
            "recipe": recipe,
            "line": line,
            "renderer": renderer,
            "store": store,
            "backend": dict(backend) if backend else None,
        },
    )


def emit_eval_completed(
    *,
    checkpoint: str,
    benchmark: str,
    run_id: str | None,
    step: int | None,
    metrics: Mapping[str, float],
    num_examples: int,
    line: str | None = None,
    eval_run: str | None = None,
    store: str | None = None,
    backend: Mapping[str, Any] | None = None,
) -> Any:
    """``prefect-tinker.eval.completed`` for ``benchmark`` on ``checkpoint``: the score
    (``accuracy``) and its 95% interval (``accuracy_ci95_low`` / ``_high``) as labels and payload,
    every metric in the payload (and, when known, the training ``store`` and the ``backend``)."""
    score = metrics.get("accuracy")
    low, high = metrics.get("accuracy_ci95_low"), metrics.get("accuracy_ci95_high")
    return emit_event(
        EVAL_COMPLETED,
        resource={
            "prefect.resource.id": f"prefect-tinker.eval.{benchmark}/{checkpoint}",
            "prefect.resource.name": f"{benchmark} on {checkpoint.rstrip('/').rsplit('/', 1)[-1]}",
            **_labels(
                checkpoint=checkpoint,
                benchmark=benchmark,
                run=run_id,
                step=step,
                line=line,
                score=None if score is None else f"{score:.6g}",
            ),
        },
        related=_related(
            [
                (checkpoint_resource_id(checkpoint), "checkpoint", None),
                (run_resource_id(run_id) if run_id else None, "run", run_id),
                (f"prefect-tinker.benchmark.{benchmark}", "benchmark", benchmark),
                _line_related(line),
            ]
        ),
        payload={
            "checkpoint": checkpoint,
            "benchmark": benchmark,
            "run": run_id,
            "step": step,
            "score": score,
            "interval": [low, high] if low is not None and high is not None else None,
            "num_examples": int(num_examples),
            "metrics": dict(metrics),
            "eval_run": eval_run,
            "line": line,
            "store": store,
            "backend": dict(backend) if backend else None,
        },
    )


def emit_run_finished(
    run_id: str,
    *,
    recipe: str,
    status: str,
    steps: int,
    checkpoints: list[str],
    line: str | None = None,
    error: str | None = None,
    store: str | None = None,
) -> Any:
    """``prefect-tinker.run.finished`` (``status`` ``completed`` or ``failed``), its last state
    and sampler checkpoints related."""
    last = {}
    for p in checkpoints:  # in step order: keep the newest of each kind
        last["sampler" if "/sampler_weights/" in p else "state"] = p
    return emit_event(
        RUN_FINISHED,
        resource={
            "prefect.resource.id": run_resource_id(run_id),
            "prefect.resource.name": run_id,
            **_labels(run=run_id, recipe=recipe, status=status, steps=steps, line=line),
        },
        related=_related(
            [
                (f"prefect-tinker.recipe.{recipe}", "recipe", recipe),
                _line_related(line),
                *((p, "checkpoint", kind) for kind, p in sorted(last.items())),
            ]
        ),
        payload={
            "run": run_id,
            "recipe": recipe,
            "status": status,
            "steps": int(steps),
            "checkpoints": checkpoints,
            "error": error,
            "store": store,
        },
    )


def emit_model_changed(
    action: str,
    *,
    line: str,
    alias: str,
    checkpoint: str,
    previous: str | None,
    run_id: str | None = None,
    decision: Mapping[str, Any] | None = None,
) -> Any:
    """``prefect-tinker.model.promoted`` (``action`` ``promote`` or ``set``) or
    ``prefect-tinker.model.rolled-back`` (``rollback``): alias ``alias`` of ``line`` now holds
    ``checkpoint`` (before: ``previous``).

    Raises:
        ValueError: an unknown ``action``.
    """
    if action not in ("promote", "set", "rollback"):
        raise ValueError(f"action must be promote, set or rollback, got {action!r}")
    return emit_event(
        MODEL_ROLLED_BACK if action == "rollback" else MODEL_PROMOTED,
        resource={
            "prefect.resource.id": line_resource_id(line),
            "prefect.resource.name": f"{line}@{alias}",
            **_labels(line=line, alias=alias, checkpoint=checkpoint, action=action),
        },
        related=_related(
            [
                (checkpoint_resource_id(checkpoint), "checkpoint", None),
                (checkpoint_resource_id(previous) if previous else None, "previous-checkpoint", None),
                (run_resource_id(run_id) if run_id else None, "run", run_id),
            ]
        ),
        payload={
            "line": line,
            "alias": alias,
            "action": action,
            "checkpoint": checkpoint,
            "previous": previous,
            "run": run_id,
            "decision": dict(decision or {}),
        },
    )
