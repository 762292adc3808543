"""Compaction of a store table: a run's parts of one table merged into one deduplicated part (no
Prefect import).

:func:`compact` writes the merged part before it deletes any input, so concurrent readers always
see every row (twice while both copies exist: the views keep one; a reader whose listed part
vanished mid-query re-runs it: :meth:`~tinker_blocks.store_io.ParquetStore.query`,
:func:`tinker_blocks.store_sql.query_stores`, ``prefect-tinker sql``; a raw
:meth:`~tinker_blocks.store_io.ParquetStore.connect` connection raises a DuckDB IO error naming the
missing file: run the statement again), and a concurrent writer loses nothing (only the parts
listed before reading are deleted).  Damaged parts are left in place, out of the merge
(``store repair`` moves them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import duckdb
import pyarrow as pa

from tinker_blocks.store_health import known_damaged, retry_damaged
from tinker_blocks.view_sql import cast_columns, dedup_window, sql_str

if TYPE_CHECKING:
    from tinker_blocks.store_io import ParquetStore


def compact(store: ParquetStore, table: str, run_id: str, *, writer_id: str = "compact") -> str | None:
    """Merge the parts of run ``run_id`` of ``table`` in ``store`` into one deduplicated part, then
    delete the inputs (see the module docstring).  Returns the new part's path, or None when there
    were fewer than two readable parts.

    Raises:
        StoreError: unknown table or invalid run id. StoreAccessError / StoreUnavailableError: the
            remote store refused or kept failing.
    """
    listed = store.list_parts(table, run_id, fresh=True)  # every part written before this call
    parts: list[str] = []

    def merge() -> pa.Table:
        damaged = known_damaged(listed)  # left in place, out of the merge: `store repair` moves them
        parts[:] = [p for p in listed if p not in damaged]
        return _merged(store, table, parts) if len(parts) >= 2 else None

    data = retry_damaged(merge, [store])
    if data is None:
        return None
    out = store.write_part(table, run_id, data, writer_id=writer_id, seq=0)
    store.delete_parts(table, parts)
    return out


def _merged(store: ParquetStore, table: str, parts: list[str]) -> pa.Table:
    """The deduplicated rows of ``parts`` (of one run of ``table``), oldest first."""
    spec = store.spec(table)
    con = duckdb.connect()
    try:
        store.attach(con)
        files = ", ".join(f"'{sql_str(store.url(p))}'" for p in parts)
        rel = con.sql(
            f"SELECT {cast_columns(spec)} FROM read_parquet([{files}], union_by_name=true) "
            f"QUALIFY {dedup_window(spec)} = 1 ORDER BY time"
        )
        to_arrow = getattr(rel, "to_arrow_table", None) or rel.arrow  # duckdb 2.x / 1.x
        return to_arrow().cast(spec.schema)
    finally:
        con.close()
