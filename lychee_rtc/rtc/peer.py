"""Closing a peer connection whatever state a failed negotiation left it in, and keeping aiortc's
own tasks quiet about a path that closed under them."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiortc import RTCPeerConnection
from aiortc.exceptions import InvalidStateError

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 2.0


async def abandon_peer(pc: RTCPeerConnection) -> None:
    """Close ``pc``; never raises.

    A failed ``setRemoteDescription``/``createAnswer`` can leave aiortc's peer connection half
    built (a transceiver without a transport), and then its ``close()`` raises part way through. The
    transports that do exist are then stopped one by one, so no ICE or DTLS state outlives the offer.
    """
    try:
        await close_peer(pc, CLOSE_TIMEOUT_S)
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


async def close_peer(pc: RTCPeerConnection, timeout_s: float) -> None:
    """``pc.close()``, and aiortc's own close of the same peer when it started one first (its DTLS
    transports all closed under it): both are over when this returns, so no close is left pending
    with nothing to await it. ``asyncio.TimeoutError`` after ``timeout_s``."""
    await asyncio.wait_for(pc.close(), timeout_s)
    own = getattr(pc, "_RTCPeerConnection__closeTask", None)
    if isinstance(own, asyncio.Task) and not own.done():
        await asyncio.wait_for(asyncio.shield(own), timeout_s)


def _is_connect_of_a_closed_peer(context: dict[str, Any]) -> bool:
    task = context.get("future")
    coro = task.get_coro() if isinstance(task, asyncio.Task) else None
    return (isinstance(context.get("exception"), InvalidStateError)
            and getattr(coro, "__qualname__", "") == "RTCPeerConnection.__connect")


def quiet_connects_of_closed_peers(loop: asyncio.AbstractEventLoop) -> None:
    """aiortc starts a peer's ICE and DTLS in a task nobody awaits. A peer closed while that task
    waits (a client that hangs up during set-up) makes it fail with ``InvalidStateError`` ("... is
    closed"), which asyncio reports as an error with a traceback. That is a hang-up, not a fault: it
    is logged at DEBUG; every other unhandled exception goes on to the handler there was before.
    Idempotent per loop.
    """
    previous = loop.get_exception_handler()
    if getattr(previous, "quiets_closed_peers", False):
        return

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if _is_connect_of_a_closed_peer(context):
            log.debug("a peer connection closed while it was connecting: %s", context.get("exception"))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    handler.quiets_closed_peers = True  # type: ignore[attr-defined]
    loop.set_exception_handler(handler)


def quiet_sends_after_close(pc: RTCPeerConnection) -> bool:
    """A data-channel send that finds its path closed ends quietly (the chunk is lost with the path).

    aiortc sends SCTP chunks from tasks nobody awaits: the data-channel flush that every
    ``channel.send`` starts, retransmissions. Once the DTLS transport under them has closed (ICE
    consent expired, the peer vanished), each fails with ``ConnectionError``, and asyncio reports
    every one as "Task exception was never retrieved" with a traceback. The association's sender is
    wrapped so that such a failure ends the send (at DEBUG) instead; the association itself stops
    when the call drops the peer connection. Call once the remote description is set; False when
    the peer has no association or aiortc changed (then nothing is wrapped).
    """
    sctp = pc.sctp
    original = getattr(sctp, "_send_chunk", None)
    if original is None or getattr(original, "quiet_after_close", False):
        return False

    async def send_chunk(chunk: Any) -> None:
        try:
            await original(chunk)
        except ConnectionError as exc:
            log.debug("an SCTP chunk found its path closed: %s", exc)

    send_chunk.quiet_after_close = True  # type: ignore[attr-defined]
    sctp._send_chunk = send_chunk  # type: ignore[union-attr]
    return True
