"""Append-only Parquet stores queried with DuckDB (no Prefect import; the blocks wrap this).

Layout of a store under ``root`` (a local folder or any fsspec URL such as ``s3://bucket/prefix``)::

    <root>/<store>/<table>/run_id=<id>/part-<writer>-<seq>-<uuid>.parquet

Every part is immutable: it is written once (local: to ``<final>.tmp`` then renamed; remote: one
PUT of the whole file), never appended to or overwritten, so readers never see a partial file.
Every row carries a ``row_id``; readers keep one row per ``(run_id, row_id)`` -- the one with the
latest ``time`` -- so re-writing a row (a re-run after a crash) or compacting parts (write the
merged part, then delete the inputs) never shows duplicates.

Tables are declared as :class:`TableSpec` (a pyarrow schema, a natural key used to derive
deterministic row ids, the required columns). :data:`TRAINING_TABLES` holds the training store's.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import re
import time as _time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import duckdb
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

__all__ = [
    "TableSpec",
    "TRAINING_TABLES",
    "METRICS_SCHEMA",
    "CHECKPOINTS_SCHEMA",
    "RUNS_SCHEMA",
    "ParquetStore",
    "StoreWriter",
    "make_row_id",
    "validate_run_id",
    "StoreError",
    "default_store_root",
]

_TS = pa.timestamp("us", tz="UTC")

METRICS_SCHEMA = pa.schema(
    [
        pa.field("row_id", pa.string(), nullable=False),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),  # optimizer step (0-based)
        pa.field("name", pa.string(), nullable=False),  # e.g. "train/loss", "lr"
        pa.field("value", pa.float64()),  # NaN/inf allowed; unit depends on the metric
        pa.field("time", _TS, nullable=False),  # UTC, microseconds; when the row was written
    ]
)
CHECKPOINTS_SCHEMA = pa.schema(
    [
        pa.field("row_id", pa.string(), nullable=False),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("step", pa.int64(), nullable=False),  # optimizer steps done when saved
        pa.field("name", pa.string(), nullable=False),  # checkpoint name, e.g. "step-000100"
        pa.field("kind", pa.string(), nullable=False),  # "state" (weights+optimizer) | "sampler"
        pa.field("path", pa.string(), nullable=False),  # e.g. "tinker://<model_id>/weights/<name>"
        pa.field("time", _TS, nullable=False),
    ]
)
RUNS_SCHEMA = pa.schema(
    [
        pa.field("row_id", pa.string(), nullable=False),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("base_model", pa.string()),
        pa.field("backend", pa.string()),  # "hosted" | "base_url" | "local" (free text)
        pa.field("lora_rank", pa.int64()),
        pa.field("config_json", pa.string()),  # the flow config, JSON
        pa.field("status", pa.string()),  # e.g. "running" | "completed" | "failed"
        pa.field("time", _TS, nullable=False),  # time of this status update
    ]
)


class StoreError(ValueError):
    """Bad input to a store: unknown table or column, wrong type, invalid run id."""


@dataclass(frozen=True)
class TableSpec:
    """One table of a store.

    Attributes:
        schema: pyarrow schema; must contain ``row_id`` (string), ``run_id`` (string) and
            ``time`` (timestamp, UTC).
        natural_key: columns whose values identify a row; when all are present in a written row
            and no ``row_id`` is given, ``row_id = make_row_id(*values)`` (deterministic, so a
            re-write dedups). Empty -> a random row id.
        required: columns that must be present and non-null in every written row.
        choices: allowed values per column (e.g. ``{"kind": ("state", "sampler")}``).
    """

    schema: pa.Schema
    natural_key: tuple[str, ...] = ()
    required: tuple[str, ...] = ("run_id",)
    choices: Mapping[str, tuple[Any, ...]] = field(default_factory=dict)


TRAINING_TABLES: dict[str, TableSpec] = {
    "metrics": TableSpec(
        METRICS_SCHEMA,
        natural_key=("run_id", "step", "name"),
        required=("run_id", "step", "name"),
    ),
    "checkpoints": TableSpec(
        CHECKPOINTS_SCHEMA,
        natural_key=("run_id", "kind", "name"),
        required=("run_id", "step", "name", "kind", "path"),
        choices={"kind": ("state", "sampler")},
    ),
    # one row id per run: each status update replaces the previous one in the view
    "runs": TableSpec(RUNS_SCHEMA, natural_key=("run_id",), required=("run_id",)),
}

_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_run_id(run_id: Any) -> str:
    """Return ``run_id`` if it is usable as a path segment, else raise :class:`StoreError`.

    Accepted: 1-128 characters from ``A-Z a-z 0-9 . _ -``, starting with a letter or digit.
    """
    if not isinstance(run_id, str) or not _RUN_ID_RE.match(run_id):
        raise StoreError(
            f"invalid run_id {run_id!r}: use 1-128 characters from A-Z a-z 0-9 . _ - "
            "starting with a letter or digit"
        )
    return run_id


def make_row_id(*parts: Any) -> str:
    """Deterministic row id: hex SHA-1 of the parts' JSON encoding, e.g. ``(run_id, step, name)``."""
    payload = json.dumps(list(parts), default=str, separators=(",", ":"))
    return hashlib.sha1(payload.encode("utf-8")).hexdigest()


def default_store_root() -> str:
    """Default store root: ``$PREFECT_TINKER_STORE``, else ``$PREFECT_TINKER_HOME/store``,
    else ``~/.prefect-tinker/store``."""
    env = os.environ.get("PREFECT_TINKER_STORE")
    if env:
        return env
    home = os.environ.get("PREFECT_TINKER_HOME") or os.path.join(os.path.expanduser("~"), ".prefect-tinker")
    return os.path.join(home, "store")


def _now() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc)


def _coerce(table: str, col: str, typ: pa.DataType, value: Any) -> Any:
    """Check/convert one value to the Python type pyarrow expects for ``typ``."""
    if value is None:
        return None
    try:
        if pa.types.is_string(typ):
            if isinstance(value, (dict, list)):
                return json.dumps(value, sort_keys=True, default=str)
            if not isinstance(value, str):
                raise TypeError("expected a string")
            return value
        if pa.types.is_integer(typ):
            if isinstance(value, float) and not value.is_integer():
                raise TypeError("expected an integer")
            if isinstance(value, str):
                raise TypeError("expected an integer")
            return int(value)
        if pa.types.is_floating(typ):
            if isinstance(value, str):
                raise TypeError("expected a number")
            return float(value)
        if pa.types.is_timestamp(typ):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                return _dt.datetime.fromtimestamp(value, _dt.timezone.utc)
            if not isinstance(value, _dt.datetime):
                raise TypeError("expected a datetime or a Unix time in seconds")
            if value.tzinfo is None:  # naive datetimes are taken as UTC
                value = value.replace(tzinfo=_dt.timezone.utc)
            return value
    except (TypeError, ValueError, OverflowError) as exc:
        raise StoreError(
            f"table {table!r}, column {col!r}: bad value {value!r} ({type(value).__name__}): {exc}"
        ) from None
    return value


def _sanitize(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", s)[:40] or "w"


class ParquetStore:
    """A store of append-only Parquet tables under ``<root>/<store>/``.

    Args:
        root: local folder or fsspec URL (``s3://bucket/prefix``); created on first write.
        store: store name (``"training"``, ``"eval"``, ``"capture"``).
        tables: table name -> :class:`TableSpec`.
        storage_options: keyword arguments for the fsspec filesystem (e.g. ``endpoint_url``, ``key``).
    """

    def __init__(
        self,
        root: str,
        store: str,
        tables: Mapping[str, TableSpec],
        storage_options: Mapping[str, Any] | None = None,
    ):
        if not root:
            raise StoreError("store root is empty: give a local folder or an s3:// URL")
        self.root = str(root)
        self.store = store
        self.tables = dict(tables)
        self.fs, base = fsspec.core.url_to_fs(self.root, **dict(storage_options or {}))
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.base = f"{base.rstrip('/')}/{store}"  # path inside the filesystem (no protocol)

    # ----- paths -----------------------------------------------------------------------------
    def spec(self, table: str) -> TableSpec:
        """The :class:`TableSpec` of ``table``; unknown name -> :class:`StoreError`."""
        try:
            return self.tables[table]
        except KeyError:
            raise StoreError(
                f"unknown table {table!r} in store {self.store!r}; tables: {sorted(self.tables)}"
            ) from None

    def table_dir(self, table: str) -> str:
        self.spec(table)
        return f"{self.base}/{table}"

    def partition_dir(self, table: str, run_id: str) -> str:
        return f"{self.table_dir(table)}/run_id={validate_run_id(run_id)}"

    def _url(self, path: str) -> str:
        """Path as DuckDB must see it: plain for local files, ``proto://path`` otherwise."""
        if self.is_local:
            return path
        proto = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{proto}://{path}"

    def list_parts(self, table: str, run_id: str | None = None) -> list[str]:
        """Paths (inside the filesystem) of the table's visible parts, sorted; [] when none."""
        where = self.partition_dir(table, run_id) if run_id else f"{self.table_dir(table)}/run_id=*"
        try:
            return sorted(self.fs.glob(f"{where}/*.parquet"))
        except FileNotFoundError:
            return []

    # ----- writing ---------------------------------------------------------------------------
    def writer(
        self,
        table: str,
        *,
        writer_id: str | None = None,
        flush_rows: int = 1000,
        flush_seconds: float = 30.0,
    ) -> "StoreWriter":
        """A buffered :class:`StoreWriter` for ``table`` (use it as a context manager)."""
        return StoreWriter(
            self, table, writer_id=writer_id, flush_rows=flush_rows, flush_seconds=flush_seconds
        )

    def write_part(self, table: str, run_id: str, data: pa.Table, *, writer_id: str, seq: int) -> str:
        """Write ``data`` (rows of one run) as one new immutable part; return its path.

        Local: written to ``<final>.tmp`` then renamed (atomic on POSIX); remote: one PUT.
        """
        pdir = self.partition_dir(table, run_id)
        name = f"part-{_sanitize(writer_id)}-{seq:06d}-{uuid.uuid4().hex[:12]}.parquet"
        final = f"{pdir}/{name}"
        buf = pa.BufferOutputStream()
        pq.write_table(data, buf, compression="zstd")
        payload = buf.getvalue().to_pybytes()
        if self.is_local:
            self.fs.makedirs(pdir, exist_ok=True)
            tmp = final + ".tmp"  # not matched by the *.parquet globs
            with self.fs.open(tmp, "wb") as f:
                f.write(payload)
            self.fs.mv(tmp, final)
        else:
            self.fs.pipe_file(final, payload)
        return final

    # ----- reading ---------------------------------------------------------------------------
    def view_sql(self, table: str) -> str:
        """SELECT statement of the deduplicated view of ``table`` (assumes parts exist)."""
        spec = self.spec(table)
        glob = self._url(f"{self.table_dir(table)}/run_id=*/*.parquet")
        cols = ", ".join(
            f'CAST("{f.name}" AS {_duck_type(f.type)}) AS "{f.name}"' for f in spec.schema
        )
        src = (
            f"read_parquet('{_sql_str(glob)}', hive_partitioning=true, union_by_name=true, "
            "filename=true, hive_types={'run_id': VARCHAR})"
        )
        return (
            f"SELECT {cols} FROM {src} QUALIFY row_number() OVER "
            "(PARTITION BY run_id, row_id ORDER BY time DESC, filename DESC) = 1"
        )

    def empty_view_sql(self, table: str) -> str:
        """SELECT statement of a view with the table's columns and zero rows."""
        spec = self.spec(table)
        cols = ", ".join(f'CAST(NULL AS {_duck_type(f.type)}) AS "{f.name}"' for f in spec.schema)
        return f"SELECT {cols} WHERE false"

    def connect(self, con: duckdb.DuckDBPyConnection | None = None) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection (new in-memory one unless ``con``) with one view per table.

        Views are deduplicated by ``(run_id, row_id)`` keeping the latest ``time``. A table that
        has no part yet gets an empty view with the right columns; such a view is fixed at connect
        time, so reconnect to see tables created afterwards (views over existing tables always see
        new parts). Remote roots are read through fsspec (``register_filesystem``).
        """
        con = con if con is not None else duckdb.connect()
        con.execute("SET TimeZone = 'UTC'")
        if not self.is_local:
            con.register_filesystem(self.fs)
        for table in self.tables:
            sql = self.view_sql(table) if self.list_parts(table) else self.empty_view_sql(table)
            con.execute(f'CREATE OR REPLACE VIEW "{table}" AS {sql}')
        return con

    def compact(self, table: str, run_id: str, *, writer_id: str = "compact") -> str | None:
        """Merge a run's parts of ``table`` into one deduplicated part, then delete the inputs.

        Safe with concurrent readers (they dedup by row id while both copies exist) and with a
        concurrent writer (only the parts listed before reading are deleted). Returns the new
        part's path, or None when there were fewer than two parts.
        """
        parts = self.list_parts(table, run_id)
        if len(parts) < 2:
            return None
        spec = self.spec(table)
        con = duckdb.connect()
        if not self.is_local:
            con.register_filesystem(self.fs)
        files = ", ".join(f"'{_sql_str(self._url(p))}'" for p in parts)
        cols = ", ".join(
            f'CAST("{f.name}" AS {_duck_type(f.type)}) AS "{f.name}"' for f in spec.schema
        )
        rel = con.sql(
            f"SELECT {cols} FROM read_parquet([{files}], union_by_name=true, filename=true) "
            "QUALIFY row_number() OVER (PARTITION BY row_id ORDER BY time DESC, filename DESC) = 1 "
            "ORDER BY time"
        )
        to_arrow = getattr(rel, "to_arrow_table", None) or rel.arrow  # duckdb 2.x / 1.x
        data = to_arrow().cast(spec.schema)
        con.close()
        out = self.write_part(table, run_id, data, writer_id=writer_id, seq=0)
        for p in parts:
            self.fs.rm_file(p)
        return out


def _sql_str(s: str) -> str:
    return s.replace("'", "''")


def _duck_type(t: pa.DataType) -> str:
    if pa.types.is_string(t):
        return "VARCHAR"
    if pa.types.is_int64(t):
        return "BIGINT"
    if pa.types.is_int32(t):
        return "INTEGER"
    if pa.types.is_float64(t):
        return "DOUBLE"
    if pa.types.is_float32(t):
        return "FLOAT"
    if pa.types.is_boolean(t):
        return "BOOLEAN"
    if pa.types.is_timestamp(t):
        return "TIMESTAMPTZ" if t.tz else "TIMESTAMP"
    raise TypeError(f"no DuckDB type mapping for {t}")


class StoreWriter:
    """Buffers rows of one table and writes them as immutable Parquet parts.

    A flush happens when ``flush_rows`` rows are buffered, when a write arrives ``flush_seconds``
    or more after the oldest buffered row (checked on write, no background thread), on
    :meth:`flush`, and on :meth:`close` / leaving the ``with`` block (also on an exception, so
    rows written before a crash are kept). One flush writes one part per run id.

    Rows are dicts keyed by the table's columns. Missing ``time`` -> now (UTC); missing
    ``row_id`` -> derived from the table's natural key (e.g. metrics:
    ``make_row_id(run_id, step, name)``), so re-writing the same metric dedups in the views.
    A row id written twice into one buffer keeps the last row. A flush that fails (e.g. a
    transient S3 error) keeps the rows buffered; the next flush re-writes them, and parts already
    written for some runs are harmless duplicates the views drop. Not thread-safe: one writer
    per thread.

    Raises:
        StoreError: unknown column, missing required column, wrong value type, invalid run id,
            a value outside a column's choices, or writing after close.
    """

    def __init__(
        self,
        store: ParquetStore,
        table: str,
        *,
        writer_id: str | None = None,
        flush_rows: int = 1000,
        flush_seconds: float = 30.0,
    ):
        self.store = store
        self.table = table
        self.spec = store.spec(table)
        self.writer_id = _sanitize(writer_id or uuid.uuid4().hex[:8])
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
        rec = self._normalize({**(row or {}), **columns})
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
        """Write buffered rows now (one part per run id); return the new parts' paths."""
        if not self._buf:
            return []
        by_run: dict[str, list[dict[str, Any]]] = {}
        for rec in self._buf.values():
            by_run.setdefault(rec["run_id"], []).append(rec)
        written = []
        for run_id, recs in by_run.items():
            data = pa.Table.from_pylist(recs, schema=self.spec.schema)
            written.append(
                self.store.write_part(self.table, run_id, data, writer_id=self.writer_id, seq=self._seq)
            )
            self._seq += 1
            self.rows_written += len(recs)
        self._buf.clear()
        self._oldest = None
        self.parts_written.extend(written)
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

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ----- helpers -----------------------------------------------------------------------------
    def _normalize(self, row: Mapping[str, Any]) -> dict[str, Any]:
        schema = self.spec.schema
        unknown = [k for k in row if schema.get_field_index(k) < 0]
        if unknown:
            raise StoreError(
                f"table {self.table!r}: unknown column(s) {unknown}; columns: {schema.names}"
            )
        rec: dict[str, Any] = {}
        for f in schema:
            rec[f.name] = _coerce(self.table, f.name, f.type, row.get(f.name))
        for col in self.spec.required:
            if rec[col] is None:
                raise StoreError(f"table {self.table!r}: column {col!r} is required (row {dict(row)!r})")
        validate_run_id(rec["run_id"])
        for col, allowed in self.spec.choices.items():
            if rec[col] is not None and rec[col] not in allowed:
                raise StoreError(
                    f"table {self.table!r}, column {col!r}: {rec[col]!r} not one of {list(allowed)}"
                )
        if rec["time"] is None:
            rec["time"] = _now()
        if rec["row_id"] is None:
            key = self.spec.natural_key
            if key and all(rec[k] is not None for k in key):
                rec["row_id"] = make_row_id(*(rec[k] for k in key))
            else:
                rec["row_id"] = uuid.uuid4().hex
        return rec
