"""Damaged parts and leftover temporaries of a store: found, skipped, listed, moved aside.

A part that cannot be read (cut short, zero bytes, overwritten with garbage) would make every
DuckDB query over its table fail, and with it every run and table of the store. Reads stay fast
and still survive such a part:

- nothing is validated while queries succeed (no part is opened twice);
- when a query, a view or a compaction fails with a DuckDB error naming a Parquet file, that file
  is read whole with pyarrow (:func:`validate_part`); when it is unreadable it joins this
  process's list of damaged parts (:func:`known_damaged`), a warning names it, and the work is
  run again without it (:func:`retry_damaged`). Views over a table with a damaged part list the
  other parts explicitly instead of globbing;
- :func:`~tinker_blocks.store_repair.check_root` (``prefect-tinker store check``) reads every part
  of every table of a root and lists the unreadable ones and the leftover temporaries of dead
  writers (:func:`tinker_blocks.atomic.is_orphan`); :func:`~tinker_blocks.store_repair.repair_root`
  (``store repair``) moves them into ``<root>/_quarantine/<time>/`` under their relative paths,
  with a ``manifest.json`` (nothing is
  deleted), after which the store reads as before the damage minus those rows.

When a failing read names no file, every part not validated yet by this process is read;
validated parts are remembered by ``(path, size, mtime or ETag)``. ``store check`` reads every
part each time. Works for local folders and ``s3://`` roots alike (fsspec).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "QUARANTINE_DIR",
    "HealthReport",
    "PartStore",
    "Problem",
    "find_damaged",
    "forget_parts",
    "fs_path",
    "is_damage_error",
    "known_damaged",
    "list_parts",
    "retry_damaged",
    "scan_parts",
    "validate_part",
]


class PartStore(Protocol):
    """What the health checks read of a store (:class:`tinker_blocks.store_io.ParquetStore`):
    its filesystem, root and tables."""

    @property
    def fs(self) -> Any: ...
    @property
    def root(self) -> str: ...
    @property
    def tables(self) -> Mapping[str, Any]: ...
    def table_dir(self, table: str) -> str: ...


log = logging.getLogger(__name__)
T = TypeVar("T")

#: folder under a store root where ``store repair`` moves what it takes out of the store
QUARANTINE_DIR = "_quarantine"
_QUOTED_PARQUET = re.compile(r"'([^'*?\[\]]+\.parquet)'")
_lock = threading.Lock()
_damaged: dict[str, str] = {}  # fs path -> reason (process-wide)
_good: set[tuple[str, Any, Any]] = set()  # (fs path, size, mtime/etag) read whole without error
_warned: set[str] = set()


@dataclass
class Problem:
    """One thing ``store check`` found: ``kind`` ``"damaged"`` (an unreadable part) or
    ``"orphan"`` (a temporary left by a dead writer), its path inside the filesystem, its size in
    bytes and the reason."""

    kind: str
    path: str
    size: int | None
    reason: str

    def as_row(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "size": self.size, "reason": self.reason}


@dataclass
class HealthReport:
    """What :func:`check_root` found under ``root``: ``problems``, and how many parts it read."""

    root: str
    parts_checked: int = 0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _short(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0].replace("Could not open Parquet input source '<Buffer>': ", "")[
        :200
    ]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def validate_part(fs: Any, path: str) -> str | None:
    """None when the Parquet file ``path`` (inside ``fs``) reads whole with pyarrow (footer,
    schema, every page), else the reason it does not (e.g. ``"ArrowInvalid: Parquet magic bytes
    not found in footer..."``). A file that vanished meanwhile (compacted away) counts as fine."""
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be read: {_short(exc)}"
    if not data:
        return "empty file (0 bytes)"
    try:
        pq.read_table(pa.BufferReader(data))
    except Exception as exc:  # pyarrow raises ArrowInvalid, OSError, ... for damaged files
        return _short(exc)
    return None


def known_damaged(paths: Iterable[str] | None = None) -> dict[str, str]:
    """The damaged parts found so far in this process (path -> reason), those among ``paths``
    when given."""
    with _lock:
        if paths is None:
            return dict(_damaged)
        return {p: _damaged[p] for p in paths if p in _damaged}


def _mark(path: str, reason: str, root: str) -> bool:
    with _lock:
        new = path not in _damaged
        _damaged[path] = reason
        warn = path not in _warned
        _warned.add(path)
    if warn:
        log.warning(
            "skipping the unreadable part %s (%s); the rest of the store is read as usual. "
            "'prefect-tinker store repair --store %s' moves it aside",
            path,
            reason,
            root,
        )
    return new


def warn_skipped(paths: Iterable[str], root: str) -> None:
    """Log (once per path and process) that the damaged ``paths`` are left out of a view."""
    for p in paths:
        with _lock:
            reason = _damaged.get(p, "unreadable")
        _mark(p, reason, root)


def is_damage_error(exc: BaseException) -> bool:
    """True for a DuckDB error that may come from an unreadable Parquet file: not a SQL error
    (catalog, binder, parser), not a part deleted by a concurrent compaction, and naming a
    ``.parquet`` file or speaking of Parquet."""
    import duckdb

    from tinker_blocks.s3 import is_missing_part_error

    if (
        not isinstance(exc, duckdb.Error)
        or isinstance(exc, (duckdb.CatalogException, duckdb.BinderException, duckdb.ParserException))
        or is_missing_part_error(exc)
    ):
        return False
    msg = str(exc)
    return bool(_QUOTED_PARQUET.search(msg)) or "parquet" in msg.lower() or "magic bytes" in msg.lower()


def fs_path(fs: Any, url: str) -> str:
    """``url`` as a path of the filesystem ``fs`` (protocol stripped; local paths unchanged)."""
    return fs._strip_protocol(url) if "://" in url else url


def forget_parts(paths: Iterable[str]) -> None:
    """Forget what this process found about the parts ``paths`` (damaged or validated): the next
    scan reads them again."""
    paths = set(paths)
    with _lock:
        for path in paths:
            _damaged.pop(path, None)
        _good.difference_update({k for k in _good if k[0] in paths})


def scan_parts(fs: Any, entries: Mapping[str, Mapping[str, Any]], root: str) -> list[Problem]:
    """Read each part of ``entries`` (fs path -> its listing entry: ``size``, ``mtime`` /
    ``LastModified`` / ``ETag``) not already validated in this process; return the damaged ones
    (also marked as damaged for the readers)."""
    problems = []
    for path, info in sorted(entries.items()):
        key = (path, info.get("size"), info.get("mtime") or info.get("ETag") or info.get("LastModified"))
        with _lock:
            if key in _good:
                continue
            known = _damaged.get(path)
        reason = known if known is not None else validate_part(fs, path)
        if reason is None:
            with _lock:
                _good.add(key)
            continue
        _mark(path, reason, root)
        problems.append(Problem("damaged", path, info.get("size"), reason))
    return problems


def list_parts(io: PartStore) -> dict[str, dict[str, Any]]:
    """Every ``.parquet`` part of every table of ``io``: fs path -> its listing entry."""
    found: dict[str, dict[str, Any]] = {}
    for table in io.tables:
        try:
            hits = io.fs.glob(f"{io.table_dir(table)}/**/*.parquet", detail=True)
        except FileNotFoundError:
            continue
        found.update({fs_path(io.fs, k): v for k, v in hits.items() if k.endswith(".parquet")})
    return found


def find_damaged(exc: BaseException, stores: Sequence[PartStore]) -> list[str]:
    """The parts newly found damaged after ``exc`` (a failed read of ``stores``, which share one
    filesystem): the ``.parquet`` files the error names, each read whole; when it names none,
    every part of the stores not validated yet. [] when the error does not come from a part."""
    if not stores or not is_damage_error(exc):
        return []
    fs, root = stores[0].fs, stores[0].root
    named = [fs_path(fs, m) for m in _QUOTED_PARQUET.findall(str(exc))]
    if named:
        new = []
        for path in dict.fromkeys(named):
            if path in known_damaged([path]):
                continue
            reason = validate_part(fs, path)
            if reason is not None and _mark(path, reason, root):
                new.append(path)
        return new
    entries: dict[str, dict[str, Any]] = {}
    for io in stores:
        entries.update(list_parts(io))
    return [p.path for p in scan_parts(fs, entries, root)]


def retry_damaged(
    fn: Callable[[], T],
    stores: Sequence[PartStore],
    *,
    attempts: int = 32,
    before_retry: Callable[[], None] | None = None,
) -> T:
    """``fn()``, run again (after ``before_retry()``) each time it fails on a part that
    :func:`find_damaged` then finds unreadable: ``fn`` must read through views or listings that
    leave out :func:`known_damaged` parts. Any other error, or a damage error whose part reads
    fine, is raised as is."""
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if attempt >= attempts or not find_damaged(exc, stores):
                raise
            if before_retry is not None:
                before_retry()
    raise AssertionError("unreachable")
