"""Signed, expiring download URLs of the local Tinker server (external weights, session traces).

A URL is ``{base}/downloads/{kind}/{key}/{file}?expires=<unix s>&sig=<hex>`` where ``sig`` is
HMAC-SHA256, under a per-server secret, of ``kind``, ``key``, ``file`` and ``expires``.  Like a
cloud storage signed URL it needs no API key: whoever holds it may GET that one file until it
expires.  The secret lives in ``<root>/server/url_secret`` (32 random bytes, mode 0600), so URLs
stay valid across a restart until they expire.  The server never takes a filesystem path from a
URL: it verifies the signature, then looks the file up among those it would list itself.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path
from urllib.parse import quote

DEFAULT_URL_TTL_S = 3600.0  # the hosted service's signed URLs last about an hour


class SignatureError(ValueError):
    """A download URL whose signature does not match (tampered) or whose time has passed."""


def load_secret(root: Path) -> bytes:
    """The URL signing secret of the server rooted at ``root`` (created on first use)."""
    path = Path(root) / "server" / "url_secret"
    try:
        data = path.read_bytes()
        if len(data) >= 32:
            return data
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".url_secret.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
    try:
        os.link(tmp, path)  # first writer wins when two processes race
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_bytes()


class UrlSigner:
    """Makes and checks signed download URLs.  ``clock``: time source (Unix seconds)."""

    def __init__(self, secret: bytes, clock=time.time):
        self._secret = secret  # also keys the JWTs (auth.JwtIssuer derives its own key)
        self.clock = clock

    def _sig(self, kind: str, key: str, file: str, expires: int) -> str:
        msg = "\n".join((kind, key, file, str(expires))).encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def url(self, base: str, kind: str, key: str, file: str, expires: int) -> str:
        """The signed URL of ``file`` (a relative path with ``/``) of object ``key`` of ``kind``
        (``key`` may hold ``/``: the route names its parts)."""
        return (
            f"{base.rstrip('/')}/downloads/{quote(kind, safe='')}/{quote(key, safe='/:')}/"
            f"{quote(file, safe='/')}?expires={expires}&sig={self._sig(kind, key, file, expires)}"
        )

    def expiry(self, ttl_s: float = DEFAULT_URL_TTL_S) -> int:
        """Unix second at which URLs signed now for ``ttl_s`` seconds expire."""
        return int(self.clock() + ttl_s)

    def check(self, kind: str, key: str, file: str, expires: str | None, sig: str | None) -> None:
        """Raise ``SignatureError`` unless ``sig`` signs these values and ``expires`` is ahead."""
        try:
            exp = int(expires or "")
        except ValueError:
            raise SignatureError("download URL has no valid 'expires' parameter") from None
        if not sig or not hmac.compare_digest(self._sig(kind, key, file, exp), sig):
            raise SignatureError(
                "download URL signature does not match (the URL was altered, or signed by another server)"
            )
        if exp <= self.clock():
            raise SignatureError("download URL has expired; ask the server for a fresh one")
