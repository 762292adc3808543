"""inspect-ai over Tinker: the ``tinker`` model provider and :func:`run_inspect_task`.

Install the extra (``pip install 'prefect-tinker[inspect]'``); then any inspect-ai task runs
against a Tinker sampling client, by default on the embedded local server::

    inspect eval task.py --model tinker/tiny -M renderer=chatml
    inspect eval task.py --model tinker/tinker://<run>/sampler_weights/step-000100
    inspect eval task.py --model tinker/Qwen/Qwen3-8B --model-base-url https://... (TINKER_API_KEY set)

Model args and the generation config mapping: :mod:`prefect_tinker.inspect_provider.model_api`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["run_inspect_task"]


def _task_spec(task: str | Path) -> str:
    """inspect-ai globs task files from the working directory and (Python 3.11's ``Path.glob``)
    rejects absolute patterns: an absolute file path is given relative to the working directory."""
    text = str(task)
    path, sep, name = text.partition("@")
    if Path(path).is_absolute() and Path(path).exists() and not sep:
        return os.path.relpath(path)
    return text


def run_inspect_task(
    task: str | Path,
    model: str,
    *,
    model_args: dict[str, Any] | None = None,
    task_args: dict[str, Any] | None = None,
    limit: int | None = None,
    log_dir: str | Path | None = None,
    **eval_kwargs: Any,
) -> dict[str, float]:
    """Run an inspect-ai task in this process and return its scores.

    Args:
        task: a task file (``task.py``, ``task.py@name``) or a registered task name.
        model: a Tinker model: base model name or ``tinker://`` sampler path (``tinker/`` is
            prepended when missing).
        model_args: provider args (``renderer``, ``local_root``, ``credentials_block``, and
            ``base_url``, passed on as inspect's ``model_base_url``).
        task_args / limit / log_dir: as for ``inspect_ai.eval``; ``eval_kwargs``: other
            ``inspect_ai.eval`` arguments (``temperature``, ``max_tokens``, ``seed``, ``epochs`` ...).

    Returns:
        ``{"<scorer>/<metric>": value}`` over the task's scorers (``"<task>/<scorer>/<metric>"``
        when the file holds several tasks), plus ``"samples"``: the number of samples scored.

    Raises:
        ImportError: inspect-ai is not installed. RuntimeError: the evaluation did not succeed
        (the message carries inspect's error).
    """
    try:
        from inspect_ai import eval as inspect_eval
    except ImportError as exc:  # pragma: no cover - depends on the extra
        raise ImportError("run_inspect_task needs inspect-ai: pip install 'prefect-tinker[inspect]'") from exc
    qualified = model if model.startswith("tinker/") else f"tinker/{model}"
    model_args = dict(model_args or {})
    if model_args.get("base_url"):  # inspect's own argument: a model arg of that name collides with it
        eval_kwargs["model_base_url"] = model_args.pop("base_url")
    logs = inspect_eval(
        _task_spec(task),
        model=qualified,
        model_args=model_args,
        task_args=task_args or {},
        limit=limit,
        log_dir=str(log_dir) if log_dir else None,
        display="none",
        **eval_kwargs,
    )
    scores: dict[str, float] = {}
    for log in logs:
        if log.status != "success":
            error = log.error.message if log.error else log.status
            raise RuntimeError(f"inspect task {log.eval.task!r} on {qualified} did not succeed: {error}")
        prefix = f"{log.eval.task}/" if len(logs) > 1 else ""
        for score in log.results.scores if log.results else []:
            for name, metric in score.metrics.items():
                scores[f"{prefix}{score.name}/{name}"] = float(metric.value)
        scores[f"{prefix}samples"] = float(log.results.completed_samples if log.results else 0)
    return scores
