"""Store blocks: the training store (runs, metrics, checkpoints) as append-only Parquet + DuckDB.

The I/O lives in :mod:`tinker_blocks.store_io` (no Prefect import, used by the CLI); this module
wraps it in Prefect blocks so flows and deployments can reference a store by name.
"""

from __future__ import annotations

from typing import Any

import duckdb
from prefect.blocks.core import Block
from pydantic import Field

from tinker_blocks.store_io import (
    CHECKPOINTS_SCHEMA,
    METRICS_SCHEMA,
    RUNS_SCHEMA,
    TRAINING_TABLES,
    ParquetStore,
    StoreError,
    StoreWriter,
    default_store_root,
    make_row_id,
    validate_run_id,
)

__all__ = [
    "TrainingStore",
    "StoreWriter",
    "StoreError",
    "make_row_id",
    "default_store_root",
    "METRICS_SCHEMA",
    "CHECKPOINTS_SCHEMA",
    "RUNS_SCHEMA",
]


class TrainingStore(Block):
    """Training store: runs, metrics and checkpoints as append-only Parquet under a local folder
    (or an fsspec URL such as ``s3://bucket/prefix``), queried with DuckDB.

    Layout: ``<root>/training/<table>/run_id=<id>/part-<writer>-<seq>-<uuid>.parquet``.

    Tables (views from :meth:`connect`, one row per ``(run_id, row_id)``, the latest ``time``):

    - ``metrics(row_id, run_id, step BIGINT, name, value DOUBLE, time TIMESTAMPTZ)``;
      ``row_id = make_row_id(run_id, step, name)`` unless given.
    - ``checkpoints(row_id, run_id, step BIGINT, name, kind 'state'|'sampler', path, time)``;
      ``row_id = make_row_id(run_id, kind, name)``; ``path`` is the ``tinker://`` URI.
    - ``runs(row_id, run_id, base_model, backend, lora_rank BIGINT, config_json, status, time)``;
      ``row_id = make_row_id(run_id)``, so the latest status update is the run's row.

    Example:
        ```python
        store = TrainingStore(root="/data/pt-store")
        with store.writer("metrics") as w:
            w.write(run_id="sft-1", step=3, name="train/loss", value=1.25)
        store.connect().execute("SELECT * FROM metrics").fetchall()
        ```
    """

    _block_type_name = "Tinker Training Store"
    _block_type_slug = "tinker-training-store"
    _description = (
        "Append-only Parquet store of training runs, metrics and checkpoints, queried with DuckDB."
    )
    _documentation_url = "https://github.com/prefect-tinker/prefect-tinker"  # type: ignore[assignment]
    _code_example = """
```python
from tinker_blocks.stores import TrainingStore
store = TrainingStore(root="s3://bucket/prefix")
with store.writer("metrics") as w:
    w.write(run_id="sft-1", step=0, name="train/loss", value=2.1)
print(store.connect().execute("SELECT * FROM metrics").fetchall())
```"""

    root: str = Field(
        description="Store root: a local folder or an fsspec URL such as s3://bucket/prefix.",
    )

    def __new__(cls, root: str | None = None, /, **data: Any) -> "TrainingStore":
        # Block.__new__ takes keywords only; accept the positional root form too.
        return super().__new__(cls, **data)

    def __init__(self, root: str | None = None, /, **data: Any):
        if root is not None:
            data["root"] = root
        super().__init__(**data)

    @classmethod
    def local_default(cls) -> "TrainingStore":
        """A store at :func:`default_store_root`."""
        return cls(root=default_store_root())

    # ----- internals -------------------------------------------------------------------------
    def _io(self) -> ParquetStore:
        return ParquetStore(self.root, "training", TRAINING_TABLES)

    # ----- writing ---------------------------------------------------------------------------
    def writer(
        self,
        table: str,
        *,
        writer_id: str | None = None,
        flush_rows: int = 1000,
        flush_seconds: float = 30.0,
    ) -> StoreWriter:
        """Buffered writer for ``table`` (``"metrics"``, ``"checkpoints"`` or ``"runs"``).

        Use as a context manager; see :class:`~tinker_blocks.store_io.StoreWriter` for flush
        rules and row-id derivation. Raises ``StoreError`` for an unknown table.
        """
        return self._io().writer(
            table, writer_id=writer_id, flush_rows=flush_rows, flush_seconds=flush_seconds
        )

    def record_run(
        self,
        run_id: str,
        *,
        status: str,
        base_model: str | None = None,
        backend: str | None = None,
        lora_rank: int | None = None,
        config: Any = None,
    ) -> str:
        """Write one ``runs`` row now (one part); return its row id.

        ``config`` may be a pydantic model, a dict or a JSON string (stored as ``config_json``).
        The latest row per run wins in the view, so call it again to update the status.
        """
        if hasattr(config, "model_dump_json"):
            config = config.model_dump_json()
        with self.writer("runs", writer_id="run") as w:
            return w.write(
                run_id=run_id, status=status, base_model=base_model, backend=backend,
                lora_rank=lora_rank, config_json=config,
            )

    def record_checkpoint(self, run_id: str, *, step: int, name: str, kind: str, path: str) -> str:
        """Write one ``checkpoints`` row now (one part); return its row id.

        ``kind`` is ``"state"`` (weights + optimizer) or ``"sampler"``; ``path`` the
        ``tinker://`` URI. Raises ``StoreError`` on bad values.
        """
        with self.writer("checkpoints", writer_id="ckpt") as w:
            return w.write(run_id=run_id, step=step, name=name, kind=kind, path=path)

    def compact(self, run_id: str, table: str) -> str | None:
        """Merge a run's parts of ``table`` into one part, then delete the inputs.

        Returns the new part's path, or None when there was nothing to merge (< 2 parts).
        """
        return self._io().compact(table, run_id)

    # ----- reading ---------------------------------------------------------------------------
    def connect(self) -> duckdb.DuckDBPyConnection:
        """New in-memory DuckDB connection with views ``runs``, ``metrics``, ``checkpoints``
        (deduplicated; empty with the right columns when a table has no part yet)."""
        return self._io().connect()

    def query(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        """Run ``sql`` over the views; return rows as dicts (column name -> value)."""
        con = self.connect()
        try:
            cur = con.execute(sql, params or [])
            if cur.description is None:
                return []
            names = [d[0] for d in cur.description]
            return [dict(zip(names, r)) for r in cur.fetchall()]
        finally:
            con.close()

    def last_checkpoint(self, run_id: str, kind: str = "state") -> dict[str, Any] | None:
        """The run's checkpoint of ``kind`` with the highest step (latest time on ties).

        Returns a dict with the ``checkpoints`` columns (``step``, ``name``, ``kind``, ``path``,
        ``time``, ...) or None. Raises ``StoreError`` for an invalid run id or kind.
        """
        validate_run_id(run_id)
        if kind not in ("state", "sampler"):
            raise StoreError(f"checkpoint kind must be 'state' or 'sampler', got {kind!r}")
        rows = self.query(
            "SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? "
            "ORDER BY step DESC, time DESC LIMIT 1",
            [run_id, kind],
        )
        return rows[0] if rows else None

    def get_run(self, run_id: str) -> dict[str, Any] | None:
        """The run's latest ``runs`` row as a dict, or None when the run is unknown."""
        validate_run_id(run_id)
        rows = self.query("SELECT * FROM runs WHERE run_id = ? ORDER BY time DESC LIMIT 1", [run_id])
        return rows[0] if rows else None

    def metrics_frame(self, run_id: str):
        """The run's metrics as a pandas DataFrame with columns ``step, name, value, time``
        (long format, sorted by step then name; empty frame when none)."""
        validate_run_id(run_id)
        con = self.connect()
        try:
            return con.execute(
                "SELECT step, name, value, time FROM metrics WHERE run_id = ? ORDER BY step, name",
                [run_id],
            ).df()
        finally:
            con.close()
