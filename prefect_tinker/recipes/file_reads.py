"""Local data files read once per run: a run opens :func:`reading_once`, and inside it each data
file's bytes are read once (:func:`open_data_file`) and hashed once (:func:`files_sha256`), so the
records and the data fingerprint of a run come from one content of a file that changes on disk."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

__all__ = ["files_sha256", "open_data_file", "reading_once"]


@dataclass
class _Reads:
    """The files read inside one :func:`reading_once` block: bytes and sha256 per resolved file path,
    and the content digest of each local directory hashed."""

    data: dict[Path, bytes] = field(default_factory=dict)
    digests: dict[Path, str] = field(default_factory=dict)

    def read(self, path: Path) -> bytes:
        key = path.resolve()
        if key not in self.data:
            self.data[key] = key.read_bytes()
        return self.data[key]

    def sha256(self, path: Path) -> str:
        key = path.resolve()
        if key not in self.digests:
            self.digests[key] = hashlib.sha256(self.read(key)).hexdigest()
        return self.digests[key]


_READS: ContextVar[_Reads | None] = ContextVar("prefect_tinker_source_reads", default=None)


def open_data_file(path: Path) -> BinaryIO:
    """``path`` opened for reading bytes: inside a :func:`reading_once` block its kept bytes (read
    once per run), else the file on disk. The caller closes it (``with open_data_file(p) as fh``)."""
    reads = _READS.get()
    return io.BytesIO(reads.read(path)) if reads is not None else open(path, "rb")  # noqa: SIM115


@contextmanager
def reading_once() -> Iterator[None]:
    """Inside the block each local data file is opened once: its bytes are kept, its sha256 is
    computed once, and every later read (records, fingerprints) of that path uses them, so one
    run reads one consistent content of a file that changes on disk meanwhile. A local
    directory's content digest is computed once (its files streamed, not kept). A run session
    opens this block for the run; outside it files are streamed from disk on every read.

    The kept bytes cost memory of the size of the run's local data files (their records are held
    in memory for training anyway). Nested blocks share the outer block's reads.
    """
    if _READS.get() is not None:
        yield
        return
    token = _READS.set(_Reads())
    try:
        yield
    finally:
        _READS.reset(token)


def files_sha256(files: list[Path], base: Path | None) -> str:
    """sha256 hex of one file's bytes (``base`` None), or of a directory's ``files``: each one's
    path relative to ``base`` and its bytes. Inside a :func:`reading_once` block a file's digest
    and a directory's are computed once."""
    reads = _READS.get()
    if reads is not None and base is None and len(files) == 1:  # one file: the digest of its bytes, kept
        return reads.sha256(files[0])
    if reads is not None and base is not None and base.resolve() in reads.digests:  # a directory hashed before
        return reads.digests[base.resolve()]
    h = hashlib.sha256()
    for f in files:  # streamed: a directory's files (images, ...) are not kept in memory
        if base is not None:
            h.update(str(f.relative_to(base)).encode() + b"\0")
        with open(f, "rb") as fh:
            while block := fh.read(1 << 20):
                h.update(block)
    if reads is not None and base is not None:
        reads.digests[base.resolve()] = h.hexdigest()
    return h.hexdigest()
