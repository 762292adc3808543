"""Whole-or-nothing file writes and their stale temporaries (no Prefect import).

A local write goes to a temporary file next to its target, named
``<target>.<host>-<pid>.tmp``, and is renamed onto the target only when every byte was written
(``os.replace``: atomic on POSIX), so a reader sees the old file or the new one, never a part of
it. A failed write (a full disk, a file-size limit, a vanished folder) removes its temporary and
raises :class:`WriteError` naming the target. A writer killed mid-write leaves its temporary
behind: :func:`is_orphan` tells such a leftover (its writer's process is gone, or it is older
than :data:`STALE_TEMP_AGE_S`) from a write in flight, and :func:`sweep_stale_temps` removes the
leftovers of one folder (the next writer into a folder calls it once per process).

Remote (fsspec, e.g. S3) writes are one PUT of the whole object: atomic by themselves, no
temporary; their errors are raised as :class:`WriteError` naming the URL too.

Durability: the rename makes writes atomic against crashed or killed processes; there is no
``fsync``, so a power loss may lose the last writes (never leave a partial file visible under
its final name on journaled file systems that order data before rename, such as ext4's default).
"""

from __future__ import annotations

import errno as _errno
import logging
import os
import re
import threading
import time
from typing import Any

from tinker_local.procs import host_slug, pid_alive

__all__ = [
    "STALE_TEMP_AGE_S",
    "WriteError",
    "atomic_write_bytes",
    "is_orphan",
    "parse_temp_name",
    "sweep_stale_temps",
    "temp_path",
]

log = logging.getLogger(__name__)

#: a temporary older than this (seconds) is a leftover whatever its writer (a write takes ms)
STALE_TEMP_AGE_S = 3600.0

_TEMP_RE = re.compile(r"\.(?P<host>[A-Za-z0-9_]{1,40})-(?P<pid>\d{1,10})\.tmp$")
_swept: set[str] = set()
_swept_lock = threading.Lock()


class WriteError(OSError):
    """A write failed; ``filename`` is the target path or URL, ``errno`` the system's code
    (``ENOSPC`` for a full disk, ``EFBIG`` past a file-size limit) when there is one. No partial
    file is left under the target's name, and no temporary."""


def temp_path(target: str) -> str:
    """The temporary path a write of ``target`` by this process uses: ``<target>.<host>-<pid>.tmp``
    (never matched by ``*.parquet`` / ``*.png`` globs)."""
    return f"{target}.{host_slug()}-{os.getpid()}.tmp"


def parse_temp_name(name: str) -> tuple[str | None, int | None] | None:
    """``(host, pid)`` of a temporary's name made by :func:`temp_path`, ``(None, None)`` for
    another ``*.tmp`` name (e.g. an older ``<target>.tmp``), None for a name not ending in ``.tmp``."""
    if not name.endswith(".tmp"):
        return None
    m = _TEMP_RE.search(name)
    return (m.group("host"), int(m.group("pid"))) if m else (None, None)


def is_orphan(name: str, mtime: float | None, *, now: float | None = None, max_age_s: float = STALE_TEMP_AGE_S) -> bool:
    """Whether a ``*.tmp`` file is a leftover of a dead writer: written by a process of this host
    that no longer exists, or older than ``max_age_s`` seconds (``mtime`` in epoch seconds; a
    temporary of another host is judged by age only). False for names not ending in ``.tmp`` and
    for this process's own temporaries (a write in flight)."""
    parsed = parse_temp_name(name)
    if parsed is None:
        return False
    host, pid = parsed
    now = time.time() if now is None else now
    if host == host_slug() and pid is not None:
        if pid == os.getpid():
            return False
        if not pid_alive(pid):
            return True
    return mtime is not None and now - mtime > max_age_s


def _as_write_error(exc: OSError, target: str, what: str) -> WriteError:
    code = exc.errno if exc.errno is not None else _errno.EIO
    reason = exc.strerror or str(exc) or type(exc).__name__
    return WriteError(code, f"{what} {target}: {reason}", target)


def atomic_write_bytes(fs: Any, path: str, data: bytes, *, local: bool | None = None) -> str:
    """Write ``data`` to ``path`` whole or not at all; return ``path``.

    ``fs`` is an fsspec filesystem (``path`` inside it, no protocol) or None for a plain local
    path. Local: the bytes go to :func:`temp_path` (the folder is created), which is renamed onto
    ``path``; an existing file there is replaced at once. Remote: one ``pipe_file`` (one PUT).

    Raises:
        WriteError: the write failed (a full disk: ``errno.ENOSPC``); the message names ``path``;
            the temporary is removed.
    """
    if local is None:
        local = fs is None or "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))
    if not local:
        try:
            fs.pipe_file(path, data)
        except OSError as exc:
            raise _as_write_error(exc, path, "writing") from exc
        return path
    folder = os.path.dirname(path) or "."
    tmp = temp_path(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise _as_write_error(exc, path, "writing") from exc
    return path


def sweep_stale_temps(folder: str, *, once: bool = True, max_age_s: float = STALE_TEMP_AGE_S) -> list[str]:
    """Remove the leftover temporaries (:func:`is_orphan`) directly inside local ``folder``;
    return the removed paths. With ``once`` a folder is swept at most once per process (writers
    call it before their first write into a folder). Errors are logged, never raised."""
    folder = os.path.abspath(folder)
    if once:
        with _swept_lock:
            if folder in _swept:
                return []
            _swept.add(folder)
    removed: list[str] = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    now = time.time()
    for e in entries:
        if not e.name.endswith(".tmp"):
            continue
        try:
            if e.is_file(follow_symlinks=False) and is_orphan(e.name, e.stat().st_mtime, now=now, max_age_s=max_age_s):
                os.unlink(e.path)
                removed.append(e.path)
        except OSError as exc:
            log.warning("could not remove the stale temporary %s: %s", e.path, exc)
    if removed:
        log.info("removed %d stale temporary file(s) of dead writers in %s", len(removed), folder)
    return removed
