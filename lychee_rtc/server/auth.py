"""Who may do what over HTTP: the server key and per-session resource tokens.

* The server key (``server.auth_token``), when configured, is needed to create sessions and for
  the admin views (the session list); it also opens every session's resource.
* Each session has its own secret, returned with its answer (``session_token``, and for WHIP the
  resource URL itself). It is needed for that session's follow-ups - GET/DELETE
  ``/v1/sessions/{id}``, PATCH/DELETE on the WHIP resource, a resume - whether or not a server key
  is configured, and it opens nothing else. Calls that no client was given a token for (carrier
  streams, SIP gateway calls) are opened by the server key, like the admin views.

Secrets are made and compared (in constant time) by ``calls.tokens``. A route's policy is declared on its handler with one of the
decorators below; an undecorated ``/v1/`` or ``/whip`` route needs the server key.
"""

from __future__ import annotations

from enum import Enum
from typing import Awaitable, Callable, TypeVar

from aiohttp import web

from lychee_rtc.calls.tokens import secret_matches


class Policy(str, Enum):
    SERVER_KEY = "server_key"  # the server key, when one is configured
    SESSION = "session"  # the session's own token, or the server key (checked by the handler)
    CLIENT_SECRET = "client_secret"  # the server key or an ephemeral ek_ key (checked by the handler)
    OPEN = "open"  # nobody needs a key


H = TypeVar("H", bound=Callable[[web.Request], Awaitable[web.StreamResponse]])


def policy(kind: Policy) -> Callable[[H], H]:
    def mark(handler: H) -> H:
        handler.auth_policy = kind  # type: ignore[attr-defined]
        return handler
    return mark


def policy_of(request: web.Request) -> Policy:
    handler = request.match_info.handler
    declared = getattr(handler, "auth_policy", None)
    if declared is not None:
        return declared
    return Policy.SERVER_KEY if request.path.startswith(("/v1/", "/whip")) else Policy.OPEN


def bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def has_server_key(request: web.Request, server_key: str | None) -> bool:
    """True when no server key is configured, or the request presents it."""
    return server_key is None or secret_matches(bearer(request), server_key)


def is_admin(request: web.Request, server_key: str | None) -> bool:
    """Only a configured server key, presented, makes an admin (never the open mode)."""
    return server_key is not None and secret_matches(bearer(request), server_key)


def may_use_session(request: web.Request, session_token: str | None, server_key: str | None) -> bool:
    """A session's own resource. A call that no client holds a token for (a carrier's or a SIP
    gateway's) is the operator's: like the admin views, it needs the server key when one is set."""
    if session_token is None:
        return has_server_key(request, server_key)
    return secret_matches(bearer(request), session_token) or is_admin(request, server_key)
