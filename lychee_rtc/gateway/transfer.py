"""Blind transfer of a phone call: a SIP REFER to the caller through Janus's ``transfer`` request.

The caller's user agent calls the target itself and reports how that goes in NOTIFYs (a
``message/sipfrag`` status line), which Janus hands over as ``notify`` events. A 2xx means the
caller reached the target: the server hangs up its own leg and the session closes with reason
``transferred``. A final failure leaves the call with the agent, as it was. Janus 1.1.2 does not
report the REFER's own response, so a REFER refused or never answered shows as no NOTIFY at all:
after ``TRANSFER_TIMEOUT_S`` the transfer is reported failed and the call goes on.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any

from lychee_rtc.gateway.dial_out import sip_target
from lychee_rtc.gateway.errors import CallActionRefused, checked_uri
from lychee_rtc.gateway.hold import set_hold
from lychee_rtc.gateway.janus_api import JanusError

log = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 30.0
# What a caller's phone answers when it cannot call a Refer-To that carries Replaces: a URI with
# headers it does not take (400), the extension (420), no such dialog (481), not implemented (501).
NO_REPLACES = frozenset({400, 420, 481, 501})
SIPFRAG = re.compile(r"^SIP/2\.0\s+(\d{3})\s*(.*)$")


def sipfrag_status(content: str) -> tuple[int, str] | None:
    """(status, reason phrase) of a ``message/sipfrag`` body's status line."""
    first = content.strip().splitlines()[0] if content.strip() else ""
    found = SIPFRAG.match(first.strip())
    return (int(found[1]), found[2].strip()) if found else None


@dataclass
class Transfer:
    target_uri: str
    # An attended transfer: the SIP Call-ID of our call to the target that the caller's INVITE
    # replaces (REFER with Replaces), and that call's session, ended once the caller is through.
    replaces: str | None = None
    consult_session: str | None = None
    status: str = "requested"
    sip_status: int | None = None
    reason: str | None = None
    requested_at: float = field(default_factory=time.time)
    ended_at: float | None = None

    @property
    def final(self) -> bool:
        return self.status in ("completed", "failed")

    def state(self) -> dict[str, Any]:
        return {"target_uri": self.target_uri, "status": self.status, "sip_status": self.sip_status,
                "reason": self.reason, "requested_at": self.requested_at, "ended_at": self.ended_at}


Line = Any  # gateway.line.Line, which holds a Transfer (so it is not imported here)


class Transfers:
    def __init__(self, gateway: Any) -> None:  # the JanusSipGateway that owns it (which imports this)
        self.gateway = gateway

    def line_of(self, session_id: str) -> Line | None:
        return next((ln for ln in self.gateway._lines.values() if ln.session_id == session_id), None)

    async def start(self, session_id: str, target_uri: str, replaces: str | None = None,
                    consult_session: str | None = None) -> Transfer:
        """Send the REFER (with ``replaces``: attended); raise CallActionRefused when this call cannot
        be transferred now."""
        checked_uri(target_uri, "target_uri")
        line = self.line_of(session_id)
        call = self.gateway.registry.calls.get(session_id)
        if line is None or call is None or call.session.closed:
            raise CallActionRefused(409, "not_a_phone_call", "only an answered phone call through the SIP gateway "
                                                           "can be transferred")
        if line.transfer is not None and not line.transfer.final:
            raise CallActionRefused(409, "transfer_in_progress", "this call is already being transferred")
        api = self.gateway._api
        if api is None:
            raise CallActionRefused(503, "gateway_unavailable", "the connection to Janus is down")
        transfer = line.transfer = Transfer(target_uri, replaces, consult_session)
        self._emit(line, transfer)
        body = {"request": "transfer", "uri": sip_target(target_uri, self.gateway.settings.registrar)}
        if replaces is not None:
            body["replace"] = replaces  # Janus builds the Refer-To's Replaces from that call's dialog
        try:
            await api.message(line.handle_id, body)
        except (JanusError, ConnectionError, asyncio.TimeoutError) as exc:
            self._finish(line, transfer, "failed", reason=str(exc))
            return transfer
        self.gateway._spawn(self._deadline(line, transfer))
        log.info("SIP gateway: session %s: REFER to %s sent", session_id, target_uri)
        return transfer

    async def _deadline(self, line: Line, transfer: Transfer) -> None:
        await asyncio.sleep(TRANSFER_TIMEOUT_S)
        if line.transfer is transfer and not transfer.final:
            self._finish(line, transfer, "failed", reason="no final NOTIFY from the caller's user agent")

    def on_event(self, line: Line, result: dict[str, Any], error: str | None = None) -> bool:
        """A Janus event of a line whose call is being transferred; False: not about the transfer."""
        transfer = line.transfer
        if transfer is None or transfer.final:
            return False
        if error is not None:  # Janus refused the transfer request itself (a malformed URI, a wrong state)
            self._finish(line, transfer, "failed", reason=error)
            return True
        if result.get("event") == "transferring":
            return True
        if result.get("event") != "notify" or str(result.get("notify", "refer")).lower() != "refer":
            return False
        status = sipfrag_status(str(result.get("content", "")))
        if status is None:
            return True
        code, phrase = status
        if code < 200:
            transfer.status, transfer.sip_status = ("ringing" if code in (180, 183) else "trying"), code
            self._emit(line, transfer)
        elif code < 300:
            self._finish(line, transfer, "completed", code)
            session_id = line.session_id
            if session_id is not None:  # the caller is with the target: our leg goes (BYE)
                self.gateway._spawn(self.gateway.registry.close(session_id, "transferred"))
            if transfer.consult_session is not None:  # and so does our call to the target, if still up
                self.gateway._spawn(self.gateway.registry.close(transfer.consult_session, "transferred"))
        elif transfer.replaces is not None and code in NO_REPLACES:
            # The caller's phone cannot follow a Refer-To with Replaces: refer it plainly to the
            # person, who was briefed already; our call to them ends when the caller is through.
            log.info("SIP gateway: the caller refused Replaces (%d): referring without it", code)
            transfer.replaces, transfer.reason = None, f"{code} {phrase}: retried without Replaces".strip()
            self.gateway._spawn(self._refer_plainly(line, transfer))
        else:
            self._finish(line, transfer, "failed", code, phrase or None)
            if transfer.consult_session is not None:  # an attended transfer that failed: back to the agent
                self.gateway._spawn(self._back_to_caller(line.session_id))
        return True

    async def _refer_plainly(self, line: Line, transfer: Transfer) -> None:
        api = self.gateway._api
        transfer.status, transfer.sip_status = "requested", None
        self._emit(line, transfer)
        try:
            if api is None:
                raise ConnectionError("the connection to Janus is down")
            await api.message(line.handle_id, {"request": "transfer",
                                                "uri": sip_target(transfer.target_uri, self.gateway.settings.registrar)})
        except (JanusError, ConnectionError, asyncio.TimeoutError) as exc:
            self._finish(line, transfer, "failed", reason=str(exc))
            await self._back_to_caller(line.session_id)

    async def _back_to_caller(self, session_id: str | None) -> None:
        if session_id is None:
            return
        try:
            await set_hold(self.gateway, session_id, False)
        except CallActionRefused:  # the caller left meanwhile
            pass

    def _finish(self, line: Line, transfer: Transfer, status: str, sip_status: int | None = None,
                reason: str | None = None) -> None:
        transfer.status, transfer.ended_at = status, time.time()
        if sip_status is not None:
            transfer.sip_status = sip_status
        transfer.reason = reason
        self._emit(line, transfer)
        log.info("SIP gateway: transfer to %s %s (%s)", transfer.target_uri, status, sip_status or reason)

    def _emit(self, line: Line, transfer: Transfer) -> None:
        call = self.gateway.registry.calls.get(line.session_id or "")
        if call is None or call.session.closed:
            return
        fields: dict[str, Any] = {"target_uri": transfer.target_uri, "status": transfer.status}
        if transfer.sip_status is not None:
            fields["sip_status"] = transfer.sip_status
        if transfer.reason is not None:
            fields["reason"] = transfer.reason
        call.session.emit("call.transfer", **fields)
