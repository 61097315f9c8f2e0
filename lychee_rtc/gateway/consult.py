"""Attended (warm) transfer: call the person first, brief them, then hand the caller over with Replaces.

``start`` puts the caller on hold (music or silence) and places a second call to the target, a
normal placed call whose session the application (or the model) uses to brief the person. ``complete``
(``transfers.start`` with ``replaces``) sends the caller a REFER whose Refer-To carries ``Replaces``
naming that second call's dialog: the caller's phone calls the person, whose phone swaps our call
for the caller's. Once the caller's NOTIFY says 2xx, the server leaves both calls (BYE where still
up). When the second call is not answered, or ends before the transfer, the caller is taken off
hold: the call goes back to the agent and the transfer is reported failed.

Why REFER with Replaces rather than a bridge: the server leaves the media path, so neither its
capacity nor its latency stays in a call it no longer takes part in, and phones and PBXs do the rest.
A phone that ignores Replaces still reaches the person (as a second call), and our call to them is
hung up when the transfer completes.
"""

from __future__ import annotations

import logging
from typing import Any

from lychee_rtc.engine.base import SessionOptions
from lychee_rtc.gateway.dial_out import OutboundCall
from lychee_rtc.gateway.hold import set_hold
from lychee_rtc.gateway.errors import CallActionRefused

log = logging.getLogger(__name__)


class Consults:
    def __init__(self, gateway: Any) -> None:  # the JanusSipGateway that owns it (which imports this)
        self.gateway = gateway
        self.by_caller: dict[str, OutboundCall] = {}  # caller's session id -> the call to the target

    async def start(self, session_id: str, target_uri: str, options: SessionOptions,
                    ring_timeout_s: float) -> OutboundCall:
        gw = self.gateway
        line = gw.transfers.line_of(session_id)
        if line is None or session_id not in gw.registry.calls:
            raise CallActionRefused(409, "not_a_phone_call", "only an answered phone call through the SIP gateway "
                                                           "can be transferred")
        current = self.by_caller.get(session_id)
        if current is not None and not current.final:
            raise CallActionRefused(409, "transfer_in_progress", "this caller's target is already being called")
        await set_hold(gw, session_id, True)
        try:
            attempt = await gw.dialer.dial(target_uri, None, options, ring_timeout_s)
        except BaseException:
            await set_hold(gw, session_id, False)
            raise
        self.by_caller[session_id] = attempt
        attempt.on_end.append(lambda status: self._ended(session_id, attempt, status))
        self._emit(session_id, target_uri, "consulting")
        log.info("SIP gateway: session %s on hold while %s is called (%s)", session_id, target_uri, attempt.id)
        return attempt

    def consult_of(self, session_id: str, consult_id: str) -> OutboundCall:
        attempt = self.by_caller.get(session_id)
        if attempt is None or consult_id not in (attempt.id, attempt.session.id if attempt.session else None):
            raise CallActionRefused(409, "no_consultation", f"{consult_id!r} is not this caller's call to a target")
        if attempt.status != "answered":
            raise CallActionRefused(409, "target_not_answered", f"the target's call is {attempt.status}")
        return attempt

    def _ended(self, session_id: str, attempt: OutboundCall, status: str) -> None:
        """The call to the target is over: unless the caller went to the target, back to the agent."""
        if self.by_caller.get(session_id) is attempt:
            del self.by_caller[session_id]
        line = self.gateway.transfers.line_of(session_id)
        transfer = line.transfer if line is not None else None
        if transfer is not None and transfer.consult_session is not None and not transfer.status == "failed":
            return  # the caller is being (or was) handed over
        self._emit(session_id, attempt.to, "failed", attempt.sip_status,
                   f"the target's call ended: {status}")
        self.gateway._spawn(self._back_to_caller(session_id))

    async def _back_to_caller(self, session_id: str) -> None:
        try:
            await set_hold(self.gateway, session_id, False)
        except CallActionRefused:  # the caller left meanwhile
            pass

    def _emit(self, session_id: str, target_uri: str, status: str, sip_status: int | None = None,
              reason: str | None = None) -> None:
        call = self.gateway.registry.calls.get(session_id)
        if call is None or call.session.closed:
            return
        fields: dict[str, Any] = {"target_uri": target_uri, "status": status}
        if sip_status is not None:
            fields["sip_status"] = sip_status
        if reason is not None:
            fields["reason"] = reason
        call.session.emit("call.transfer", **fields)
