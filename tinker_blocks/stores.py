"""Store blocks: training, eval and capture stores as append-only Parquet + DuckDB, on a local
folder or S3 (``s3://bucket/prefix``; AWS or any S3-compatible endpoint).

The I/O lives in :mod:`tinker_blocks.store_io` (no Prefect import, used by the CLI); this module
wraps it in Prefect blocks so flows and deployments can reference a store by name. Every block has
the same API (``writer``, ``connect``, ``query``, ``check``, ``compact``) and the same SQL for a
folder and for S3. Schemas: :mod:`tinker_blocks.store_schemas` and the README.

S3 credentials: the block's ``credentials`` (:class:`~tinker_blocks.s3_credentials.S3Credentials`)
or, without one, the AWS environment variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_ENDPOINT_URL``, ``AWS_DEFAULT_REGION``).
"""

from __future__ import annotations

from abc import ABC
from typing import Any, ClassVar

import duckdb
from prefect.blocks.core import Block
from pydantic import BaseModel, Field

from tinker_blocks.docs import docs_url
from tinker_blocks.s3 import StoreAccessError, StoreUnavailableError
from tinker_blocks.s3_credentials import S3Credentials
from tinker_blocks.store_compaction import compact
from tinker_blocks.store_config import default_retry_seconds, default_store_root
from tinker_blocks.store_io import (
    CAPTURES_SCHEMA,
    CHECKPOINTS_SCHEMA,
    EVAL_RESULTS_SCHEMA,
    EVAL_SAMPLES_SCHEMA,
    METRICS_SCHEMA,
    RUNS_SCHEMA,
    STORES,
    ParquetStore,
    StoreError,
    StoreWriter,
    make_row_id,
    validate_run_id,
)

__all__ = [
    "StoreBlock",
    "TrainingStore",
    "EvalStore",
    "CaptureStore",
    "S3Credentials",
    "StoreWriter",
    "StoreError",
    "StoreAccessError",
    "StoreUnavailableError",
    "make_row_id",
    "default_store_root",
    "METRICS_SCHEMA",
    "CHECKPOINTS_SCHEMA",
    "RUNS_SCHEMA",
    "EVAL_RESULTS_SCHEMA",
    "EVAL_SAMPLES_SCHEMA",
    "CAPTURES_SCHEMA",
]


class StoreBlock(Block, ABC):
    """Common fields and API of the store blocks (abstract: use a concrete store).

    Layout: ``<root>/<store>/<table>/run_id=<id>/part-<writer>-<seq>-<uuid>.parquet``.
    """

    _store: ClassVar[str] = ""
    _documentation_url = docs_url("stores")  # type: ignore[assignment]

    root: str = Field(
        description="Store root: a local folder or an fsspec URL such as s3://bucket/prefix.",
    )
    credentials: S3Credentials | None = Field(
        default=None,
        description="S3 credentials and endpoint for s3:// roots; empty: the AWS_* environment variables.",
    )
    retry_seconds: float = Field(
        default_factory=default_retry_seconds,
        gt=0,
        description=(
            "The S3 outage window: how long the store's writes, reads and lease renewals retry while the server "
            "does not answer (connection errors, timeouts, 5xx) before the run fails; an outage is logged once when "
            "it starts and once when the store answers again. Default: $PREFECT_TINKER_STORE_RETRY_SECONDS, else 300."
        ),
    )

    def __new__(cls, root: str | None = None, /, **data: Any) -> StoreBlock:
        # Block.__new__ takes keywords only; accept the positional root form too.
        return super().__new__(cls, **data)

    def __init__(self, root: str | None = None, /, **data: Any):
        if root is not None:
            data["root"] = root
        super().__init__(**data)

    @property
    def tables(self) -> list[str]:
        """Names of this store's tables (also its DuckDB view names)."""
        return list(STORES[self._store])

    def parquet_store(self) -> ParquetStore:
        """The store's Parquet reader/writer (its root, table set, storage options and retry
        window): what the lease, the repair scan and the writers work on."""
        opts = self.credentials.storage_options() if self.credentials is not None else None
        return ParquetStore(self.root, self._store, storage_options=opts, retry_seconds=self.retry_seconds)

    # ----- checks ----------------------------------------------------------------------------
    def check(self, *, create_bucket: bool = True) -> None:
        """Verify now that the store can be written, listed and read (a small probe object is
        written and deleted). Flows call it before training so that wrong credentials fail at
        once with a clear message instead of after the first steps.

        Raises:
            StoreAccessError: wrong/missing credentials, forbidden, missing bucket that could not
                be created, local root not writable (message names root and endpoint).
            StoreUnavailableError: the server did not answer within 30 s.
        """
        self.parquet_store().check_access(create_bucket=create_bucket)

    # ----- writing ---------------------------------------------------------------------------
    def writer(
        self,
        table: str,
        *,
        writer_id: str | None = None,
        flush_rows: int = 1000,
        flush_seconds: float = 30.0,
    ) -> StoreWriter:
        """Buffered writer for ``table`` (one of :attr:`tables`).

        Use as a context manager; see :class:`~tinker_blocks.store_writer.StoreWriter` for flush
        rules, retries and row-id derivation. Raises ``StoreError`` for an unknown table.
        """
        return self.parquet_store().writer(
            table, writer_id=writer_id, flush_rows=flush_rows, flush_seconds=flush_seconds
        )

    def write_rows(self, table: str, rows: list[dict[str, Any]], *, writer_id: str | None = None) -> list[str]:
        """Write ``rows`` of ``table`` now (one part per run); return their row ids."""
        with self.writer(table, writer_id=writer_id, flush_rows=max(len(rows), 1)) as w:
            return w.write_many(rows)

    def compact(self, run_id: str, table: str) -> str | None:
        """Merge a run's parts of ``table`` into one part, then delete the inputs (safe while
        readers query). Returns the new part's path, or None when there were fewer than 2 parts."""
        return compact(self.parquet_store(), table, run_id)

    # ----- reading ---------------------------------------------------------------------------
    def connect(self) -> duckdb.DuckDBPyConnection:
        """New in-memory DuckDB connection with one view per table (deduplicated by row id;
        empty with the right columns when a table has no part yet). Parts found unreadable are
        left out of the views (:mod:`tinker_blocks.store_health`); a statement run on this raw
        connection that meets a damaged part not known yet fails naming it: :meth:`query`
        skips it and runs the statement again."""
        return self.parquet_store().connect()

    def query(self, sql: str, params: list[Any] | None = None) -> list[dict[str, Any]]:
        """Run ``sql`` over the views; return rows as dicts (column name -> value). Re-run on a
        fresh listing when a concurrent compaction deleted a part the query had listed, and
        without a part that turned out unreadable (skipped with a warning naming it)."""
        names, rows = self.parquet_store().query(sql, params)
        return [dict(zip(names, r, strict=True)) for r in rows]


class TrainingStore(StoreBlock):
    """Training store: ``runs``, ``metrics`` and ``checkpoints`` (views from :meth:`connect`, one
    row per ``(run_id, row_id)``, the latest ``time``):

    - ``metrics(row_id, run_id, step BIGINT, name, value DOUBLE, time TIMESTAMPTZ)``;
      ``row_id = make_row_id(run_id, step, name)`` unless given.
    - ``checkpoints(row_id, run_id, step BIGINT, name, kind 'state'|'sampler', path, time,
      renderer)``;
      ``row_id = make_row_id(run_id, kind, name)``; ``path`` is the ``tinker://`` URI.
    - ``runs(row_id, run_id, base_model, backend, lora_rank BIGINT, config_json, status, time,
      meta_json)``;
      ``row_id = make_row_id(run_id)``, so the latest status update is the run's row.

    Example:
        ```python
        store = TrainingStore(root="/data/pt-store")   # or "s3://bucket/prefix"
        store.check()
        with store.writer("metrics") as w:
            w.write(run_id="sft-1", step=3, name="train/loss", value=1.25)
        store.connect().execute("SELECT * FROM metrics").fetchall()
        ```
    """

    _store: ClassVar[str] = "training"
    _block_type_name = "Tinker Training Store"
    _block_type_slug = "tinker-training-store"
    _description = (
        "Append-only Parquet store of training runs, metrics and checkpoints (folder or S3), queried with DuckDB."
    )
    _code_example = """
```python
from tinker_blocks.stores import TrainingStore

store = TrainingStore.load("BLOCK_NAME")  # or TrainingStore(root="s3://bucket/prefix")
with store.writer("metrics") as w:
    w.write(run_id="sft-1", step=0, name="train/loss", value=2.1)
print(store.connect().execute("SELECT * FROM metrics").fetchall())
```"""

    def record_run(
        self,
        run_id: str,
        *,
        status: str,
        base_model: str | None = None,
        backend: str | None = None,
        lora_rank: int | None = None,
        config: Any = None,
        meta: dict[str, Any] | None = None,
    ) -> str:
        """Write one ``runs`` row now (one part); return its row id.

        ``config`` may be a pydantic model, a dict or a JSON string (stored as ``config_json``);
        ``meta`` (stored as ``meta_json``) what the run resolved: recipe, renderer, tokenizer id,
        dataset fingerprint.
        The latest row per run wins in the view, so call it again to update the status.
        """
        if isinstance(config, BaseModel):
            config = config.model_dump_json()
        with self.writer("runs", writer_id="run") as w:
            return w.write(
                run_id=run_id,
                status=status,
                base_model=base_model,
                backend=backend,
                lora_rank=lora_rank,
                config_json=config,
                meta_json=meta,
            )

    def record_checkpoint(
        self, run_id: str, *, step: int, name: str, kind: str, path: str, renderer: str | None = None
    ) -> str:
        """Write one ``checkpoints`` row now (one part); return its row id.

        ``kind`` is ``"state"`` (weights + optimizer) or ``"sampler"``; ``path`` the
        ``tinker://`` URI. Raises ``StoreError`` on bad values.
        """
        with self.writer("checkpoints", writer_id="ckpt") as w:
            return w.write(run_id=run_id, step=step, name=name, kind=kind, path=path, renderer=renderer)

    def last_checkpoint(self, run_id: str, kind: str = "state") -> dict[str, Any] | None:
        """The run's checkpoint of ``kind`` with the highest step (latest time on ties).

        Returns a dict with the ``checkpoints`` columns (``step``, ``name``, ``kind``, ``path``,
        ``time``, ...) or None. Raises ``StoreError`` for an invalid run id or kind,
        ``StoreAccessError`` for wrong S3 credentials.
        """
        validate_run_id(run_id)
        if kind not in ("state", "sampler"):
            raise StoreError(f"checkpoint kind must be 'state' or 'sampler', got {kind!r}")
        rows = self.query(
            "SELECT * FROM checkpoints WHERE run_id = ? AND kind = ? ORDER BY step DESC, time DESC LIMIT 1",
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
        io = self.parquet_store()

        def once():
            con = io.connect()
            try:
                return con.execute(
                    "SELECT step, name, value, time FROM metrics WHERE run_id = ? ORDER BY step, name",
                    [run_id],
                ).df()
            finally:
                con.close()

        return io.reading(once, "reading the metrics")


class EvalStore(StoreBlock):
    """Eval store: ``eval_results`` (one row per run, evaluated weights, eval and metric) and
    ``eval_samples`` (one row per graded completion). Columns: see
    :data:`~tinker_blocks.store_schemas.EVAL_RESULTS_SCHEMA` / ``EVAL_SAMPLES_SCHEMA`` and the
    README. Row ids: ``make_row_id(run_id, eval_name, checkpoint, step, metric)`` and
    ``make_row_id(run_id, eval_name, checkpoint, step, example_id, sample_index)``, so a
    re-run evaluation replaces its rows.

    Example:
        ```python
        evals = EvalStore(root="s3://bucket/prefix")
        evals.record_result("sft-1", eval_name="gsm8k", metric="accuracy", value=0.41,
                            step=200, checkpoint="tinker://m/sampler_weights/step-200")
        ```
    """

    _store: ClassVar[str] = "eval"
    _block_type_name = "Tinker Eval Store"
    _block_type_slug = "tinker-eval-store"
    _description = "Append-only Parquet store of evaluation results and graded samples, queried with DuckDB."
    _code_example = """
```python
from tinker_blocks.stores import EvalStore

evals = EvalStore.load("BLOCK_NAME")  # or EvalStore(root="s3://bucket/prefix")
evals.record_result("sft-1", eval_name="gsm8k", metric="accuracy", value=0.41,
                    step=200, checkpoint="tinker://m/sampler_weights/step-200")
print(evals.query("SELECT eval_name, metric, value FROM eval_results"))
```"""

    def record_result(
        self,
        run_id: str,
        *,
        eval_name: str,
        metric: str,
        value: float,
        step: int | None = None,
        checkpoint: str | None = None,
        num_samples: int | None = None,
        config: Any = None,
    ) -> str:
        """Write one ``eval_results`` row now; return its row id. ``config`` (dict, JSON string
        or pydantic model) is stored as ``config_json``. Raises ``StoreError`` on bad values."""
        if isinstance(config, BaseModel):
            config = config.model_dump_json()
        with self.writer("eval_results", writer_id="eval") as w:
            return w.write(
                run_id=run_id,
                eval_name=eval_name,
                metric=metric,
                value=value,
                step=step,
                checkpoint=checkpoint,
                num_samples=num_samples,
                config_json=config,
            )


class CaptureStore(StoreBlock):
    """Capture store: ``captures``, one row per sampled sequence served to a client (time,
    client, model / checkpoint, prompt, completion, token counts and ids, logprob summary, stop
    reason, latency). Columns: :data:`~tinker_blocks.store_schemas.CAPTURES_SCHEMA` and the
    README. ``row_id = make_row_id(run_id, request_id, sequence_index)``.

    A capture server keeps one writer open (``writer("captures", flush_rows=..., flush_seconds=...)``)
    and closes it on shutdown; each flush is one part per capture session.
    """

    _store: ClassVar[str] = "capture"
    _block_type_name = "Tinker Capture Store"
    _block_type_slug = "tinker-capture-store"
    _description = "Append-only Parquet store of captured sampling requests and responses, queried with DuckDB."
    _code_example = """
```python
from tinker_blocks.stores import CaptureStore

captures = CaptureStore.load("BLOCK_NAME")  # or CaptureStore(root="s3://bucket/prefix")
print(captures.query("SELECT prompt, completion FROM captures LIMIT 5"))
```"""
