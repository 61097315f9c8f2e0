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
from lychee_rtc.gateway.janus_api import JanusError

log = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 30.0
SIPFRAG = re.compile(r"^SIP/2\.0\s+(\d{3})\s*(.*)$")


class CallActionRefused(Exception):
    """A call action (transfer, hold) refused: an HTTP status, an error code and a message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def sipfrag_status(content: str) -> tuple[int, str] | None:
    """(status, reason phrase) of a ``message/sipfrag`` body's status line."""
    first = content.strip().splitlines()[0] if content.strip() else ""
    found = SIPFRAG.match(first.strip())
    return (int(found[1]), found[2].strip()) if found else None


@dataclass
class Transfer:
    target_uri: str
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

    async def start(self, session_id: str, target_uri: str) -> Transfer:
        """Send the REFER; raise CallActionRefused when this call cannot be transferred now."""
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
        transfer = line.transfer = Transfer(target_uri)
        self._emit(line, transfer)
        try:
            await api.message(line.handle_id, {"request": "transfer",
                                                "uri": sip_target(target_uri, self.gateway.settings.registrar)})
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
        else:
            self._finish(line, transfer, "failed", code, phrase or None)
        return True

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
