"""SQL across the stores under one root: one DuckDB connection with the views of every table of
the training, eval and capture stores, so one query can join them (``prefect-tinker sql``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import duckdb

from tinker_blocks.s3 import execute_once
from tinker_blocks.store_config import resolve_storage_options
from tinker_blocks.store_io import ParquetStore

__all__ = ["connect_stores", "query_stores"]


def connect_stores(
    root: str,
    stores: Sequence[str] = ("training", "eval", "capture"),
    storage_options: Mapping[str, Any] | None = None,
    con: duckdb.DuckDBPyConnection | None = None,
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the views of every table of ``stores`` under one ``root``
    (training: ``runs``, ``metrics``, ``checkpoints``; eval: ``eval_results``, ``eval_samples``;
    capture: ``captures``), so one query can join across stores. Used by ``prefect-tinker sql``.

    Raises:
        StoreError: an unknown store name. StoreAccessError / StoreUnavailableError: as
        :meth:`ParquetStore.connect`.
    """
    con = con if con is not None else duckdb.connect()
    con.execute("SET TimeZone = 'UTC'")
    opts = resolve_storage_options(root, storage_options)
    first: ParquetStore | None = None
    for name in stores:
        io = ParquetStore(root, name, storage_options=opts)
        if first is None:
            first = io
            io.attach(con)  # one filesystem / secret for the whole root
        io.read_cache = first.read_cache
        io.create_views(con)
    return con


def query_stores(
    root: str,
    sql: str,
    params: Sequence[Any] | None = None,
    stores: Sequence[str] = ("training", "eval", "capture"),
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[list[str], list[tuple]]:
    """``(column names, rows)`` of ``sql`` over :func:`connect_stores` views, re-run on a fresh
    listing when a concurrent compaction deleted a part it had listed (as
    :meth:`ParquetStore.query`), again without a part that turned out unreadable (skipped with
    a warning naming it: :mod:`tinker_blocks.store_health`), and again when it met an S3 outage
    (within the stores' retry window, :func:`~tinker_blocks.store_config.default_retry_seconds`).
    Used by ``prefect-tinker sql``."""
    opts = resolve_storage_options(root, storage_options)
    ios = [ParquetStore(root, name, storage_options=opts) for name in stores]
    return ios[0].reading(
        lambda: execute_once(lambda: connect_stores(root, stores, opts), sql, list(params or [])), "querying", ios
    )
