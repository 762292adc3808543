"""Store writes as Prefect tasks: run status, metrics and checkpoint rows in the training store.

Each call writes one immutable Parquet part (the flow buffers rows between checkpoints, so a run
of N steps with a checkpoint every k steps writes about N/k metric parts, not N). Row ids come
from natural keys (run, step, name), so re-writing a step after a resume deduplicates.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prefect import task
from prefect.cache_policies import NO_CACHE

from prefect_tinker.tasks.policies import RETRY_OPTIONS

if TYPE_CHECKING:
    from tinker_blocks.stores import TrainingStore

__all__ = [
    "write_metrics",
    "write_trajectories",
    "write_table",
    "record_checkpoint",
    "record_run",
    "check_store",
    "compact_run",
    "compact_finished_run",
]


def _steps_run_name(kind: str):
    """A ``task_run_name`` callable: ``<kind>-<run_id>-step-<a>`` or ``...-steps-<a>-<b>`` from the
    steps of the task's ``rows`` ((step, ...) tuples or dicts with a ``step`` key)."""

    def name(parameters: dict) -> str:
        rows = parameters.get("rows")
        steps = []
        for r in rows if isinstance(rows, (list, tuple)) else ():  # never consume an iterator
            step = r.get("step") if isinstance(r, dict) else (r[0] if isinstance(r, (tuple, list)) and r else None)
            if step is None:
                continue
            try:
                steps.append(int(step))
            except (TypeError, ValueError):
                pass
        base = f"{kind}-{parameters.get('run_id')}"
        if not steps:
            return base
        lo, hi = min(steps), max(steps)
        return f"{base}-step-{lo}" if lo == hi else f"{base}-steps-{lo}-{hi}"

    return name


def _store(root: str | TrainingStore) -> TrainingStore:
    """A ``TrainingStore`` for ``root``: a folder or ``s3://`` URL (S3 credentials from the AWS_*
    environment variables), or a store block (then used as is: its ``credentials`` apply; a run
    session passes its one store object, so no task builds another)."""
    from tinker_blocks.stores import TrainingStore

    return root if isinstance(root, TrainingStore) else TrainingStore(root=root)


@task(name="check-store", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def check_store(store: str | TrainingStore) -> None:
    """Fail now, with a clear message, when the store cannot be written, listed and read (wrong
    S3 credentials, missing bucket, unwritable folder): call it before training starts.

    Raises ``StoreAccessError`` or ``StoreUnavailableError`` (no answer within 30 s), not retried.
    """
    _store(store).check()


@task(name="compact-run", task_run_name="compact-{run_id}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def compact_run(store: str | TrainingStore, run_id: str, tables: tuple[str, ...] | None = None) -> int:
    """Merge each of the run's ``tables`` (default: every training-store table: runs, metrics,
    checkpoints, trajectories) into one part; tables with fewer than two parts are left alone.
    Queries over S3 cost a request per part, so a finished run should be one part per table.
    Safe while others query (see ``tinker_blocks.store_compaction.compact``). Returns the number of
    tables compacted."""
    st = _store(store)
    return sum(st.compact(run_id, t) is not None for t in (tables or st.tables))


def compact_finished_run(store: str | TrainingStore, run_id: str) -> int | None:
    """Call :func:`compact_run` at the end of a successful flow run. A failure (after the task's
    retries) is logged as a warning, not raised: the run's rows are intact, only spread over
    more parts, and ``TrainingStore(root=...).compact(run_id, table)`` can merge them later.
    Returns the number of tables compacted, or None when compaction failed."""
    from prefect import get_run_logger

    try:
        return compact_run(store, run_id)
    except Exception as exc:
        get_run_logger().warning("compacting run %s failed (%s); its rows are intact", run_id, exc)
        return None


@task(name="write-metrics", task_run_name=_steps_run_name("metrics"), cache_policy=NO_CACHE, **RETRY_OPTIONS)
def write_metrics(store: str | TrainingStore, run_id: str, rows: Iterable[tuple[int, str, float]]) -> int:
    """Write ``(step, name, value)`` rows of run ``run_id`` as one part; returns the row count."""
    rows = list(rows)
    if not rows:
        return 0
    with _store(store).writer("metrics", flush_rows=max(len(rows), 1)) as w:
        for step, name, value in rows:
            w.write(run_id=run_id, step=int(step), name=name, value=float(value))
    return len(rows)


@task(name="write-trajectories", task_run_name=_steps_run_name("trajectories"), cache_policy=NO_CACHE, **RETRY_OPTIONS)
def write_trajectories(store: str | TrainingStore, run_id: str, rows: list[dict]) -> int:
    """Write rows of the ``trajectories`` table (step, batch_index, group_index, member, prompt,
    response, reward, ...; ``run_id`` is added) as one part; returns the row count."""
    if not rows:
        return 0
    return len(_store(store).write_rows("trajectories", [dict(r, run_id=run_id) for r in rows]))


@task(name="write-rows", task_run_name=_steps_run_name("rows"), cache_policy=NO_CACHE, **RETRY_OPTIONS)
def write_table(store: str | TrainingStore, table: str, run_id: str, rows: list[dict]) -> int:
    """Write ``rows`` of any table of the store (``run_id`` added) as one part; returns the count."""
    if not rows:
        return 0
    return len(_store(store).write_rows(table, [dict(r, run_id=run_id) for r in rows]))


@task(
    name="record-checkpoint", task_run_name="record-{kind}-{run_id}-step-{step}", cache_policy=NO_CACHE, **RETRY_OPTIONS
)
def record_checkpoint(
    store: str | TrainingStore, run_id: str, step: int, path: str, kind: str, renderer: str | None = None
) -> None:
    """Record a saved checkpoint (``kind`` 'state' or 'sampler') taken after ``step`` updates, and
    the renderer its weights were trained with."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    with _store(store).writer("checkpoints") as w:
        w.write(run_id=run_id, step=int(step), name=name, kind=kind, path=path, renderer=renderer)


@task(name="record-run", task_run_name="record-run-{run_id}-{status}", cache_policy=NO_CACHE, **RETRY_OPTIONS)
def record_run(
    store: str | TrainingStore,
    run_id: str,
    base_model: str,
    backend: str,
    lora_rank: int,
    config_json: str,
    status: str,
    meta: dict | None = None,
) -> None:
    """Write the run's row (one row id per run: the newest status wins in the ``runs`` view).

    ``config_json`` must not contain secrets (flow configs hold none: keys live in blocks);
    ``meta`` (``meta_json``): what the run resolved (recipe, renderer, tokenizer, dataset fingerprint).
    """
    with _store(store).writer("runs") as w:
        w.write(
            run_id=run_id,
            base_model=base_model,
            backend=backend,
            lora_rank=int(lora_rank),
            config_json=config_json,
            status=status,
            meta_json=meta,
        )
