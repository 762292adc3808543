"""Capture rows to the store from a server: a writer thread with a timed flush.

The request handlers hand rows to :meth:`CaptureRecorder.record` (never blocks on the store);
one thread owns the table's :class:`~tinker_blocks.store_writer.StoreWriter` and flushes when
``flush_rows`` rows are buffered, when the oldest buffered row is ``flush_seconds`` old (a timer,
not only on the next write), and on :meth:`CaptureRecorder.close`. Each flush writes one immutable
part per capture session (write-then-rename locally, one PUT on S3), so a server killed at any
moment loses at most the rows of the last ``flush_seconds`` and leaves no partial Parquet file.

A flush that fails (store unreachable past its retry window) keeps the rows buffered and is
retried ``flush_seconds`` later; the failure is logged and counted in :attr:`CaptureRecorder.stats`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any, TypedDict

__all__ = ["CaptureRecorder", "RecorderStats"]

logger = logging.getLogger("prefect_tinker.capture")

_STOP = object()


class RecorderStats(TypedDict):
    """Counters of a :class:`CaptureRecorder` (rows and parts since it started)."""

    rows_recorded: int
    rows_written: int
    rows_dropped: int
    parts_written: int
    flush_errors: int
    last_error: str | None  # "ExceptionType: message" of the last failed write, None while none failed


class CaptureRecorder:
    """Background writer of ``captures`` rows (or of another table of the capture store: ``table``).

    Args:
        store: a capture store: a :class:`~tinker_blocks.stores.CaptureStore` block or a
            :class:`~tinker_blocks.store_io.ParquetStore` of the ``capture`` store (anything with
            ``writer(table, writer_id=, flush_rows=, flush_seconds=)``).
        flush_seconds: most seconds a row waits in memory (> 0).
        flush_rows: rows that trigger a flush at once (>= 1).
        writer_id: the writer name in part file names.
        table: the table written (``captures``; the server's feedback goes to ``ratings``).

    Raises:
        ValueError: a non-positive ``flush_seconds`` or ``flush_rows``.
    """

    def __init__(
        self,
        store: Any,
        *,
        flush_seconds: float = 5.0,
        flush_rows: int = 500,
        writer_id: str = "capture",
        table: str = "captures",
    ):
        if not flush_seconds > 0 or flush_rows < 1:
            raise ValueError(f"flush_seconds must be > 0 and flush_rows >= 1, got {flush_seconds}, {flush_rows}")
        self.flush_seconds = float(flush_seconds)
        self._writer = store.writer(
            table, writer_id=writer_id, flush_rows=int(flush_rows), flush_seconds=self.flush_seconds
        )
        self._queue: queue.Queue = queue.Queue()
        self._oldest: float | None = None
        self._lock = threading.Lock()
        self.stats: RecorderStats = {
            "rows_recorded": 0,
            "rows_written": 0,
            "rows_dropped": 0,
            "parts_written": 0,
            "flush_errors": 0,
            "last_error": None,
        }
        self._thread = threading.Thread(target=self._run, name=f"capture-recorder-{table}", daemon=True)
        self._closed = False
        self._thread.start()

    def record(self, rows: Iterable[dict[str, Any]]) -> None:
        """Queue rows of the table (dicts of its columns) for the next flush.

        Raises:
            RuntimeError: the recorder is closed.
        """
        rows = list(rows)
        with self._lock:
            if self._closed:
                raise RuntimeError("the capture recorder is closed")
            self.stats["rows_recorded"] += len(rows)
            self._queue.put(rows)

    @property
    def pending(self) -> int:
        """Rows recorded but not yet written to the store."""
        return self.stats["rows_recorded"] - self.stats["rows_written"] - self.stats["rows_dropped"]

    def close(self, timeout: float = 60.0) -> None:
        """Write every recorded row and stop the thread (idempotent). Rows still unwritten
        after ``timeout`` seconds (store down) are logged as lost."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join(timeout)
        if self.pending:
            logger.error("capture recorder closed with %d rows not written: %s", self.pending, self.stats["last_error"])

    # ----- thread --------------------------------------------------------------------------------
    def _warm_up(self) -> None:
        """Encode an empty part once, so that the first real flush does not pay for loading the
        Parquet writer and its codec (about a second on a busy machine)."""
        try:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(
                pa.Table.from_pylist([], schema=self._writer.spec.schema), pa.BufferOutputStream(), compression="zstd"
            )
        except Exception:  # only an optimisation
            pass

    def _run(self) -> None:
        self._warm_up()
        while True:
            wait = None if self._oldest is None else max(0.0, self._oldest + self.flush_seconds - time.monotonic())
            try:
                item = self._queue.get(timeout=wait)
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if item:
                self._write(item)
            if self._oldest is not None and time.monotonic() - self._oldest >= self.flush_seconds:
                self._flush()
        self._flush()

    def _write(self, rows: list[dict[str, Any]]) -> None:
        from tinker_blocks.store_schemas import StoreError

        for row in rows:
            if self._oldest is None:
                self._oldest = time.monotonic()
            pending = self._writer.pending
            try:
                self._writer.write(row)  # flushes by itself at flush_rows
            except StoreError as exc:  # a row the schema refuses: a bug, logged, never retried
                self.stats["rows_dropped"] += 1
                self._failed(exc)
            except Exception as exc:  # a size-triggered flush failed: the rows stay buffered
                if self._writer.pending == pending:  # the row itself was not buffered
                    self.stats["rows_dropped"] += 1
                self._failed(exc)
                self._oldest = time.monotonic()
            self._account()
            if not self._writer.pending:
                self._oldest = None

    def _flush(self) -> None:
        if not self._writer.pending:
            self._oldest = None
            return
        try:
            self._writer.flush()
        except Exception as exc:
            self._failed(exc)
            self._oldest = time.monotonic()  # try again one interval later
            return
        finally:
            self._account()
        self._oldest = None

    def _account(self) -> None:
        self.stats["parts_written"] = len(self._writer.parts_written)
        self.stats["rows_written"] = self._writer.rows_written

    def _failed(self, exc: Exception) -> None:
        self.stats["flush_errors"] += 1
        self.stats["last_error"] = f"{type(exc).__name__}: {exc}"
        logger.error("writing captures failed (rows kept for the next flush): %s: %s", type(exc).__name__, exc)
