"""A read-side part cache for DuckDB queries of a store on S3 (:class:`PartCacheFS`).

The store's Parquet parts are immutable and small; DuckDB opens each twice per query and reads them
one after another. This fsspec filesystem wraps the store's own (s3fs) and serves whole small parts
from memory, fetching the next parts of a listing concurrently.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.implementations.memory import MemoryFile

__all__ = ["PartCacheFS"]


class PartCacheFS(AbstractFileSystem):
    """A read-side fsspec filesystem for DuckDB over another one (s3fs) that keeps whole small
    files in memory and fetches the next ones concurrently.

    DuckDB opens each Parquet file twice per query (schema, then data) and reads the files one
    after the other; s3fs fetches the whole file on each open. So a query costs two sequential
    GETs per part, and a repeated query as many again. Parts are immutable, so:

    - files up to ``max_file_bytes`` are fetched whole, once, and served from an LRU of at most
      ``max_total_bytes`` (a repeated query reads no byte again);
    - a miss also fetches, concurrently, the next uncached files of the listing DuckDB globbed
      (up to ``readahead_files`` files and ``readahead_bytes`` bytes): DuckDB reads them next
      unless a filter on ``run_id`` prunes them, which bounds the waste to one read-ahead.

    Larger files and all other calls go to the wrapped filesystem. Thread-safe.
    """

    cachable = False  # one per DuckDB connection; never shared through fsspec's instance cache

    def __init__(
        self,
        inner: Any,
        max_file_bytes: int = 16 << 20,
        max_total_bytes: int = 256 << 20,
        readahead_files: int = 32,
        readahead_bytes: int = 32 << 20,
    ):
        super().__init__()
        self.inner = inner
        self.protocol = inner.protocol
        self.max_file_bytes = int(max_file_bytes)
        self.max_total_bytes = int(max_total_bytes)
        self.readahead_files = int(readahead_files)
        self.readahead_bytes = int(readahead_bytes)
        self._lru: OrderedDict[str, bytes] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()  # guards the LRU and the listings
        self._fetch_lock = threading.Lock()  # one read-ahead at a time (each is concurrent inside)
        self._listing: dict[str, tuple[list[str], int]] = {}  # path -> (its glob result, index)
        self._info: dict[str, dict[str, Any]] = {}  # path -> its entry in the last listing
        self.fetches = 0  # files fetched (for tests and benchmarks)

    def _strip_protocol(self, path: str) -> str:
        return self.inner._strip_protocol(path)

    def glob(self, path: str, **kwargs: Any) -> Any:
        if kwargs.get("detail"):
            return self.inner.glob(path, **kwargs)
        found = self.inner.glob(path, detail=True, **kwargs)
        entries = {self._strip_protocol(k): v for k, v in found.items()}
        order = sorted(entries)
        with self._lock:
            for i, p in enumerate(order):
                self._listing[p] = (order, i)
                self._info[p] = entries[p]
        return order

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        """From the last listing when the file was in it (parts are immutable), else asked."""
        key = self._strip_protocol(path)
        with self._lock:
            found = self._info.get(key)
        return dict(found) if found is not None else self.inner.info(path, **kwargs)

    def size(self, path: str) -> int | None:
        return self.info(path).get("size")

    def modified(self, path: str) -> Any:
        found = self.info(path)
        when = found.get("LastModified") or found.get("mtime")
        return when if when is not None else self.inner.modified(path)

    def _size(self, key: str) -> int | None:
        try:
            return self.size(key)
        except OSError:
            return None

    def _get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._lru.get(key)
            if data is not None:
                self._lru.move_to_end(key)
            return data

    def _batch(self, key: str) -> list[str]:
        """``key`` and the uncached small files listed after it (the read-ahead)."""
        batch, total = [key], 0
        with self._lock:
            order, i = self._listing.get(key, ([key], 0))
            cached = set(self._lru)
        for p in order[i + 1 :]:
            if len(batch) > self.readahead_files:
                break
            if p in cached:
                continue
            size = self._size(p)
            if size is None or size > self.max_file_bytes or total + size > self.readahead_bytes:
                break
            batch.append(p)
            total += size
        return batch

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode != "rb":
            return self.inner.open(path, mode, **kwargs)
        key = self._strip_protocol(path)
        data = self._get(key)
        if data is None:
            size = self._size(key)
            if size is None or size > self.max_file_bytes:
                return self.inner.open(path, mode, **kwargs)
            with self._fetch_lock:
                data = self._get(key)  # another thread's read-ahead may have brought it
                if data is None:
                    batch = self._batch(key)
                    got = self.inner.cat(batch, on_error="omit") if len(batch) > 1 else {}
                    data = got.get(key)
                    if data is None:
                        data = self.inner.cat_file(key)
                    got[key] = data
                    self._store(got)
        return MemoryFile(None, key, data)

    def _store(self, got: Mapping[str, Any]) -> None:
        with self._lock:
            for p, b in got.items():
                if isinstance(b, (bytes, bytearray)) and p not in self._lru:
                    self._lru[p] = bytes(b)
                    self._total += len(b)
                    self.fetches += 1
            while self._total > self.max_total_bytes and len(self._lru) > 1:
                _, old = self._lru.popitem(last=False)
                self._total -= len(old)


def _delegate(name: str):
    def method(self: PartCacheFS, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.inner, name)(*args, **kwargs)

    method.__name__ = name
    return method


for _name in (
    "ls",
    "exists",
    "isfile",
    "isdir",
    "created",
    "ukey",
    "checksum",
    "find",
    "cat_file",
    "pipe_file",
    "rm_file",
    "rm",
    "mkdir",
    "makedirs",
    "mv",
    "copy",
    "put_file",
    "get_file",
    "invalidate_cache",
):
    setattr(PartCacheFS, _name, _delegate(_name))
