"""Ephemeral client keys (``ek_…``) for browsers, minted with the server key.

A key carries the session configuration it was minted with and opens calls until it expires; it is
never a substitute for the server key. The store is bounded: expired keys are purged as new ones
are minted, and minting is refused while the store is full of live keys.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

PREFIX = "ek_"
DEFAULT_TTL_S = 600  # OpenAI's default lifetime for a client secret
MIN_TTL_S = 10
MAX_TTL_S = 7200
MAX_LIVE_KEYS = 1024


class SecretStoreFull(Exception):
    """Every slot of the store holds a live key."""


@dataclass(frozen=True)
class ClientSecret:
    value: str
    created_at: float  # unix seconds
    expires_at: float
    session: dict[str, Any]  # the GA session configuration it was minted with (validated)


class ClientSecretStore:
    def __init__(self, max_keys: int = MAX_LIVE_KEYS, clock: Callable[[], float] = time.time) -> None:
        self.max_keys = max_keys
        self.clock = clock
        self._keys: OrderedDict[str, ClientSecret] = OrderedDict()  # in minting order

    def __len__(self) -> int:
        return len(self._keys)

    def mint(self, session: dict[str, Any], ttl_s: int = DEFAULT_TTL_S) -> ClientSecret:
        if not MIN_TTL_S <= ttl_s <= MAX_TTL_S:
            raise ValueError(f"expires_after.seconds must be between {MIN_TTL_S} and {MAX_TTL_S}")
        self.purge()
        if len(self._keys) >= self.max_keys:
            raise SecretStoreFull(f"{self.max_keys} client secrets are live; retry when some have expired")
        now = self.clock()
        secret = ClientSecret(PREFIX + secrets.token_urlsafe(24), now, now + ttl_s, session)
        self._keys[secret.value] = secret
        return secret

    def lookup(self, value: str) -> ClientSecret | None:
        """The live secret of this value, or None (unknown or expired: both are refused alike)."""
        secret = self._keys.get(value)
        if secret is None:
            return None
        if secret.expires_at <= self.clock():
            del self._keys[value]
            return None
        return secret

    def purge(self) -> None:
        now = self.clock()
        for value in [v for v, s in self._keys.items() if s.expires_at <= now]:
            del self._keys[value]


def is_client_secret(token: str) -> bool:
    return token.startswith(PREFIX)
