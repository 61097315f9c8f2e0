"""Closing a peer connection whatever state a failed negotiation left it in."""

from __future__ import annotations

import asyncio
import logging

from aiortc import RTCPeerConnection

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0


async def abandon_peer(pc: RTCPeerConnection) -> None:
    """Close ``pc``; never raises.

    A failed ``setRemoteDescription``/``createAnswer`` can leave aiortc's peer connection half
    built (a transceiver without a transport), and then its ``close()`` raises part way through. The
    transports that do exist are then stopped one by one, so no ICE or DTLS state outlives the offer.
    """
    try:
        await asyncio.wait_for(pc.close(), CLOSE_TIMEOUT_S)
        return
    except Exception as exc:  # aiortc's close is not safe on a half-negotiated connection
        log.debug("peer connection did not close cleanly (%r); stopping its transports", exc)
    dtls_transports = [t.receiver.transport for t in pc.getTransceivers()]
    dtls_transports += [t.sender.transport for t in pc.getTransceivers()]
    if pc.sctp is not None:
        dtls_transports.append(pc.sctp.transport)
    seen: set[int] = set()
    for dtls in dtls_transports:
        if dtls is None or id(dtls) in seen:
            continue
        seen.add(id(dtls))
        for transport in (dtls, getattr(dtls, "transport", None)):
            if transport is None:
                continue
            try:
                await asyncio.wait_for(transport.stop(), CLOSE_TIMEOUT_S)
            except Exception as exc:
                log.debug("transport %r did not stop: %r", transport, exc)
    pc.remove_all_listeners()
