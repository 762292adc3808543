"""Whole-store checks and repairs: ``prefect-tinker store check|repair`` and a resuming run's scan.

:func:`check_root` reads every part of every table of the training, eval and capture stores under a
root and lists the unreadable ones and the leftover temporaries of dead writers
(:func:`tinker_blocks.atomic.is_orphan`); :func:`repair_root` moves them into
``<root>/_quarantine/<time>/`` with a ``manifest.json`` (nothing is deleted); :func:`scan_run`
reads the parts of one run. The damage bookkeeping they share with every read is
:mod:`tinker_blocks.store_health`.
"""

from __future__ import annotations

import datetime as _dt
import json
from collections.abc import Mapping
from typing import Any

from tinker_blocks.atomic import atomic_write_bytes, is_orphan
from tinker_blocks.store_config import resolve_storage_options
from tinker_blocks.store_health import (
    QUARANTINE_DIR,
    HealthReport,
    Problem,
    forget_parts,
    fs_path,
    list_parts,
    scan_parts,
)
from tinker_blocks.store_io import STORES, ParquetStore, validate_run_id

__all__ = ["check_root", "repair_root", "scan_run"]


def scan_run(store: Any, run_id: str) -> list[Problem]:
    """Read every part of ``run_id`` in every table of ``store`` (a store block or a
    :class:`~tinker_blocks.store_io.ParquetStore`) not validated yet by this process; return the
    unreadable ones (then skipped by every read). For a run session to say, when it resumes,
    that some of the run's rows are lost and it resumes from the last checkpoint it can read."""
    from tinker_blocks.stores import StoreBlock

    io = store.parquet_store() if isinstance(store, StoreBlock) else store
    validate_run_id(run_id)
    entries: dict[str, dict[str, Any]] = {}
    for table in io.tables:
        try:
            hits = io.fs.glob(f"{io.partition_dir(table, run_id)}/*.parquet", detail=True)
        except FileNotFoundError:
            continue
        entries.update({fs_path(io.fs, k): v for k, v in hits.items() if k.endswith(".parquet")})
    return scan_parts(io.fs, entries, io.root)


def _stores_of(root: str, storage_options: Mapping[str, Any] | None) -> list[ParquetStore]:
    opts = resolve_storage_options(root, storage_options)
    return [ParquetStore(root, name, storage_options=opts) for name in STORES]


def _orphans(io: ParquetStore) -> list[Problem]:
    try:
        found = io.fs.find(io.bucket_path, detail=True)
    except FileNotFoundError:
        return []
    out = []
    quarantine = f"{io.bucket_path}/{QUARANTINE_DIR}/"
    for path, info in sorted(found.items()):
        path = fs_path(io.fs, path)
        if path.startswith(quarantine) or not path.endswith(".tmp"):
            continue
        mtime = info.get("mtime") or info.get("LastModified")
        if isinstance(mtime, _dt.datetime):
            mtime = mtime.timestamp()
        if is_orphan(path.rsplit("/", 1)[-1], mtime):
            out.append(Problem("orphan", path, info.get("size"), "temporary of a dead or long-gone writer"))
    return out


def check_root(root: str, storage_options: Mapping[str, Any] | None = None) -> HealthReport:
    """Read every part of every table of the training, eval and capture stores under ``root``
    and find the leftover temporaries; return a :class:`HealthReport` (nothing is changed).

    Raises:
        StoreAccessError / StoreUnavailableError: the root cannot be listed.
    """
    stores = _stores_of(root, storage_options)
    report = HealthReport(root=root)
    entries: dict[str, dict[str, Any]] = {}
    for io in stores:
        entries.update(list_parts(io))
    report.parts_checked = len(entries)
    # every part again, even those validated before by this process: a check is a full read
    report.problems = _rescan(stores[0].fs, entries, root) + _orphans(stores[0])
    return report


def _rescan(fs: Any, entries: Mapping[str, Mapping[str, Any]], root: str) -> list[Problem]:
    forget_parts(entries)
    return scan_parts(fs, entries, root)


def repair_root(
    root: str, storage_options: Mapping[str, Any] | None = None, report: HealthReport | None = None
) -> tuple[HealthReport, str | None]:
    """Move what :func:`check_root` finds (``report`` when given) into
    ``<root>/_quarantine/<UTC time>/<path relative to root>`` and write a ``manifest.json``
    there (original path, kind, size, reason of each). Nothing is deleted. Returns the report and
    the quarantine folder (None when there was nothing to move).

    Raises:
        WriteError / OSError: a move failed (the message names the path); what moved stays moved.
    """
    stores = _stores_of(root, storage_options)
    report = report if report is not None else check_root(root, storage_options)
    if report.ok:
        return report, None
    io = stores[0]
    fs, base = io.fs, io.bucket_path
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")
    dest_root = f"{base}/{QUARANTINE_DIR}/{stamp}"
    moved = []
    for p in report.problems:
        rel = p.path[len(base) + 1 :] if p.path.startswith(base + "/") else p.path.lstrip("/")
        dest = f"{dest_root}/{rel}"
        try:
            fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
            fs.mv(p.path, dest)
        except FileNotFoundError:
            continue  # gone meanwhile (compacted, or removed by its next writer)
        except OSError as exc:
            raise OSError(exc.errno, f"moving {p.path} to {dest}: {exc.strerror or exc}", p.path) from exc
        forget_parts([p.path])
        moved.append({**p.as_row(), "moved_to": dest})
    if not moved:
        return report, None
    manifest = json.dumps({"root": root, "time": stamp, "moved": moved}, indent=2).encode()
    atomic_write_bytes(fs, f"{dest_root}/manifest.json", manifest, local=io.is_local)
    for s in stores:
        s.fs.invalidate_cache()
    return report, (dest_root if io.is_local else io.url(dest_root))
