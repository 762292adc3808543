"""Buffered writer of one store table: rows in, immutable Parquet parts out."""

from __future__ import annotations

import re
import time as _time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import pyarrow as pa

from tinker_blocks.store_schemas import StoreError, TableSpec, normalize_row

__all__ = ["PartWriter", "StoreWriter", "sanitize_writer_id"]


class PartWriter(Protocol):
    """Where a :class:`StoreWriter` writes (:class:`tinker_blocks.store_io.ParquetStore`)."""

    def spec(self, table: str) -> TableSpec: ...
    def write_part(self, table: str, run_id: str, data: pa.Table, *, writer_id: str, seq: int) -> str: ...


def sanitize_writer_id(s: str) -> str:
    """``s`` as a file-name-safe writer id: ``[A-Za-z0-9_]``, at most 40 characters."""
    return re.sub(r"[^A-Za-z0-9_]", "_", s)[:40] or "w"


class StoreWriter:
    """Buffers rows of one table and writes them as immutable Parquet parts.

    A flush happens when ``flush_rows`` rows are buffered, when a write arrives ``flush_seconds``
    or more after the oldest buffered row (checked on write, no background thread), on
    :meth:`flush`, and on :meth:`close` / leaving the ``with`` block (also on an exception, so
    rows written before a crash are kept). One flush writes one part per run id, each in a single
    PUT (remote) or a write-then-rename (local): a writer killed mid-flush leaves no partial part.

    Rows are dicts keyed by the table's columns. Missing ``time`` -> now (UTC); missing
    ``row_id`` -> derived from the table's natural key (e.g. metrics:
    ``make_row_id(run_id, step, name)``), so re-writing the same metric dedups in the views.
    A row id written twice into one buffer keeps the last row.

    Failures: transient store errors (server down, timeouts, 5xx) are retried inside the store
    with backoff for up to the store's ``retry_seconds``, re-sending the same part under the same
    name, so a flush that eventually succeeds leaves each row in exactly one part. A flush that
    still fails raises (``StoreUnavailableError`` / ``StoreAccessError``) and keeps the rows of the
    runs not yet written in the buffer; the next flush writes them. Not thread-safe: one writer
    per thread.

    Raises:
        StoreError: unknown column, missing required column, wrong value type, invalid run id,
            a value outside a column's choices, or writing after close.
    """

    def __init__(
        self,
        store: PartWriter,
        table: str,
        *,
        writer_id: str | None = None,
        flush_rows: int = 1000,
        flush_seconds: float = 30.0,
    ):
        self.store = store
        self.table = table
        self.spec = store.spec(table)
        self.writer_id = sanitize_writer_id(writer_id or uuid.uuid4().hex[:8])
        if flush_rows < 1:
            raise StoreError(f"flush_rows must be >= 1, got {flush_rows}")
        self.flush_rows = int(flush_rows)
        self.flush_seconds = float(flush_seconds)
        self._buf: dict[str, dict[str, Any]] = {}
        self._oldest: float | None = None
        self._seq = 0
        self._closed = False
        self.parts_written: list[str] = []
        self.rows_written = 0

    # ----- API ---------------------------------------------------------------------------------
    def write(self, row: Mapping[str, Any] | None = None, **columns: Any) -> str:
        """Buffer one row (a mapping and/or keyword columns); return its row id."""
        if self._closed:
            raise StoreError(f"writer for table {self.table!r} is closed")
        rec = normalize_row(self.table, self.spec, {**(row or {}), **columns})
        rid = rec["row_id"]
        self._buf.pop(rid, None)
        self._buf[rid] = rec
        now = _time.monotonic()
        if self._oldest is None:
            self._oldest = now
        if len(self._buf) >= self.flush_rows or now - self._oldest >= self.flush_seconds:
            self.flush()
        return rid

    def write_many(self, rows: Iterable[Mapping[str, Any]]) -> list[str]:
        """Buffer several rows; return their row ids."""
        return [self.write(r) for r in rows]

    def flush(self) -> list[str]:
        """Write buffered rows now (one part per run id); return the new parts' paths.

        Raises ``StoreUnavailableError`` / ``StoreAccessError`` from the store; rows of runs whose
        part was written are dropped from the buffer, the others stay for the next flush.
        """
        if not self._buf:
            return []
        by_run: dict[str, list[str]] = {}
        for rid, rec in self._buf.items():
            by_run.setdefault(rec["run_id"], []).append(rid)
        written = []
        for run_id, rids in by_run.items():
            data = pa.Table.from_pylist([self._buf[r] for r in rids], schema=self.spec.schema)
            path = self.store.write_part(self.table, run_id, data, writer_id=self.writer_id, seq=self._seq)
            self._seq += 1
            for r in rids:
                del self._buf[r]
            self.rows_written += len(rids)
            written.append(path)
            self.parts_written.append(path)
        self._oldest = None
        return written

    def close(self) -> None:
        """Flush and refuse further writes. Idempotent."""
        if not self._closed:
            try:
                self.flush()
            finally:
                self._closed = True

    @property
    def pending(self) -> int:
        """Number of buffered (not yet written) rows."""
        return len(self._buf)

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
