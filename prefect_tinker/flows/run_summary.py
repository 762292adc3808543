"""The summary artifact of a finished run: a Markdown table of the run's fields and summary values,
its checkpoint paths and sample completions, posted under the run's artifact key.

:meth:`~prefect_tinker.flows.session.RunSession.finish` posts it with :func:`post_run_summary`.
"""

from __future__ import annotations

from typing import Any

from prefect.artifacts import create_markdown_artifact

from prefect_tinker.tasks.reporting import artifact_key

__all__ = ["post_run_summary", "run_summary_markdown"]


def run_summary_markdown(
    recipe: str, run_id: str, model: str, renderer: str, store: str, summary: dict[str, Any], fields: dict[str, Any]
) -> str:
    """The artifact's Markdown: ``fields`` (extra table rows) after model and renderer, then ``steps`` and
    every scalar of ``summary`` (not ``run_name``/``renderer``/``store``), the store, ``summary["checkpoints"]``
    and ``summary["samples"]`` (``prompt``/``completion`` dicts; the prompt's last 200 characters)."""
    table = {
        "model": f"`{model}`",
        "renderer": f"`{renderer}`",
        **fields,
        "steps": summary["steps"],
        **{
            k: v
            for k, v in summary.items()
            if isinstance(v, (int, float, str)) and k not in ("run_name", "steps", "renderer", "store")
        },
        "store": f"`{store}`",
    }
    lines = [
        f"# {recipe.upper()} run `{run_id}`",
        "",
        "| field | value |",
        "|---|---|",
        *[f"| {k} | {v} |" for k, v in table.items()],
        "",
        "## Checkpoints",
        "",
        *[f"- `{p}`" for p in summary["checkpoints"]],
    ]
    for s in summary.get("samples") or []:
        lines += ["", f"**prompt**: `{s['prompt'][-200:]!r}`", "", f"**completion**: `{s['completion']!r}`"]
    return "\n".join(lines)


def post_run_summary(
    recipe: str, run_id: str, model: str, renderer: str, store: str, summary: dict[str, Any], fields: dict[str, Any]
) -> None:
    """Post :func:`run_summary_markdown` as the run's summary artifact (key: ``artifact_key(recipe, run_id)``)."""
    create_markdown_artifact(
        run_summary_markdown(recipe, run_id, model, renderer, store, summary, fields),
        key=artifact_key(recipe, run_id),
        description=f"{recipe.upper()} run summary",
    )
