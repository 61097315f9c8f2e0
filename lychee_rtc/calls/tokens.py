"""A call's secrets: the session token its client holds and the WHIP resource id (a capability).

Made and compared here, below the HTTP edge that checks them and the transports that hand them out.
"""

from __future__ import annotations

import hmac
import secrets

SESSION_TOKEN_PREFIX = "stok_"
WHIP_RESOURCE_PREFIX = "whip_"


def new_session_token() -> str:
    return SESSION_TOKEN_PREFIX + secrets.token_urlsafe(32)


def new_whip_resource(prefix: str = "") -> str:
    """``prefix``: the worker id part a cluster entry routes by (``w3-``), as in session ids."""
    return WHIP_RESOURCE_PREFIX + prefix + secrets.token_urlsafe(24)


def secret_matches(presented: str | None, expected: str | None) -> bool:
    """Constant-time comparison; a missing secret never matches."""
    if not presented or not expected:
        return False
    return hmac.compare_digest(presented.encode("utf-8"), expected.encode("utf-8"))
