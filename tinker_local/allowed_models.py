"""The base models a shared ``tinker_local`` server may load: its admin's allow-list.

``<root>/server/allowed_models.json`` (written by ``prefect-tinker local models allow NAME|PATH``,
``models deny NAME``; ``models list`` shows it) holds ``{"models": {name: {"added": ISO-8601 UTC}}}``.
On a server with API keys, a request naming a base model (``create_model``, a load that creates a
model, a sampling session or a sampling request) is refused with HTTP 403 unless the model is on
the list or was preloaded by ``serve --model``; a server without keys (one loopback user) loads
any model.  A running server re-reads the file when it changes.

A requested name is compared as a string with the names each allowed model is known by (the name
as allowed, its canonical name, the local directory handed to SDK clients, its tokenizer
directory; paths normalised), so a refused name never makes the server look at the file system.
"""

from __future__ import annotations

import os
import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .errors import HttpError
from .models import SMOLLM2_ALIASES
from .watched_json import WatchedJson


def allow_file(root: Path | str) -> Path:
    """Where the server rooted at ``root`` keeps its allow-list."""
    return Path(root) / "server" / "allowed_models.json"


def _norm(name: str) -> str:
    """``name`` as compared: paths (``/``, ``./``, ``../``, ``~``) normalised, hub ids as they are."""
    if name.startswith(("/", "./", "../", "~")):
        return os.path.normpath(os.path.expanduser(name))
    return name


def _aliases(name: str, cache_dir: Path) -> set[str]:
    """The names base model ``name`` is known by (``name`` itself when it no longer resolves)."""
    from .models import loadable_name, resolve_model

    out = {_norm(name)}
    try:
        spec = resolve_model(name, cache_dir)
        out |= {_norm(spec.name), _norm(loadable_name(name, cache_dir)), _norm(spec.tokenizer_dir)}
        if spec.model_dir:
            out.add(_norm(str(spec.model_dir)))
    except Exception:  # a model that went away: only its own name
        pass
    if name in SMOLLM2_ALIASES:
        out |= set(SMOLLM2_ALIASES)
    return out


class ModelAllowList:
    """The allow-list of the server rooted at ``root``; thread-safe; re-read when the file changes.

    ``preloaded``: names given to ``serve --model`` (allowed too); ``enforced``: a callable telling
    whether to enforce the list now (the server has API keys)."""

    def __init__(self, root: Path | str, preloaded: list[str] | None = None, enforced: Any = None):
        self.root = Path(root)
        self.path = allow_file(root)
        self.preloaded = list(preloaded or [])
        self.enforced = enforced or (lambda: True)
        self._file = WatchedJson(self.path)
        self._lock = threading.Lock()
        self._names: dict[str, dict[str, Any]] = {}
        self._known: set[str] | None = None

    def _refresh_locked(self) -> None:
        changed, data = self._file.load_if_changed()
        if not changed:
            return
        names = data.get("models", {}) if isinstance(data, dict) else None
        if not isinstance(names, dict):
            raise ValueError(f"{self.path}: expected {{'models': {{name: {{...}}}}}}")
        self._names, self._known = names, None

    def _known_locked(self) -> set[str]:
        if self._known is None:
            known: set[str] = set()
            for name in [*self._names, *self.preloaded]:
                known |= _aliases(name, self.root / "models")
            self._known = known
        return self._known

    def names(self) -> dict[str, dict[str, Any]]:
        """The allowed models as listed (name -> ``{"added"}``), sorted by name."""
        with self._lock:
            self._refresh_locked()
            return dict(sorted(self._names.items()))

    def allows(self, name: str) -> bool:
        """Whether base model ``name`` may be loaded now (always, while the list is not enforced)."""
        if not self.enforced():
            return True
        with self._lock:
            self._refresh_locked()
            return _norm(str(name)) in self._known_locked()

    def check(self, name: Any, endpoint: str) -> None:
        """HttpError 403 (one line saying how to allow it) when ``name`` may not be loaded."""
        if not self.allows(str(name)):
            raise HttpError(
                403,
                f"{endpoint}: base model {str(name)[:200]!r} is not allowed on this server; its admin "
                "allows a model with: prefect-tinker local models allow NAME",
            )

    def allow(self, name: str) -> str:
        """Add ``name`` (a preset, hub id in the local cache, or model folder: checked to resolve;
        a folder is stored as its absolute path); returns the name as stored.  Raises the engine's
        ``UnknownModelError`` for a name that does not resolve."""
        from .models import resolve_model

        p = Path(name).expanduser()
        stored = str(p.resolve()) if p.is_dir() else name
        resolve_model(stored, self.root / "models")
        with self._lock:
            self._refresh_locked()
            self._names[stored] = {"added": datetime.now(UTC).isoformat(timespec="seconds")}
            self._write_locked()
        return stored

    def deny(self, name: str) -> str:
        """Remove ``name`` (as listed, or a folder by any path to it); returns the name removed.
        Raises KeyError when it is not on the list."""
        with self._lock:
            self._refresh_locked()
            candidates = [name, str(Path(name).expanduser().resolve())]
            hit = next((c for c in candidates if c in self._names), None)
            if hit is None:
                raise KeyError(f"{name!r} is not on the allow-list {self.path}")
            del self._names[hit]
            self._write_locked()
        return hit

    def _write_locked(self) -> None:
        self._file.write({"models": self._names})  # re-read on the next access
