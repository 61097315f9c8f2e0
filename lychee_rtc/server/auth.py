"""Who may do what over HTTP: the server key, and the secrets that open one session.

Every route declares one ``Access`` (``server.route_table``), and the HTTP edge checks it before
the handler runs, so no body is read, no socket opened and no slot taken for a caller who may not:

* ``OPEN``: anyone (health, metrics, the web pages).
* ``CREATE``: starts something new (an offer, a placed call): the server key when one is configured,
  anyone when none is. A route may admit one more credential (an ``ek_`` client key for a realtime
  call, a session's own token for a resume), checked before its body is read.
* ``ADMIN``: every session's business (the session and recording lists, minting client keys): the
  server key; without one, only a server that listens on loopback (local development) answers, and
  one that others can reach refuses with 403.
* ``SESSION``: reads or acts on one session: its own secret (the ``session_token``, a WHIP resource
  URL, the ``ek_`` key that opened the call while it lasts) or the server key, in every mode: a
  session id is a name, never a credential. A session no client was given a secret for (a
  carrier's stream, a call the SIP gateway answered) is opened by the server key only.
* ``CARRIER``: a carrier's media stream, authenticated the carrier's own way (``telephony.auth``)
  before the socket opens.

Secrets are made and compared (in constant time) by ``calls.tokens``.
"""

from __future__ import annotations

import ipaddress
from enum import Enum

from aiohttp import web

from lychee_rtc.calls.tokens import secret_matches
from lychee_rtc.config import Settings


class Access(str, Enum):
    OPEN = "open"
    CREATE = "create"
    ADMIN = "admin"
    SESSION = "session"
    CARRIER = "carrier"


def bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        return None
    return value.strip()


def is_admin(request: web.Request, server_key: str | None) -> bool:
    """Only a configured server key, presented, makes an admin (never the open mode)."""
    return server_key is not None and secret_matches(bearer(request), server_key)


def has_server_key(request: web.Request, server_key: str | None) -> bool:
    """True when no server key is configured, or the request presents it (what ``CREATE`` asks)."""
    return server_key is None or is_admin(request, server_key)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def keyless_is_local(settings: Settings) -> bool:
    """No server key, and nobody but this machine can connect: local development."""
    return settings.server.auth_token is None and is_loopback(settings.server.host)
