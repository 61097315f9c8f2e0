"""ICE consent freshness (RFC 7675) that a busy event loop does not break, and says when it expires.

aioice sends one consent check about every 5 s with no retransmission and a 0.5 s answer deadline,
and gives up after six failures in a row. When the event loop is busy (a flood of data-channel
traffic, a long engine hand-off), answers that did arrive are read after their deadline, six checks
fail, and the call is dropped with nothing in the log above INFO. Here, per RFC 7675, consent
expires only when no check has been answered for ``timeout_s`` (30 s by default); each check is
retransmitted, so a late answer still counts. When consent does expire, ``on_expired`` runs before
the ICE connection closes, so the session can give the real reason.

This replaces ``Connection.query_consent`` on each of the peer's aioice connections; it relies on
aioice's ``_nominated``, ``build_request`` and ``remote_password``, and leaves a connection alone
(aioice's own check stays) if they are missing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import types
from typing import Callable

from aioice import stun
from aiortc import RTCPeerConnection

log = logging.getLogger(__name__)

CONSENT_INTERVAL_S = 5.0  # RFC 7675 section 5.1: randomised around 5 s
CHECK_RETRANSMISSIONS = 3  # a check's answer may come up to ~7 s late (0.5 s RTO, doubling)


def ice_connections(pc: RTCPeerConnection) -> list:
    dtls = [t.receiver.transport for t in pc.getTransceivers()]
    if pc.sctp is not None:
        dtls.append(pc.sctp.transport)
    seen: dict[int, object] = {}
    for d in dtls:
        connection = getattr(getattr(d, "transport", None), "_connection", None)
        if connection is not None:
            seen[id(connection)] = connection
    return list(seen.values())


def install_consent_freshness(pc: RTCPeerConnection, timeout_s: float, on_expired: Callable[[], None],
                              clock: Callable[[], float] = time.monotonic) -> int:
    """Use the tolerant consent check on ``pc``'s ICE connections; returns how many it took over.

    Call after the remote description is set and before the connection starts.
    """
    interval = min(CONSENT_INTERVAL_S, timeout_s / 4)
    taken = 0
    for connection in ice_connections(pc):
        if not all(hasattr(connection, a) for a in ("_nominated", "build_request", "remote_password", "close")):
            log.warning("this aioice has no known consent hooks: its own consent check stays")
            continue

        async def query_consent(self) -> None:
            last_answer = clock()
            while True:
                await asyncio.sleep(interval * (0.8 + 0.4 * random.random()))
                for pair in list(self._nominated.values()):
                    request = self.build_request(pair, nominate=False)
                    try:
                        await pair.protocol.request(request, pair.remote_addr,
                                                    integrity_key=self.remote_password.encode("utf8"),
                                                    retransmissions=CHECK_RETRANSMISSIONS)
                        last_answer = clock()
                    except stun.TransactionError:
                        pass
                if clock() - last_answer > timeout_s:
                    on_expired()
                    self._query_consent_task = None
                    await self.close()
                    return

        connection.query_consent = types.MethodType(query_consent, connection)
        taken += 1
    return taken
