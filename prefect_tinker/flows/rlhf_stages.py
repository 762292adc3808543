"""The stages of the RLHF flow: run one as a subflow unless the training store says it is done,
read what it produced, and the summary artifact over all of them.

A stage is skipped when its run (``<run_name>-<stage>``) is ``completed`` in the training store
with exactly this stage config (its ``config_json``) and the same data (the dataset fingerprint
recorded in its ``meta_json``, recomputed now with the renderer it resolved): nothing of it is
redone, its rows are untouched. Otherwise the stage's flow runs, and the run session resumes it
after its last checkpoint when it has one (a crashed or killed stage, or a longer ``max_steps``).

A stage whose run already has a state checkpoint but was started from other upstream weights (a
new SFT state or reward model, because an earlier stage was redone) cannot resume: it would go on
training the old policy. :func:`check_upstream` refuses that with a message naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import create_markdown_artifact

from prefect_tinker.tasks.reporting import artifact_key

__all__ = ["StageResult", "check_upstream", "run_stage", "stage_summary_artifact"]

#: Final metrics of each stage shown in the summary (name -> label).
STAGE_METRICS = {
    "sft": ("train/loss", "test/nll"),
    "rm": ("train/loss", "eval/rm_accuracy", "eval/rm_accuracy_stderr", "eval/rm_brier"),
    "rl": ("env/win_minus_loss", "env/format_rate", "eval/win_rate", "eval/win_rate_stderr"),
}


@dataclass
class StageResult:
    """What one stage produced (read back from the training store).

    Attributes:
        stage: ``sft``, ``rm`` or ``rl``; run_name: its run id; ran: False when skipped.
        steps: the step of its last state checkpoint; state_path: that checkpoint;
        sampler_path: sampler weights saved at that step (None when the run saved none);
        metrics: ``{name: (value at the first step, value at the last step)}`` of
        :data:`STAGE_METRICS`.
    """

    stage: str
    run_name: str
    ran: bool
    steps: int
    state_path: str
    sampler_path: str | None
    metrics: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_name": self.run_name,
            "status": "ran" if self.ran else "skipped",
            "steps": self.steps,
            "state_path": self.state_path,
            "sampler_path": self.sampler_path,
            **{f"first_{k}": v[0] for k, v in self.metrics.items()},
            **{f"last_{k}": v[1] for k, v in self.metrics.items()},
        }


def _store(root: str):
    from tinker_blocks.stores import TrainingStore

    return TrainingStore(root=root)


def _done(store, run_id: str, config: Any, fingerprint: Callable[[str], str]) -> bool:
    """Whether ``run_id`` completed with exactly ``config`` and the same data."""
    row = store.get_run(run_id)
    if not row or row.get("status") != "completed":
        return False
    if json.loads(row.get("config_json") or "{}") != json.loads(config.model_dump_json()):
        return False
    meta = json.loads(row.get("meta_json") or "null") or {}
    was = meta.get("dataset_fingerprint")
    return was is None or (meta.get("renderer") is not None and fingerprint(meta["renderer"]) == was)


def _result(store, stage: str, run_id: str, ran: bool) -> StageResult:
    state = store.last_checkpoint(run_id, "state")
    if state is None:
        raise RuntimeError(f"stage {stage}: run {run_id!r} has no state checkpoint in the training store")
    rows = store.query(
        "SELECT path FROM checkpoints WHERE run_id = ? AND kind = 'sampler' AND step = ? ORDER BY time DESC LIMIT 1",
        [run_id, int(state["step"])],
    )
    metrics = {}
    for name in STAGE_METRICS.get(stage, ()):
        got = store.query(
            "SELECT arg_min(value, step) AS first, arg_max(value, step) AS last FROM metrics "
            "WHERE run_id = ? AND name = ?",
            [run_id, name],
        )
        if got and got[0]["last"] is not None:
            metrics[name] = (got[0]["first"], got[0]["last"])
    return StageResult(
        stage, run_id, ran, int(state["step"]), state["path"], rows[0]["path"] if rows else None, metrics
    )


def run_stage(stage: str, flow: Any, config: Any, fingerprint: Callable[[str], str]) -> StageResult:
    """Run ``flow(config=config)`` as a subflow unless its run completed with this config and
    data (module docstring); return what it produced.

    Args:
        fingerprint: ``renderer -> dataset fingerprint`` of the stage's data as it is now.
    """
    log, store = get_run_logger(), _store(config.store)
    if _done(store, config.run_name, config, fingerprint):
        log.info("stage %s: run %s already completed with this config and data; skipped", stage, config.run_name)
        return _result(store, stage, config.run_name, ran=False)
    log.info("stage %s: running %s", stage, config.run_name)
    flow(config=config)
    return _result(store, stage, config.run_name, ran=True)


def _get(config: dict[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def check_upstream(stage: str, config: Any, fields: tuple[str, ...]) -> None:
    """Refuse to resume a stage's run from its checkpoint when it was started from other upstream
    weights (``fields``: dotted config paths such as ``load_checkpoint_path``).

    Raises:
        ValueError: names the field, the weights it was started from and the new ones.
    """
    store = _store(config.store)
    row = store.get_run(config.run_name)
    if not row or store.last_checkpoint(config.run_name, "state") is None:
        return  # nothing to resume: the run starts from the new weights
    stored, new = json.loads(row.get("config_json") or "{}"), json.loads(config.model_dump_json())
    for f in fields:
        if _get(stored, f) != _get(new, f):
            raise ValueError(
                f"stage {stage}: run {config.run_name!r} was started with {f}={_get(stored, f)!r}, but the earlier "
                f"stages now give {_get(new, f)!r} (an earlier stage was redone); resuming would go on training the "
                "old policy. Use a new run_name for the whole pipeline"
            )


def stage_summary_artifact(run_name: str, results: list[StageResult], extra: dict[str, Any]) -> str:
    """Post the markdown summary over the stages (one table row each); returns its key."""
    lines = [
        f"# RLHF run `{run_name}`",
        "",
        "| stage | run | status | steps | final metrics | weights |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        shown = ", ".join(f"{k} {v[1]:.4g}" for k, v in r.metrics.items() if isinstance(v[1], (int, float)))
        lines.append(
            f"| {r.stage} | `{r.run_name}` | {'ran' if r.ran else 'skipped'} | {r.steps} | {shown or '-'} | "
            f"`{r.sampler_path or r.state_path}` |"
        )
    lines += ["", *[f"- {k}: {v}" for k, v in extra.items()]]
    key = artifact_key("rlhf", run_name)
    create_markdown_artifact("\n".join(lines), key=key, description="RLHF summary over the SFT, RM and RL stages")
    return key
