"""How each carrier proves who it is, checked before any audio is taken.

Carriers cannot all send the same header (``docs/telephony.md``): Twilio signs the stream URL
(``X-Twilio-Signature``: base64 HMAC-SHA1 of the URL, keyed with the account's auth token), Telnyx
sends a streaming auth-token header, Exotel Basic credentials, Vonage whatever ``Authorization``
the NCCO sets (a bearer token here), and Plivo can only put a token in its stream's
``extraHeaders``, which arrive in its start frame. Everything is compared in constant time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from dataclasses import dataclass
from typing import Mapping
from urllib.parse import urlsplit, urlunsplit

from lychee_rtc.config import TelephonySettings

TWILIO_SIGNATURE = "X-Twilio-Signature"
TELNYX_TOKEN = "x-telnyx-streaming-auth-token"


@dataclass(frozen=True)
class Admission:
    """The outcome of the upgrade request's credentials."""

    carriers: frozenset[str]  # carriers whose credentials the request proved
    plivo_pending: bool = False  # no header credential, but Plivo may still prove itself in its start frame
    refusal: str | None = None  # why the request is refused (None: let it upgrade)


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def twilio_signature(auth_token: str, url: str) -> str:
    digest = hmac.new(auth_token.encode(), url.encode(), hashlib.sha1).digest()
    return base64.b64encode(digest).decode("ascii")


def url_variants(url: str) -> list[str]:
    """The URL as given, and with the default port added or removed: signers differ on it."""
    parts = urlsplit(url)
    default = {"wss": 443, "https": 443, "ws": 80, "http": 80}.get(parts.scheme)
    out = [url]
    host = parts.hostname or ""
    if parts.port is None and default is not None:
        out.append(urlunsplit(parts._replace(netloc=f"{host}:{default}")))
    elif parts.port == default:
        out.append(urlunsplit(parts._replace(netloc=host)))
    return out


def check_request(headers: Mapping[str, str], urls: list[str], settings: TelephonySettings,
                  carrier: str | None = None) -> Admission:
    """Which carriers this upgrade request authenticates as (``carrier``: the one the URL names)."""
    proved: set[str] = set()
    presented = False
    signature = headers.get(TWILIO_SIGNATURE)
    if signature is not None:
        presented = True
        token = settings.twilio.auth_token
        if token and any(_same(signature, twilio_signature(token, v)) for u in urls for v in url_variants(u)):
            proved.add("twilio")
    telnyx = headers.get(TELNYX_TOKEN)
    if telnyx is not None:
        presented = True
        if settings.telnyx.token and _same(telnyx, settings.telnyx.token):
            proved.add("telnyx")
    authorization = headers.get("Authorization")
    if authorization is not None:
        presented = True
        scheme, _, value = authorization.partition(" ")
        value = value.strip()
        if scheme.lower() == "basic" and settings.exotel.username is not None:
            try:
                user, _, password = base64.b64decode(value, validate=True).decode("utf-8").partition(":")
            except (binascii.Error, ValueError):
                user, password = "", ""
            if _same(user, settings.exotel.username) and _same(password, settings.exotel.password or ""):
                proved.add("exotel")
        elif scheme.lower() == "bearer" and settings.vonage.token and _same(value, settings.vonage.token):
            proved.add("vonage")
    if carrier is not None:
        proved &= {carrier}
    if proved:
        return Admission(frozenset(proved))
    if presented:
        return Admission(frozenset(), refusal="the credentials presented are not valid for this endpoint")
    if settings.plivo.token and carrier in (None, "plivo"):
        return Admission(frozenset(), plivo_pending=True)
    return Admission(frozenset(), refusal="no carrier credentials (signature, token header, Basic or Bearer)")


def plivo_token_ok(parameters: Mapping[str, str], settings: TelephonySettings) -> bool:
    token = settings.plivo.token
    given = parameters.get(settings.plivo.header)
    return bool(token) and given is not None and _same(given, token)
