"""Append-only Parquet stores queried with DuckDB (no Prefect import; the blocks wrap this).

Layout of a store under ``root`` (a local folder or an fsspec URL such as ``s3://bucket/prefix``)::

    <root>/<store>/<table>/run_id=<id>/part-<writer>-<seq>-<uuid>.parquet

Every part is immutable: it is written once (local: to ``<final>.tmp`` then renamed; remote: one
PUT of the whole file), never appended to or overwritten, so readers never see a partial file.
Every row carries a ``row_id``; readers keep one row per ``(run_id, row_id)`` -- the one with the
latest ``time`` -- so re-writing a row (a re-run after a crash) or compacting parts (write the
merged part, then delete the inputs) never shows duplicates.

Remote writes and listings retry transient errors (server down, timeouts, 5xx) with backoff for
up to ``retry_seconds`` (see :mod:`tinker_blocks.s3`); a retried PUT re-sends the same bytes under
the same key. ``s3://`` roots without explicit ``storage_options`` use the AWS environment
variables (:func:`tinker_blocks.s3.s3_storage_options`).

Tables are declared as :class:`TableSpec` (:mod:`tinker_blocks.store_schemas`); :data:`STORES`
maps each store name (``training``, ``eval``, ``capture``) to its tables.  The default root, the
outage window and a root's fsspec options: :mod:`tinker_blocks.store_config`; merging a run's
parts: :mod:`tinker_blocks.store_compaction`.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import duckdb
import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from tinker_blocks.atomic import atomic_write_bytes, sweep_stale_temps
from tinker_blocks.part_cache import PartCacheFS
from tinker_blocks.s3 import (
    StoreAccessError,
    StoreUnavailableError,
    attach_filesystem,
    execute_once,
    is_access_error,
    retry_call,
    retry_missing_part,
)
from tinker_blocks.store_config import default_retry_seconds, resolve_storage_options
from tinker_blocks.store_health import known_damaged, retry_damaged, warn_skipped
from tinker_blocks.store_schemas import (
    CAPTURE_TABLES,
    CAPTURES_SCHEMA,
    CHECKPOINTS_SCHEMA,
    EVAL_RESULTS_SCHEMA,
    EVAL_SAMPLES_SCHEMA,
    EVAL_TABLES,
    METRICS_SCHEMA,
    RUNS_SCHEMA,
    STORES,
    TRAINING_TABLES,
    StoreError,
    TableSpec,
    make_row_id,
    validate_run_id,
)
from tinker_blocks.store_writer import StoreWriter, sanitize_writer_id
from tinker_blocks.view_sql import deduplicated_select, empty_select

__all__ = [
    "TableSpec",
    "STORES",
    "TRAINING_TABLES",
    "EVAL_TABLES",
    "CAPTURE_TABLES",
    "METRICS_SCHEMA",
    "CHECKPOINTS_SCHEMA",
    "RUNS_SCHEMA",
    "EVAL_RESULTS_SCHEMA",
    "EVAL_SAMPLES_SCHEMA",
    "CAPTURES_SCHEMA",
    "ParquetStore",
    "StoreWriter",
    "make_row_id",
    "validate_run_id",
    "StoreError",
    "StoreAccessError",
    "StoreUnavailableError",
]

T = TypeVar("T")


class ParquetStore:
    """A store of append-only Parquet tables under ``<root>/<store>/``.

    Args:
        root: local folder or fsspec URL (``s3://bucket/prefix``); created on first write.
        store: store name (``"training"``, ``"eval"``, ``"capture"``).
        tables: table name -> :class:`TableSpec` (default: ``STORES[store]``).
        storage_options: keyword arguments for the fsspec filesystem (s3fs: ``key``, ``secret``,
            ``endpoint_url``, ...); default for ``s3://``: the AWS environment variables.
        retry_seconds: the outage window: how long the remote store's writes, reads (listings,
            queries) and lease renewals retry transient errors (server down, timeouts, 5xx)
            before raising :class:`StoreUnavailableError`; default :func:`default_retry_seconds`
            (``$PREFECT_TINKER_STORE_RETRY_SECONDS``, else 300).
        retry_max_wait: the longest pause between two tries (they start at 0.2 s and double).

    Raises:
        StoreError: empty root or unknown store name without ``tables``.
    """

    def __init__(
        self,
        root: str,
        store: str,
        tables: Mapping[str, TableSpec] | None = None,
        storage_options: Mapping[str, Any] | None = None,
        *,
        retry_seconds: float | None = None,
        retry_max_wait: float = 5.0,
    ):
        if not root:
            raise StoreError("store root is empty: give a local folder or an s3:// URL")
        if tables is None:
            if store not in STORES:
                raise StoreError(f"unknown store {store!r}; stores: {sorted(STORES)}")
            tables = STORES[store]
        self.root = str(root)
        self.store = store
        self.tables = dict(tables)
        self.storage_options = resolve_storage_options(self.root, storage_options)
        self.retry_seconds = default_retry_seconds() if retry_seconds is None else float(retry_seconds)
        self.retry_max_wait = float(retry_max_wait)
        self.fs, base = fsspec.core.url_to_fs(self.root, **self.storage_options)
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.bucket_path = base.rstrip("/")
        self.base = f"{self.bucket_path}/{store}"  # path inside the filesystem (no protocol)
        self.read_cache: PartCacheFS | None = None  # the read cache of the last attach()

    def __repr__(self) -> str:
        return f"ParquetStore(root={self.root!r}, store={self.store!r})"

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

    def url(self, path: str) -> str:
        """Path as DuckDB must see it: plain for local files, ``proto://path`` otherwise."""
        if self.is_local:
            return path
        proto = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{proto}://{path}"

    def _where(self) -> str:
        endpoint = self.storage_options.get("endpoint_url")
        return f"store {self.root!r}" + (f" (endpoint {endpoint})" if endpoint else "")

    def call_retrying(self, fn: Callable[[], T], what: str, deadline_s: float | None = None) -> T:
        """``fn()``, a call to the remote store, retried on transient errors for up to
        ``deadline_s`` (default :attr:`retry_seconds`) by :func:`~tinker_blocks.s3.retry_call`,
        which says an outage of this store once when it starts and once when it ends.

        Raises:
            StoreAccessError: wrong credentials / forbidden (also when raised as another type).
            StoreUnavailableError: still failing transiently at the deadline (one line).
        """
        deadline = self.retry_seconds if deadline_s is None else deadline_s
        try:
            return retry_call(
                fn,
                what=f"{what} ({self._where()})",
                deadline_s=deadline,
                max_wait_s=self.retry_max_wait,
                where=self._where(),
            )
        except StoreAccessError:
            raise
        except Exception as exc:
            if is_access_error(exc):  # e.g. an access error raised as a non-transient type
                raise StoreAccessError(f"{what} ({self._where()}): access denied: {exc}") from exc
            raise

    def list_parts(self, table: str, run_id: str | None = None, *, fresh: bool = False) -> list[str]:
        """Paths (inside the filesystem) of the table's visible parts, sorted; [] when none.
        ``fresh`` (with ``run_id``, on S3): list the bucket itself, not s3fs's listing cache, which
        a concurrent reader sharing the filesystem may have filled before the latest write.

        Raises :class:`StoreAccessError` (wrong credentials) or :class:`StoreUnavailableError`.
        """
        # "**" lists a prefix flat (one LIST per 1,000 keys); "run_id=*/" would list each folder
        where = f"{self.partition_dir(table, run_id)}/*.parquet" if run_id else f"{self.table_dir(table)}/**/*.parquet"

        def glob() -> list[str]:
            try:
                if fresh and run_id and not self.is_local:
                    found = self.fs.ls(self.partition_dir(table, run_id), detail=False, refresh=True)
                else:
                    found = self.fs.glob(where)
                return sorted(p for p in found if p.endswith(".parquet"))
            except FileNotFoundError:
                return []

        if self.is_local:
            return glob()
        return self.call_retrying(glob, f"listing {table!r}")

    # ----- writing ---------------------------------------------------------------------------
    def writer(
        self,
        table: str,
        *,
        writer_id: str | None = None,
        flush_rows: int = 1000,
        flush_seconds: float = 30.0,
    ) -> StoreWriter:
        """A buffered :class:`StoreWriter` for ``table`` (use it as a context manager)."""
        return StoreWriter(self, table, writer_id=writer_id, flush_rows=flush_rows, flush_seconds=flush_seconds)

    def write_part(self, table: str, run_id: str, data: pa.Table, *, writer_id: str, seq: int) -> str:
        """Write ``data`` (rows of one run) as one new immutable part; return its path.

        Local: written to a temporary ``<final>.<host>-<pid>.tmp`` then renamed (atomic on POSIX;
        see :mod:`tinker_blocks.atomic`); remote: one PUT, retried on transient errors under the
        same key with the same bytes.

        Raises:
            WriteError: a local write failed (full disk: ``errno.ENOSPC``); names the part's path,
                no temporary is left.
            StoreAccessError: wrong credentials / forbidden.
            StoreUnavailableError: transient errors until ``retry_seconds`` passed.
        """
        pdir = self.partition_dir(table, run_id)
        name = f"part-{sanitize_writer_id(writer_id)}-{seq:06d}-{uuid.uuid4().hex[:12]}.parquet"
        final = f"{pdir}/{name}"
        buf = pa.BufferOutputStream()
        pq.write_table(data, buf, compression="zstd")
        payload = buf.getvalue().to_pybytes()
        if self.is_local:  # temporary + rename; a dead writer's leftovers go on the first write here
            sweep_stale_temps(pdir)
            atomic_write_bytes(None, final, payload, local=True)
        else:
            what = f"writing the part {self.url(final)}"
            try:
                self.call_retrying(lambda: self.fs.pipe_file(final, payload), what)
            except FileNotFoundError:  # NoSuchBucket: like a local root, created on first write
                self.create_bucket()
                self.call_retrying(lambda: self.fs.pipe_file(final, payload), what)
        return final

    def create_bucket(self, deadline_s: float | None = None) -> None:
        """Create the root's bucket; :class:`StoreAccessError` when that is refused."""
        bucket = self.bucket_path.split("/", 1)[0]
        try:
            self.call_retrying(lambda: self.fs.mkdir(bucket), f"creating bucket {bucket!r}", deadline_s)
        except FileExistsError:
            pass  # created meanwhile by another writer
        except (StoreAccessError, StoreUnavailableError):
            raise
        except OSError as exc:
            raise StoreAccessError(
                f"{self._where()}: bucket {bucket!r} does not exist and could not be created: {exc}"
            ) from exc

    def check_access(self, *, create_bucket: bool = True, deadline_s: float = 30.0) -> None:
        """Verify the store can be written, listed and read now: PUT a small probe object under
        ``<root>/<store>/_access_check/``, list it, delete it. Call before long work.

        For S3 a missing bucket is created when ``create_bucket`` (else an error).

        Raises:
            StoreAccessError: wrong or missing credentials, no permission, missing bucket, or a
                local root that is not a writable folder. The message names the root and the
                endpoint, never the secret.
            StoreUnavailableError: the server did not answer within ``deadline_s`` seconds.
        """
        probe_dir = f"{self.base}/_access_check"
        probe = f"{probe_dir}/probe-{uuid.uuid4().hex}"
        if self.is_local:
            try:
                self.fs.makedirs(probe_dir, exist_ok=True)
                self.fs.pipe_file(probe, b"ok")
                self.fs.rm_file(probe)
            except OSError as exc:
                raise StoreAccessError(f"{self._where()} is not a writable folder: {exc}") from exc
            return

        def put() -> None:
            self.fs.pipe_file(probe, b"ok")

        try:
            try:
                self.call_retrying(put, "writing a probe object", deadline_s)
            except FileNotFoundError as exc:  # NoSuchBucket
                if not create_bucket:
                    bucket = self.bucket_path.split("/", 1)[0]
                    raise StoreAccessError(f"{self._where()}: bucket {bucket!r} does not exist") from exc
                self.create_bucket(deadline_s)
                self.call_retrying(put, "writing a probe object", deadline_s)
        except OSError as exc:
            if isinstance(exc, (StoreAccessError, StoreUnavailableError)):
                raise
            raise StoreAccessError(f"{self._where()}: cannot write: {exc}") from exc
        listed = self.call_retrying(lambda: self.fs.ls(probe_dir, detail=False), "listing the probe", deadline_s)
        if probe not in [p.rstrip("/") for p in listed]:
            raise StoreAccessError(f"{self._where()}: a written probe object is not listed back")
        try:
            self.fs.rm_file(probe)
        except OSError:
            pass  # write-only/append-only buckets: the probe stays, harmless (not under a table)

    # ----- reading ---------------------------------------------------------------------------
    def view_sql(self, table: str, *, union_by_name: bool = False, files: Sequence[str] | None = None) -> str:
        """SELECT statement of the deduplicated view of ``table`` (assumes parts exist).

        ``union_by_name`` reads every part's schema when the view is bound (slow over S3);
        :meth:`create_views` uses it only when parts of older and newer schemas are mixed.
        ``files`` (paths inside the filesystem): read these parts instead of globbing the table
        (used to leave damaged parts out)."""
        pattern = self.url(f"{self.table_dir(table)}/**/*.parquet")
        urls = [pattern] if files is None else [self.url(p) for p in files]
        return deduplicated_select(self.spec(table), urls, glob=files is None, union_by_name=union_by_name)

    def empty_view_sql(self, table: str) -> str:
        """SELECT statement of a view with the table's columns and zero rows."""
        return empty_select(self.spec(table))

    def attach(self, con: duckdb.DuckDBPyConnection) -> str:
        """Let ``con`` read this store's files; returns ``"local"``, ``"httpfs"`` or ``"fsspec"``
        (then through a :class:`~tinker_blocks.part_cache.PartCacheFS` kept for :meth:`create_views`)."""
        if self.is_local:
            return "local"
        cache = PartCacheFS(self.fs)
        how = attach_filesystem(con, cache, self.url(self.bucket_path), self.storage_options)
        self.read_cache = cache if how == "fsspec" else None
        return how

    def create_views(self, con: duckdb.DuckDBPyConnection) -> None:
        """Create (or replace) one view per table on ``con`` (already :meth:`attach`-ed)."""
        cache = self.read_cache
        readahead = cache.readahead_files if cache is not None else 0
        if cache is not None:
            cache.readahead_files = 0  # binding a view reads one file: no read-ahead for that
        try:
            self._create_views(con)
        finally:
            if cache is not None:
                cache.readahead_files = readahead

    def _create_views(self, con: duckdb.DuckDBPyConnection) -> None:
        for table in self.tables:  # binding reads a part, which a compaction may delete meanwhile

            def bind(t: str = table) -> None:
                retry_missing_part(lambda: self._create_view(con, t), before_retry=self.fs.invalidate_cache)

            retry_damaged(bind, [self])

    def _create_view(self, con: duckdb.DuckDBPyConnection, table: str) -> None:
        parts = self.list_parts(table)
        damaged = known_damaged(parts)
        files = None
        if damaged:  # list the readable parts instead of globbing the table
            warn_skipped(damaged, self.root)
            parts = files = [p for p in parts if p not in damaged]
        if not parts:
            con.execute(f'CREATE OR REPLACE VIEW "{table}" AS {self.empty_view_sql(table)}')
            return
        if self.spec(table).evolved:  # parts of older and newer schemas may mix
            con.execute(f'CREATE OR REPLACE VIEW "{table}" AS {self.view_sql(table, union_by_name=True, files=files)}')
            return
        try:
            con.execute(f'CREATE OR REPLACE VIEW "{table}" AS {self.view_sql(table, files=files)}')
        except duckdb.BinderException:  # the first part lacks a column added later
            con.execute(f'CREATE OR REPLACE VIEW "{table}" AS {self.view_sql(table, union_by_name=True, files=files)}')

    def connect(self, con: duckdb.DuckDBPyConnection | None = None) -> duckdb.DuckDBPyConnection:
        """A DuckDB connection (new in-memory one unless ``con``) with one view per table.

        Views are deduplicated by ``(run_id, row_id)`` keeping the latest ``time``. A table that
        has no part yet gets an empty view with the right columns; such a view is fixed at connect
        time, so reconnect to see tables created afterwards (views over existing tables always see
        new parts). Remote roots are read through DuckDB's httpfs when it loads, else through
        fsspec (``register_filesystem``); see :func:`tinker_blocks.s3.attach_filesystem`.

        Raises:
            StoreAccessError / StoreUnavailableError: listing the store failed.
        """
        con = con if con is not None else duckdb.connect()
        con.execute("SET TimeZone = 'UTC'")
        self.attach(con)
        self.create_views(con)
        return con

    def query(self, sql: str, params: Sequence[Any] | None = None) -> tuple[list[str], list[tuple]]:
        """``(column names, rows)`` of ``sql`` over this store's views, on a new connection.

        A query that lists a part which a concurrent compaction
        (:func:`~tinker_blocks.store_compaction.compact`) then deletes fails in DuckDB
        ("file not found"); it is run again on a fresh listing (up to 4 times), which sees the
        merged part instead; one that met an S3 outage runs again within :attr:`retry_seconds`.
        Raises ``duckdb.Error`` for bad SQL, StoreAccessError / StoreUnavailableError as
        :meth:`connect`."""
        return self.reading(lambda: execute_once(self.connect, sql, list(params or [])), "querying")

    def reading(self, fn: Callable[[], T], what: str, stores: Sequence[ParquetStore] | None = None) -> T:
        """``fn()``, a read of this store (a query, a frame; of ``stores`` when it reads several on this
        store's file system), the one way reads are guarded:

        - run again on a fresh listing when it failed on a part that a concurrent compaction
          deleted after listing it (:func:`~tinker_blocks.s3.retry_missing_part`, up to 4 times);
        - run again without a part that turned out unreadable, skipped with a warning naming it
          (:func:`~tinker_blocks.store_health.retry_damaged`);
        - remote: run again as a whole on transient errors within :attr:`retry_seconds`
          (:meth:`call_retrying`: DuckDB reads the parts itself, so a read that met an outage runs
          again); a local store has no outage to ride out.
        """

        def guarded() -> T:
            return retry_damaged(
                lambda: retry_missing_part(fn, before_retry=self.fs.invalidate_cache), list(stores or [self])
            )

        return guarded() if self.is_local else self.call_retrying(guarded, what)

    def delete_parts(self, table: str, parts: list[str]) -> None:
        """Delete the parts ``parts`` (paths inside the filesystem, as :meth:`write_part` returns
        them) of ``table``: a compaction's merged inputs, or the rows of a change rolled back
        before anyone relied on them. A part already gone is skipped.

        Raises:
            StoreError: a path outside ``table``'s folder (nothing is deleted).
        """
        outside = [p for p in parts if not p.startswith(self.table_dir(table) + "/")]
        if outside:
            raise StoreError(f"not parts of table {table!r} ({self._where()}): {outside}")
        for p in parts:
            try:
                if self.is_local:
                    self.fs.rm_file(p)
                else:
                    what = f"deleting the part {self.url(p)}"
                    self.call_retrying(functools.partial(self.fs.rm_file, p), what)
            except FileNotFoundError:
                pass  # already gone (merged away by a concurrent compaction)
