"""Whether a run may continue where its stored state left it: the resume-compatibility checks.

:class:`~prefect_tinker.flows.session.RunSession` calls these when it opens a run:

- :func:`check_same_recipe`: a run name already taken by another recipe's run is refused in one
  line naming that recipe (whatever the checkpoints);
- :func:`check_resumed_config`: before the training client is opened, the stored config
  (``runs.config_json``) against the new one, field by field over the config's
  :meth:`~prefect_tinker.flows.config.RecipeConfig.resume_fields` (marked ``RESUME``)
  (batch size, seed, loss, ...): a change would silently alter the data position or the objective;
- :func:`check_resumed_meta`: once the renderer is resolved and the data fingerprinted, the stored
  ``runs.meta_json`` against this run's: another resolved renderer or other dataset content;
- :func:`check_start_renderer`: a new run started from ``load_checkpoint_path`` must render as
  that checkpoint was trained (its ``checkpoints.renderer`` row);
- :func:`warn_damaged_parts`: a resumed run's store parts that cannot be read are named in the log.

Each refusal is a :class:`ResumeConfigError` naming the field, both values and the override: the
field listed in the config's ``allow_config_change`` lets the run continue anyway.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger

from prefect_tinker.flows.config import RecipeConfig

if TYPE_CHECKING:
    from tinker_blocks.stores import TrainingStore

__all__ = [
    "ResumeConfigError",
    "check_resumed_config",
    "check_resumed_meta",
    "check_same_recipe",
    "check_start_renderer",
    "warn_damaged_parts",
]


class ResumeConfigError(ValueError):
    """A resumed run's config differs from the stored one in a field that changes the data
    position or the objective (the message names the field, both values and the override)."""


def _refuse(run_id: str, field: str, was: Any, now: Any, why: str) -> None:
    raise ResumeConfigError(
        f"run {run_id!r} was started with {field}={was!r}; this config has {field}={now!r}: "
        f"resuming would {why}. Use a new run_name, or allow it with allow_config_change=[{field}]"
    )


def _article(recipe: str) -> str:
    """``a`` or ``an`` before a recipe name, read as it is said (``an sft``, ``an rl``, ``a dpo``)."""
    spelled = recipe in ("sft", "rl", "rlhf")  # said letter by letter: "ess", "ar"
    return "an" if spelled or recipe[:1] in "aeiou" else "a"


def check_same_recipe(run_id: str, stored_meta: dict[str, Any], recipe: str) -> None:
    """A run name is one recipe's: the stored run ``run_id`` (its ``meta_json``, parsed; no recipe
    recorded: no check) must be a ``recipe`` run.

    Raises:
        ResumeConfigError: ``intr2 is an sft run; give this dpo run another run_name``.
    """
    was = stored_meta.get("recipe")
    if was and recipe and was != recipe:
        raise ResumeConfigError(f"{run_id} is {_article(was)} {was} run; give this {recipe} run another run_name")


def check_resumed_config(config: RecipeConfig, run_id: str, stored: dict[str, Any]) -> None:
    """Compare the stored config of run ``run_id`` (its ``config_json``, parsed) with ``config``.

    Raises:
        ResumeConfigError: a field of ``config.resume_fields()`` (the fields marked
            :data:`~prefect_tinker.recipes.resume_marker.RESUME`) present in both differs and is not
            in ``config.allow_config_change``.
    """
    new = json.loads(config.model_dump_json())
    for field in config.resume_fields():
        if field in stored and field in new and stored[field] != new[field] and field not in config.allow_config_change:
            _refuse(run_id, field, stored[field], new[field], "change the data position or the objective")


def check_resumed_meta(config: RecipeConfig, run_id: str, stored: dict[str, Any], meta: dict[str, Any]) -> None:
    """Compare what the run resolved before (``stored``: its ``meta_json``, parsed) with ``meta``:
    the resolved ``renderer`` and the ``dataset_fingerprint`` (content hashes, shown by their first
    19 characters); a value missing on either side is not compared.

    Raises:
        ResumeConfigError: one differs and its field (``renderer`` or ``dataset``) is not in
            ``config.allow_config_change``.
    """
    for field, key, why in (
        ("renderer", "renderer", "train on tokens rendered another way"),
        ("dataset", "dataset_fingerprint", "train on other data at the same position"),
    ):
        was, now = stored.get(key), meta.get(key)
        if was is not None and now is not None and was != now and field not in config.allow_config_change:
            _refuse(
                run_id,
                field,
                was if field == "renderer" else f"content {was[:19]}",
                now if field == "renderer" else f"content {now[:19]}",
                why,
            )


def check_start_renderer(config: RecipeConfig, store: TrainingStore, path: str, renderer: str) -> None:
    """A run started from checkpoint ``path`` renders with ``renderer``: the renderer recorded with
    that checkpoint in ``store`` (its latest ``checkpoints`` row with one; none recorded: no check)
    must be the same.

    Raises:
        ResumeConfigError: they differ and ``renderer`` is not in ``config.allow_config_change``.
    """
    rows = store.query(
        "SELECT renderer FROM checkpoints WHERE path = ? AND renderer IS NOT NULL ORDER BY time DESC LIMIT 1",
        [path],
    )
    if rows and rows[0]["renderer"] != renderer and "renderer" not in config.allow_config_change:
        raise ResumeConfigError(
            f"load_checkpoint_path {path!r} was trained with renderer {rows[0]['renderer']!r}, but this run "
            f"renders with {renderer!r}: set renderer={rows[0]['renderer']!r}, or allow it with "
            "allow_config_change=[renderer]"
        )


def warn_damaged_parts(store: TrainingStore, run_id: str) -> None:
    """Log a warning for each unreadable store part of run ``run_id``
    (:func:`tinker_blocks.store_repair.scan_run`): the run resumes from the last checkpoint that can
    still be read."""
    from tinker_blocks.store_repair import scan_run

    for p in scan_run(store, run_id):
        get_run_logger().warning(
            "run %s: unreadable part %s (%s); resuming from the last checkpoint that can "
            "still be read (prefect-tinker store repair moves it aside)",
            run_id,
            p.path,
            p.reason,
        )
