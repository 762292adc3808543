"""The run's buffered store rows: metrics and other training-store rows kept in memory between
checkpoints, written before each checkpoint row (so a resumed run has exactly one row per key), and
the run's metrics read back from the store.

:class:`RunRows` is what :class:`~prefect_tinker.flows.session.RunSession`'s ``record``, ``buffer``,
``flush``, ``metric_ends`` and ``metric_sum`` use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefect_tinker.tasks.records import write_metrics, write_table

if TYPE_CHECKING:
    from tinker_blocks.stores import TrainingStore

__all__ = ["RunRows"]


class RunRows:
    """Rows of run ``run_id`` buffered for ``store``.

    Attributes:
        pending: table -> buffered rows; ``metrics`` rows are ``(step, name, value)`` tuples, the other
            tables' rows are dicts with a ``step``.
    """

    def __init__(self, store: TrainingStore, run_id: str):
        self.store, self.run_id = store, run_id
        self.pending: dict[str, list[Any]] = {"metrics": []}

    def record(self, step: int, metrics: dict[str, float]) -> None:
        """Buffer ``metrics`` (full names, e.g. ``train/loss``) as rows at ``step``."""
        self.pending["metrics"] += [(int(step), k, float(v)) for k, v in metrics.items()]

    def buffer(self, table: str, rows: list[dict[str, Any]]) -> None:
        """Buffer rows of another training-store table (each with a ``step``)."""
        self.pending.setdefault(table, []).extend(rows)

    def flush(self) -> None:
        """Write every buffered row now (metrics first)."""
        if self.pending["metrics"]:
            write_metrics(self.store, self.run_id, self.pending["metrics"])
        for table, rows in self.pending.items():
            if table != "metrics" and rows:
                write_table(self.store, table, self.run_id, rows)
        self.pending = {"metrics": []}

    def drop_from(self, step: int) -> None:
        """Drop the buffered rows of ``step`` and later (a rewind to ``step`` redoes them)."""
        self.pending = {
            t: [r for r in rows if (r[0] if isinstance(r, tuple) else r["step"]) < step]
            for t, rows in self.pending.items()
        }

    def metric_ends(self, name: str) -> tuple[Any, Any]:
        """``(value at the first step, value at the last step)`` of metric ``name`` over the whole
        run (every invocation), read back from the store after writing what is buffered."""
        self.flush()
        rows = self.store.query(
            "SELECT arg_min(value, step) AS first, arg_max(value, step) AS last FROM metrics "
            "WHERE run_id = ? AND name = ?",
            [self.run_id, name],
        )
        return (rows[0]["first"], rows[0]["last"]) if rows else (None, None)

    def metric_sum(self, name: str) -> float:
        """Sum of metric ``name`` over the whole run (e.g. ``train/tokens``), after writing what is buffered."""
        self.flush()
        rows = self.store.query(
            "SELECT coalesce(sum(value), 0) AS t FROM metrics WHERE run_id = ? AND name = ?", [self.run_id, name]
        )
        return float(rows[0]["t"])
