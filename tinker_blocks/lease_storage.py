"""Where a run's lease object lives and how it changes: conditional writes of one small object in
the training store (no Prefect import).  The lease itself (its content, heartbeats, takeover
rules) is :mod:`tinker_blocks.lease`.

:func:`lease_object` gives the object ``<root>/training/_leases/<run_id>.json`` of a store as a
:class:`LocalLeaseFile` or an :class:`S3LeaseObject`; both offer ``read() -> (bytes, version) |
None``, ``create(data) -> version``, ``replace(data, version) -> version`` and ``delete(version)``,
and raise :class:`LeaseConflict` when the object changed since ``version`` was read (or exists, for
``create``), so two racers never both win:

- local folders: created with an exclusive hard link of a complete temporary file (``link(2)``
  fails when the name exists, like ``O_EXCL``, and readers never see a half-written lease);
  replacements and deletions run under an ``flock`` of ``<run_id>.json.lock`` and compare the
  SHA-256 of the bytes they read before (the version). Limit: ``flock`` on network file systems is
  only as good as their lock support (NFSv4: yes; some FUSE mounts: no).
- S3: create with ``If-None-Match: *``; replace and delete with ``If-Match: <ETag>`` (supported by
  AWS S3 since 2024, SeaweedFS, MinIO).  Calls retry transient errors within the store's outage
  window (:meth:`~tinker_blocks.store_io.ParquetStore.call_retrying`).
"""

from __future__ import annotations

import hashlib
import os
from typing import TYPE_CHECKING, Any

from tinker_blocks.atomic import temp_path
from tinker_blocks.store_schemas import validate_run_id

if TYPE_CHECKING:
    from tinker_blocks.store_io import ParquetStore


class LeaseConflict(Exception):
    """The lease changed since it was read (or exists, for a create)."""


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class LocalLeaseFile:
    """The lease object as a file ``path`` of a local folder (version: SHA-256 of its bytes)."""

    def __init__(self, path: str):
        self.path, self.where = path, path
        self.lock_path = path + ".lock"

    def _locked(self):
        import fcntl

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        fh = open(self.lock_path, "a+")
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        return fh  # closing releases the lock

    def read(self) -> tuple[bytes, str] | None:
        try:
            with open(self.path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return None
        return data, _digest(data)

    def _write_tmp(self, data: bytes) -> str:
        tmp = temp_path(self.path)  # under the flock: one at a time; a dead writer's is swept by `store repair`
        with open(tmp, "wb") as fh:
            fh.write(data)
        return tmp

    def create(self, data: bytes) -> str:
        with self._locked():
            tmp = self._write_tmp(data)
            try:
                os.link(tmp, self.path)  # exclusive: fails when the lease exists
            except FileExistsError:
                raise LeaseConflict() from None
            finally:
                os.unlink(tmp)
        return _digest(data)

    def replace(self, data: bytes, version: str) -> str:
        with self._locked():
            cur = self.read()
            if cur is None or cur[1] != version:
                raise LeaseConflict()
            os.replace(self._write_tmp(data), self.path)
        return _digest(data)

    def delete(self, version: str) -> None:
        with self._locked():
            cur = self.read()
            if cur is None or cur[1] != version:
                raise LeaseConflict()
            os.unlink(self.path)


def _precondition_failed(exc: BaseException) -> bool:
    cur: BaseException | None = exc
    while cur is not None:
        resp = getattr(cur, "response", None)
        if isinstance(resp, dict):
            code = (resp.get("Error") or {}).get("Code")
            status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            if status in (409, 412) or code in ("PreconditionFailed", "ConditionalRequestConflict"):
                return True
        if "pre-condition" in str(cur).lower() or "precondition" in str(cur).lower():
            return True
        cur = cur.__cause__ or cur.__context__
    return False


class S3LeaseObject:
    """The lease object at ``path`` (``bucket/key``) of the S3 store ``io`` (version: its ETag)."""

    def __init__(self, io: Any, path: str):
        self.io, self.fs, self.path = io, io.fs, path
        self.where = io.url(path)
        self.bucket, self.key = path.split("/", 1)

    def _call(self, fn, what: str):
        try:
            return self.io.call_retrying(fn, f"{what} the lease {self.where}")
        except OSError as exc:
            if _precondition_failed(exc):
                raise LeaseConflict() from exc
            raise

    def read(self) -> tuple[bytes, str] | None:
        def get():
            self.fs.invalidate_cache(self.path)
            etag = self.fs.info(self.path)["ETag"]  # the ETag first: a change after it fails If-Match
            return self.fs.cat_file(self.path), etag

        try:
            return self._call(get, "reading")
        except FileNotFoundError:
            return None

    def create(self, data: bytes) -> str:
        try:
            out = self._call(lambda: self.fs.pipe_file(self.path, data, mode="create"), "creating")
        except FileNotFoundError:  # no bucket yet
            self.io.create_bucket()
            out = self._call(lambda: self.fs.pipe_file(self.path, data, mode="create"), "creating")
        return out["ETag"]

    def replace(self, data: bytes, version: str) -> str:
        try:
            return self._call(lambda: self.fs.pipe_file(self.path, data, IfMatch=version), "renewing")["ETag"]
        except FileNotFoundError:
            raise LeaseConflict() from None

    def delete(self, version: str) -> None:
        self._call(
            lambda: self.fs.call_s3("delete_object", Bucket=self.bucket, Key=self.key, IfMatch=version), "releasing"
        )
        self.fs.invalidate_cache(self.path)


def _training_io(store: Any) -> ParquetStore:
    from tinker_blocks.store_io import ParquetStore
    from tinker_blocks.stores import StoreBlock

    io = store.parquet_store() if isinstance(store, StoreBlock) else store
    if isinstance(io, ParquetStore):
        return (
            io
            if io.store == "training"
            else ParquetStore(io.root, "training", storage_options=io.storage_options, retry_seconds=io.retry_seconds)
        )
    return ParquetStore(str(store), "training")


def lease_object(store: Any, run_id: str) -> LocalLeaseFile | S3LeaseObject:
    """The lease object of ``run_id`` in the training store of ``store`` (a store block, a
    ``ParquetStore`` or a root path / URL); :class:`~tinker_blocks.store_schemas.StoreError` for an
    invalid run id."""
    io = _training_io(store)
    path = f"{io.base}/_leases/{validate_run_id(run_id)}.json"
    return LocalLeaseFile(path) if io.is_local else S3LeaseObject(io, path)
