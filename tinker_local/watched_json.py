"""A JSON file the server re-reads when it changes on disk and writes whole (the API keys, the
model allow-list): edited by ``prefect-tinker local keys|models`` in another process while the
server runs, so every read checks the file's ``(mtime_ns, size)`` stamp first."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

_UNREAD = (-1, -1)  # a stamp no file has: the next load reads


class WatchedJson:
    """The JSON document at ``path``; not thread-safe (its owner holds a lock around each use).

    Args:
        path: the file; it may not exist yet (read as ``{}``).
        mode: permission bits of the file when written (``0o600`` for secrets).
    """

    def __init__(self, path: Path, mode: int = 0o644):
        self.path, self.mode = Path(path), mode
        self._stamp: tuple[int, int] | None = _UNREAD

    def load_if_changed(self) -> tuple[bool, Any]:
        """``(True, document)`` when the file changed (was created, edited or removed) since the last
        load or write, else ``(False, None)``. A missing file is the document ``{}``.

        Raises:
            ValueError: the file is not JSON (``json.JSONDecodeError``).
        """
        try:
            st = self.path.stat()
            stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return False, None
        data = json.loads(self.path.read_text()) if stamp is not None else {}
        self._stamp = stamp
        return True, data

    def write(self, document: Any) -> None:
        """Replace the file with ``document`` whole (a temporary beside it, created with ``mode``,
        renamed over it); the next :meth:`load_if_changed` reads it back."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.stem}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, self.mode)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(document, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._stamp = _UNREAD
