"""API keys and (optional) JWT auth of the local Tinker server.

Default: every ``/api/v1`` request carries ``X-API-Key: tml-...``: one of the server's keys
(``tinker_local.keys``, the key names the user), or on a server without keys any ``tml-`` key from
a loopback caller (user "local").  With JWT auth on (``serve --jwt-auth``, client config
``pjwt_auth_enabled``) the SDK first exchanges its key at ``POST /api/v1/auth/token`` for a
short-lived JWT and then sends that JWT as ``X-API-Key``; ``RestClient.whoami()`` reads the
caller's identity from it.  The JWTs are HS256 (RFC 7519) signed with the server's URL secret;
claims: ``iss`` "tinker_local", ``sub`` "tml:user:<user>" (the user of the exchanged key),
``org_id`` "local", ``email`` "",
``iat``, ``exp`` (``JWT_LIFETIME_S`` later).  A JWT whose signature or expiry fails is answered
401 with ``WWW-Authenticate: Bearer error="invalid_token"``, on which the SDK fetches a new one.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time

JWT_LIFETIME_S = 3600
USER_URN_PREFIX = "tml:user:"
LOCAL_ORG_ID = "local"
_HEADER = {"alg": "HS256", "typ": "JWT"}


class InvalidToken(ValueError):
    """A JWT this server did not sign, or one that has expired."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def is_api_key(key: str) -> bool:
    return key.startswith("tml-")


def looks_like_jwt(key: str) -> bool:
    return key.startswith("eyJ") and key.count(".") == 2


class JwtIssuer:
    """Mints and verifies the server's JWTs.  ``clock``: Unix seconds."""

    def __init__(self, secret: bytes, clock=time.time, lifetime_s: float = JWT_LIFETIME_S):
        self._key = hashlib.sha256(b"tinker_local jwt\n" + secret).digest()  # not the URL key itself
        self.clock = clock
        self.lifetime_s = lifetime_s

    def _sign(self, signing_input: str) -> str:
        return _b64(hmac.new(self._key, signing_input.encode(), hashlib.sha256).digest())

    def mint(self, user: str) -> str:
        """A JWT for user name ``user`` (``sub`` = ``tml:user:<user>``)."""
        now = int(self.clock())
        claims = {
            "iss": "tinker_local",
            "sub": USER_URN_PREFIX + user,
            "org_id": LOCAL_ORG_ID,
            "email": "",
            "iat": now,
            "exp": now + int(self.lifetime_s),
        }
        head = (
            f"{_b64(json.dumps(_HEADER, separators=(',', ':')).encode())}."
            f"{_b64(json.dumps(claims, separators=(',', ':')).encode())}"
        )
        return f"{head}.{self._sign(head)}"

    def verify(self, token: str) -> dict:
        """The claims of ``token``; ``InvalidToken`` when forged, malformed or expired."""
        try:
            head, payload, sig = token.split(".")
            ok = hmac.compare_digest(self._sign(f"{head}.{payload}"), sig)
            claims = json.loads(_unb64(payload)) if ok else None
        except (ValueError, UnicodeDecodeError):
            raise InvalidToken("malformed JWT") from None
        if claims is None:
            raise InvalidToken("JWT signature does not match (not issued by this server)")
        if not isinstance(claims, dict) or float(claims.get("exp", 0)) <= self.clock():
            raise InvalidToken("JWT has expired")
        return claims

    def user_of(self, token: str) -> str:
        """The user name a valid ``token`` was minted for; ``InvalidToken`` as ``verify``."""
        sub = str(self.verify(token).get("sub", ""))
        if not sub.startswith(USER_URN_PREFIX):
            raise InvalidToken("JWT names no tinker_local user")
        return sub[len(USER_URN_PREFIX) :]
