"""API keys of a shared ``tinker_local`` server: one named key per user, stored hashed.

``<root>/server/api_keys.json`` (mode 0600) maps a user name to ``{"sha256": hex digest of the key,
"created": ISO-8601 UTC time, "admin": bool}``.  A key is ``tml-`` (the prefix the tinker SDK
requires) followed by 32 random bytes in URL-safe base64 (``secrets.token_urlsafe``, 256 bits), so
one unsalted SHA-256 (FIPS 180-4) is enough to store it: no dictionary or brute-force attack on a
256-bit random secret is feasible, and a per-request check costs microseconds (a slow password hash
such as scrypt is for low-entropy passwords).  The key itself is printed once by ``keys add`` and
never stored, logged or recorded.

A running server re-reads the file when its modification time changes, so ``keys add`` / ``keys
revoke`` take effect on the next request without a restart.

The names the server uses itself (``tinker_local.tenancy.RESERVED_USERS``: ``local``, the one user
of a server without keys) cannot be given to a key, in any letter case; an entry with such a name
written into the file by hand is ignored (logged once), so its key is refused like an unknown one.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from .tenancy import RESERVED_USERS
from .watched_json import WatchedJson

logger = logging.getLogger("tinker_local.server")

KEY_PREFIX = "tml-"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")


class KeyStoreError(ValueError):
    """A key operation the caller got wrong (bad or duplicate name, unknown name)."""


@dataclass(frozen=True)
class KeyEntry:
    """One user's key: ``name`` (the user), ``created`` (ISO-8601 UTC), ``admin`` (may read the
    audit log)."""

    name: str
    created: str
    admin: bool


def keys_file(root: Path | str) -> Path:
    """Where the server rooted at ``root`` keeps its key hashes."""
    return Path(root) / "server" / "api_keys.json"


def reserved(name: str) -> bool:
    """Whether ``name`` is one the server uses itself (no key may take it)."""
    return name.lower() in RESERVED_USERS


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class KeyStore:
    """The key hashes of one server root; thread-safe; re-reads the file when it changes."""

    def __init__(self, root: Path | str):
        self.path = keys_file(root)
        self._file = WatchedJson(self.path, mode=0o600)
        self._lock = threading.Lock()
        self._entries: dict[str, dict] = {}
        self._by_digest: dict[str, KeyEntry] = {}

    def _refresh_locked(self) -> None:
        changed, entries = self._file.load_if_changed()
        if not changed:
            return
        if not isinstance(entries, dict):
            raise ValueError(f"{self.path}: expected a JSON object of name -> key record")
        self._entries = entries
        for n in entries:
            if reserved(n):
                logger.warning("%s: ignoring the key named %r: the server uses that name itself", self.path, n)
        self._by_digest = {
            e["sha256"]: KeyEntry(n, e.get("created", ""), bool(e.get("admin")))
            for n, e in entries.items()
            if not reserved(n)
        }

    def _write_locked(self) -> None:
        self._file.write(self._entries)  # re-read (and re-indexed) on the next access

    def entries(self) -> list[KeyEntry]:
        """Every key's record (no secrets), sorted by name."""
        with self._lock:
            self._refresh_locked()
            return sorted(self._by_digest.values(), key=lambda e: e.name)

    def any(self) -> bool:
        """Whether at least one key exists (then every caller must present one)."""
        with self._lock:
            self._refresh_locked()
            return bool(self._by_digest)

    def lookup(self, key: str) -> KeyEntry | None:
        """The record of ``key``, or None for an unknown or revoked key (constant-time compare)."""
        if not key.startswith(KEY_PREFIX):
            return None
        digest = _digest(key)
        with self._lock:
            self._refresh_locked()
            for known, entry in self._by_digest.items():
                if hmac.compare_digest(known, digest):
                    return entry
        return None

    def add(self, name: str, admin: bool = False) -> str:
        """Create the key of user ``name`` and return it (the only time it is seen).

        Raises:
            KeyStoreError: ``name`` is not 1-64 characters of letters, digits, ``_.-`` (first a letter
                or digit), is a name the server uses itself (``local``), or already has a key (revoke
                it first).
        """
        if not NAME_RE.match(name):
            raise KeyStoreError(
                f"key name {name!r}: use 1-64 letters, digits, '_', '.', '-' (starting with a letter or digit)"
            )
        if reserved(name):
            raise KeyStoreError(f"key name {name!r} is reserved: the server uses it itself; pick another name")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        with self._lock:
            self._refresh_locked()
            if name in self._entries:
                raise KeyStoreError(f"a key named {name!r} exists already (revoke it first)")
            self._entries[name] = {
                "sha256": _digest(key),
                "admin": bool(admin),
                "created": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            self._write_locked()
        return key

    def revoke(self, name: str) -> None:
        """Delete the key of ``name``; ``KeyStoreError`` when there is none."""
        with self._lock:
            self._refresh_locked()
            if name not in self._entries:
                raise KeyStoreError(f"no key named {name!r} in {self.path}")
            del self._entries[name]
            self._write_locked()
