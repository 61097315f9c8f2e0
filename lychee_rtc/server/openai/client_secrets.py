"""Ephemeral client keys (``ek_…``) for browsers, minted with the server key.

A key carries the session configuration it was minted with and opens calls until it expires; it is
never a substitute for the server key. Keys are stateless: a key is its own record, signed with a
key derived from the server key, so every process that knows the server key (each worker of a
cluster, any entry) verifies it without a shared store, and nothing grows with the keys minted.

Format: ``ek_<payload>.<signature>``, both base64url without padding. The payload is
zlib-compressed compact JSON ``{"v": 1, "iat", "exp", "nonce", "session"}`` (compressed so that a
long prompt still fits an ``Authorization`` header); the signature is HMAC-SHA256 over
``ek_<payload>``. A key is checked in this order: size, shape, signature (constant time), and only
then is its payload decompressed (bounded) and read strictly; an expired key is refused.

Without a server key (local development on loopback) the signing key is random per process: a key
opens calls on the process that minted it only.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import secrets
import time
import zlib
from dataclasses import dataclass
from typing import Any, Callable

PREFIX = "ek_"
DEFAULT_TTL_S = 600  # OpenAI's default lifetime for a client secret
MIN_TTL_S = 10
MAX_TTL_S = 7200
VERSION = 1
# A key travels in an Authorization header; HTTP servers and proxies commonly cap a header at 8 KiB.
MAX_PAYLOAD_BYTES = 5120  # compressed payload, before base64
MAX_JSON_BYTES = 64 * 1024  # the payload once decompressed (as large as a call's session part)
_SIGNATURE_CHARS = 43  # 32 bytes of HMAC-SHA256 in unpadded base64url
MAX_KEY_CHARS = len(PREFIX) + (MAX_PAYLOAD_BYTES * 4 + 2) // 3 + 1 + _SIGNATURE_CHARS
_DERIVATION_LABEL = b"lychee-rtc client secret v1"
_SHAPE = re.compile(r"ek_([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]{43})")
_FIELDS = {"v", "iat", "exp", "nonce", "session"}
_NONCE = re.compile(r"[A-Za-z0-9_-]{16}")


class InvalidClientSecret(Exception):
    """The key is malformed, was not minted with this server key, or has expired."""


class SessionTooLarge(ValueError):
    """The session configuration does not fit in a key."""


@dataclass(frozen=True)
class ClientSecret:
    value: str
    created_at: int  # unix seconds
    expires_at: int
    session: dict[str, Any]  # the GA session configuration it was minted with (validated at minting)


def signing_key(server_key: str | None) -> bytes:
    """Derived from the server key, so a key is never the server key's own MAC; random without one."""
    if server_key is None:
        return secrets.token_bytes(32)
    return hmac.new(server_key.encode("utf-8"), _DERIVATION_LABEL, hashlib.sha256).digest()


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class ClientSecrets:
    """Mints and verifies the keys of one server key."""

    def __init__(self, server_key: str | None, clock: Callable[[], float] = time.time) -> None:
        self._key = signing_key(server_key)
        self.clock = clock

    def _sign(self, signed: str) -> str:
        return _b64encode(hmac.new(self._key, signed.encode("ascii"), hashlib.sha256).digest())

    def mint(self, session: dict[str, Any], ttl_s: int = DEFAULT_TTL_S) -> ClientSecret:
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"expires_after.seconds must be between {MIN_TTL_S} and {MAX_TTL_S}")
        now = int(self.clock())
        claims = {"v": VERSION, "iat": now, "exp": now + ttl_s, "nonce": secrets.token_urlsafe(12),
                  "session": session}
        raw = json.dumps(claims, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode("utf-8")
        if len(raw) > MAX_JSON_BYTES:
            raise SessionTooLarge(f"the session configuration is {len(raw)} bytes; a client secret carries "
                                  f"at most {MAX_JSON_BYTES}")
        packed = zlib.compress(raw, 9)
        if len(packed) > MAX_PAYLOAD_BYTES:
            raise SessionTooLarge(f"the session configuration takes {len(packed)} bytes compressed; a client "
                                  f"secret carries at most {MAX_PAYLOAD_BYTES} (it travels in a header): send "
                                  "long instructions in the call's session part or in session.update")
        signed = PREFIX + _b64encode(packed)
        return ClientSecret(signed + "." + self._sign(signed), now, now + ttl_s, session)

    def verify(self, value: str) -> ClientSecret:
        """The key's record; ``InvalidClientSecret`` when it is malformed, forged or expired."""
        if len(value) > MAX_KEY_CHARS:
            raise InvalidClientSecret(f"the client secret is longer than {MAX_KEY_CHARS} characters")
        match = _SHAPE.fullmatch(value)
        if match is None:
            raise InvalidClientSecret("the client secret is malformed")
        payload, signature = match.groups()
        expected = self._sign(PREFIX + payload)
        if not hmac.compare_digest(signature.encode("ascii"), expected.encode("ascii")):
            raise InvalidClientSecret("the client secret was not minted with this server's key")
        claims = _read_claims(payload)
        if claims["exp"] <= self.clock():
            raise InvalidClientSecret("the client secret has expired")
        return ClientSecret(value, claims["iat"], claims["exp"], claims["session"])


def _read_claims(payload: str) -> dict[str, Any]:
    """The signed payload, read strictly (it was made by this code; anything else is refused)."""
    try:
        packed = _b64decode(payload)
        inflater = zlib.decompressobj()
        raw = inflater.decompress(packed, MAX_JSON_BYTES)
        if inflater.unconsumed_tail or not inflater.eof or inflater.unused_data:
            raise InvalidClientSecret("the client secret's payload is oversized or truncated")
        claims = json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except (binascii.Error, zlib.error, UnicodeDecodeError, ValueError) as exc:
        raise InvalidClientSecret(f"the client secret's payload is unreadable: {type(exc).__name__}") from None
    if not isinstance(claims, dict) or set(claims) != _FIELDS:
        raise InvalidClientSecret("the client secret's payload has the wrong fields")
    if claims["v"] != VERSION or not _is_int(claims["v"]):
        raise InvalidClientSecret(f"the client secret's version is not {VERSION}")
    iat, exp = claims["iat"], claims["exp"]
    if not (_is_int(iat) and _is_int(exp) and MIN_TTL_S <= exp - iat <= MAX_TTL_S):
        raise InvalidClientSecret("the client secret's lifetime is invalid")
    if not isinstance(claims["nonce"], str) or not _NONCE.fullmatch(claims["nonce"]):
        raise InvalidClientSecret("the client secret's nonce is invalid")
    if not isinstance(claims["session"], dict):
        raise InvalidClientSecret("the client secret's session is not an object")
    return claims


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def is_client_secret(token: str) -> bool:
    return token.startswith(PREFIX)
