"""Where an export goes: a local folder (staged next to it, then renamed into place) or an
``s3://bucket/prefix`` (files uploaded through s3fs with the stores' settings:
:func:`tinker_blocks.store_config.resolve_storage_options`, i.e. the ``AWS_*`` environment; transient
errors retried by :func:`tinker_blocks.s3.retry_call`; the metadata file goes last, so a prefix
without ``export_metadata.json`` is an unfinished upload).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

__all__ = ["METADATA_FILE", "ExportOutput"]

METADATA_FILE = "export_metadata.json"
_REMOTE_SCHEMES = ("s3://", "s3a://")


class ExportOutput:
    """An export destination.

    Args:
        out: a local folder, or ``s3://bucket/prefix``.
        retry_seconds: how long S3 calls retry transient errors.

    Raises:
        ValueError: another URL scheme, or an S3 URL without a prefix below the bucket.
    """

    def __init__(self, out: str, *, retry_seconds: float = 300.0):
        self.out, self.retry_seconds = str(out), retry_seconds
        self.remote = self.out.startswith(_REMOTE_SCHEMES)
        if "://" in self.out and not self.remote:
            raise ValueError(f"out: {out!r}: give a local folder or an s3://bucket/prefix URL")
        if self.remote:
            import fsspec

            from tinker_blocks.store_config import resolve_storage_options

            bucket_path = self.out.split("://", 1)[1].strip("/")
            if "/" not in bucket_path:
                raise ValueError(f"out: {out!r}: give a prefix below the bucket (s3://bucket/models/name)")
            self.fs = fsspec.filesystem("s3", **resolve_storage_options(self.out))
            self.path = bucket_path
        else:
            self.fs = None
            self.path = str(Path(self.out).expanduser().resolve())

    @property
    def uri(self) -> str:
        """The asset key: ``s3://bucket/prefix`` or ``file:///absolute/folder``."""
        return f"s3://{self.path}" if self.remote else Path(self.path).as_uri()

    def _call(self, fn, what: str):
        from tinker_blocks.s3 import retry_call

        return retry_call(fn, what=f"{what} ({self.uri})", deadline_s=self.retry_seconds)

    # ----- before the work ----------------------------------------------------------------
    def sizes(self) -> dict[str, int]:
        """``{relative name: bytes}`` of every file already there (empty when nothing is).

        Raises:
            FileExistsError: a local ``out`` that is a file or a symlink.
        """
        if not self.remote:
            p = Path(self.path)
            if not p.exists():
                return {}
            if not p.is_dir() or p.is_symlink():
                raise FileExistsError(f"out: {self.path} exists and is not a folder")
            return {str(q.relative_to(p)): q.stat().st_size for q in sorted(p.rglob("*")) if q.is_file()}
        try:
            found = self._call(lambda: self.fs.find(self.path, detail=True), "listing the export prefix")
        except FileNotFoundError:
            return {}
        return {
            f[len(self.path) + 1 :]: int(info.get("size") or 0)
            for f, info in sorted(found.items())
            if f.startswith(self.path + "/") and info.get("type") != "directory"
        }

    def existing(self) -> list[str]:
        """Relative names of what is already there."""
        return sorted(self.sizes())

    def check(self, overwrite: bool) -> None:
        """Fail now when the destination cannot be written (a probe is written and removed) or
        holds files and ``overwrite`` is false.

        Raises:
            FileExistsError: files are there (names a few) and ``overwrite`` is false.
            StoreAccessError: S3 refused the credentials or the write. PermissionError / OSError:
                a local folder that cannot be created or written.
        """
        there = self.existing()
        if there and not overwrite:
            raise FileExistsError(
                f"out: {self.uri} already holds {len(there)} files ({', '.join(there[:5])}); "
                "choose another out or set overwrite=true"
            )
        probe = f".export-probe-{uuid.uuid4().hex}"
        if self.remote:
            self._call(lambda: self.fs.pipe_file(f"{self.path}/{probe}", b"ok"), "writing a probe object")
            try:
                self.fs.rm_file(f"{self.path}/{probe}")
            except OSError:
                pass
            return
        parent = Path(self.path).parent
        parent.mkdir(parents=True, exist_ok=True)
        (parent / probe).write_bytes(b"ok")
        (parent / probe).unlink()

    def staging_dir(self) -> Path:
        """A new empty folder to build the export in: next to a local destination (same
        filesystem, so publishing is a rename), in the temp folder for S3."""
        if self.remote:
            return Path(tempfile.mkdtemp(prefix="export-"))
        dest = Path(self.path)
        return Path(tempfile.mkdtemp(prefix=f".{dest.name}.export-", dir=dest.parent))

    # ----- after the work ------------------------------------------------------------------
    def publish(self, staged: Path, overwrite: bool) -> None:
        """Move the finished export ``staged`` into place (a local rename; S3: upload every
        file, ``export_metadata.json`` last, then remove older files the new export lacks).

        Raises:
            FileExistsError: files appeared at the destination meanwhile and ``overwrite`` is false.
        """
        if self.existing() and not overwrite:
            raise FileExistsError(f"out: {self.uri} got files while the export ran; not overwritten")
        if not self.remote:
            dest = Path(self.path)
            old = None
            if dest.exists():
                old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex[:8]}")
                os.rename(dest, old)
            os.rename(staged, dest)
            if old is not None:
                shutil.rmtree(old)
            return
        before = set(self.existing())
        names = sorted(str(p.relative_to(staged)) for p in staged.rglob("*") if p.is_file())
        names.sort(key=lambda n: n == METADATA_FILE)  # the metadata last: its presence means complete
        if METADATA_FILE in before:  # an older export's marker goes first: no mixed state looks complete
            self._call(lambda: self.fs.rm_file(f"{self.path}/{METADATA_FILE}"), "removing the old metadata")
        for name in names:
            src, dst = staged / name, f"{self.path}/{name}"
            self._call(lambda src=src, dst=dst: self.fs.put_file(str(src), dst), f"uploading {name}")
            size = self._call(lambda dst=dst: self.fs.info(dst)["size"], f"checking {name}")
            if size != src.stat().st_size:
                raise OSError(f"{self.uri}/{name}: uploaded {size} bytes of {src.stat().st_size}")
        for stale in sorted(before - set(names)):
            self._call(lambda stale=stale: self.fs.rm_file(f"{self.path}/{stale}"), f"removing stale {stale}")
        shutil.rmtree(staged, ignore_errors=True)

    def read_metadata(self) -> dict[str, Any] | None:
        """The destination's ``export_metadata.json``, or None when absent or unreadable."""
        try:
            if self.remote:
                text = self._call(lambda: self.fs.cat_file(f"{self.path}/{METADATA_FILE}"), "reading the metadata")
            else:
                text = (Path(self.path) / METADATA_FILE).read_bytes()
            return json.loads(text)
        except (OSError, ValueError):
            return None
