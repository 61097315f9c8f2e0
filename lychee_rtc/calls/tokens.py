"""A call's secrets: the session token its client holds, the WHIP resource id (a capability), and
the client key (``ek_``) a call was opened with; and what opens a session's resources.

Made and compared here, below the HTTP edge that checks them and the transports that hand them out.
A secret may start with the worker part of a cluster's ids (``w3-``), so that a cluster entry can
route a request by its credential alone without reading its body.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

SESSION_TOKEN_PREFIX = "stok_"
WHIP_RESOURCE_PREFIX = "whip_"


def new_session_token(prefix: str = "") -> str:
    """``prefix``: the worker id part a cluster entry routes by (``w3-``), as in session ids."""
    return SESSION_TOKEN_PREFIX + prefix + secrets.token_urlsafe(32)


def new_whip_resource(prefix: str = "") -> str:
    """``prefix``: the worker id part a cluster entry routes by (``w3-``), as in session ids."""
    return WHIP_RESOURCE_PREFIX + prefix + secrets.token_urlsafe(24)


def is_session_token(value: str | None) -> bool:
    return bool(value) and value.startswith(SESSION_TOKEN_PREFIX)  # type: ignore[union-attr]


def secret_matches(presented: str | None, expected: str | None) -> bool:
    """Constant-time comparison; a missing secret never matches."""
    if not presented or not expected:
        return False
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class ClientKey:
    """The ephemeral client key a call was opened with, kept as a hash: it opens that call's
    resources until it expires, like the session token."""

    digest: str
    expires_at: float  # unix seconds

    @classmethod
    def of(cls, value: str, expires_at: float) -> "ClientKey":
        return cls(digest(value), expires_at)


@dataclass(frozen=True)
class Opener:
    """What opens one session's resources besides the server key. Empty: the server key only (a
    call no client was given a secret for: a carrier's stream, a call the SIP gateway answered)."""

    secrets: tuple[str, ...] = ()  # the session token, the WHIP resource id
    digests: tuple[str, ...] = ()  # secrets kept only as their hash (a recording outlives its call)
    client_key: ClientKey | None = None

    def opens(self, presented: str | None, now: float | None = None) -> bool:
        if not presented:
            return False
        # Every secret is compared (no early exit), so timing tells nothing about which was near.
        matched = False
        for secret in self.secrets:
            matched |= secret_matches(presented, secret)
        presented_digest = digest(presented)
        for kept in self.digests:
            matched |= hmac.compare_digest(presented_digest, kept)
        if self.client_key is not None:
            fresh = (time.time() if now is None else now) < self.client_key.expires_at
            matched |= fresh and hmac.compare_digest(presented_digest, self.client_key.digest)
        return matched
