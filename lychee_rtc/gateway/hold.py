"""Hold and resume of a phone call: a re-INVITE through Janus (``hold`` / ``unhold``), the session paused.

Janus's ``hold`` sends the caller a re-INVITE with ``a=inactive`` (silence: neither side sends) or
``a=sendonly`` (we keep sending, for music on hold); ``unhold`` restores the previous direction.
While held the session's uplink clock is stopped, so the engine is given no windows (none count
as underruns) and what it was saying is cut; the media timeout does not run.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from lychee_rtc.gateway.janus_api import JanusError
from lychee_rtc.gateway.transfer import CallActionRefused

log = logging.getLogger(__name__)

DIRECTIONS = ("inactive", "sendonly")


async def set_hold(gateway: Any, session_id: str, held: bool, direction: str = "inactive") -> bool:
    """Hold or resume the gateway's call ``session_id``; False when it already was so."""
    line = gateway.transfers.line_of(session_id)
    call = gateway.registry.calls.get(session_id)
    if line is None or call is None or call.session.closed:
        raise CallActionRefused(409, "not_a_phone_call", "only an answered phone call through the SIP gateway "
                                                       "can be put on hold")
    if direction not in DIRECTIONS:
        raise CallActionRefused(400, "invalid_direction", f"direction must be one of {list(DIRECTIONS)}")
    session = call.session
    if session.on_hold == held:
        return False
    api = gateway._api
    if api is None:
        raise CallActionRefused(503, "gateway_unavailable", "the connection to Janus is down")
    body = {"request": "hold", "direction": direction} if held else {"request": "unhold"}
    try:
        await api.message(line.handle_id, body)
    except (JanusError, ConnectionError, asyncio.TimeoutError) as exc:
        raise CallActionRefused(502, "gateway_error", f"Janus refused the {body['request']}: {exc}") from None
    # The session follows at once: the re-INVITE's answer changes nothing we do with the audio.
    if held:
        session.hold()
    else:
        session.unhold()
    log.info("SIP gateway: session %s %s", session_id, f"on hold ({direction})" if held else "taken off hold")
    return True
