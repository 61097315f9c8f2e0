"""Calls the server places through the Janus SIP plugin: one attempt from dialling to its outcome.

An attempt takes an engine slot before anything is sent (capacity is checked before dialling),
makes a WebRTC offer, and hands it to Janus's ``call`` request on a free line; Janus turns it into
a SIP INVITE through the registrar (Kamailio, or a trunk behind it). Janus reports ``ringing``
(180), ``progress`` (183 with early media, whose answer is the call's answer), ``accepted`` (200,
with the answer) or ``hangup`` with the SIP status. Answered, the attempt's session is registered
like any call; otherwise the session is closed without ever starting and the slot goes back.

Progress is kept on the attempt (``resource()``, what ``GET /v1/telephony/calls/{id}`` shows) and
emitted as ``call.status`` events on the attempt's session, so that an event stream attached
while the phone rings sees it, followed by the normal session events once answered.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from lychee_rtc.calls.tokens import new_session_token
from lychee_rtc.strict_text import UnsafeText, strict_text

# Final states; "answered" becomes "completed" when the answered call ends.
FINAL = frozenset({"busy", "declined", "no_answer", "failed", "cancelled", "completed"})
# Session close reasons that mean the far end ended the call (its BYE, its leg gone).
FAR_END_REASONS = frozenset({"caller_hangup"})
# Matched whole (strict_text: fullmatch, no control character anywhere, bounded).
SIP_URI = re.compile(r"sips?:[^@\s<>\"]+@[^\s<>\"]+|tel:\+?[0-9*#][0-9*#().-]*(;[^\s<>\"]*)?")
MAX_URI = 256


def sip_uri(value: object, what: str) -> str:
    """``value`` if it is a ``sip:``/``sips:`` URI with a user part or a ``tel:`` number, whole and
    printable; ``UnsafeText`` otherwise. Every URI that goes into a SIP message passes here."""
    return strict_text(value, what, MAX_URI, SIP_URI)


def new_sip_call_id() -> str:
    """A Call-ID of characters no URI header needs escaped. An attended transfer names this call in
    the Refer-To's ``Replaces`` header, which Janus writes with ``;`` and ``=`` escaped but the
    Call-ID as it is, so an ``@host`` part (optional in RFC 3261's ``callid``) would stand there
    unescaped where RFC 3891 requires ``%40``. Random, so globally unique without a host."""
    return f"lychee-{secrets.token_hex(16)}"


def valid_target(uri: object) -> bool:
    """A ``sip:``/``sips:`` URI with a user part, or a ``tel:`` number."""
    try:
        sip_uri(uri, "uri")
    except UnsafeText:
        return False
    return True


def sip_target(uri: str, registrar: str) -> str:
    """What Janus is given to dial or refer to: a ``tel:`` number becomes a SIP URI at the registrar
    (RFC 3261 19.1.6, ``user=phone``), since Janus's SIP plugin takes SIP URIs only."""
    if not uri.startswith("tel:"):
        return uri
    number, _, _params = uri[4:].partition(";")
    host = registrar.split(":", 1)[1].split(";", 1)[0]
    return f"sip:{number}@{host};user=phone"


def status_for_sip_code(code: int, we_gave_up: str | None) -> str:
    """What a final SIP status means for an attempt (``we_gave_up``: our own CANCEL's reason)."""
    if we_gave_up is not None and code in (0, 200, 487):
        return we_gave_up
    if code in (486, 600):
        return "busy"
    if code == 603:
        return "declined"
    if code in (408, 480, 487):
        return "no_answer"
    return "failed"


@dataclass
class OutboundCall:
    """One dial attempt and, once answered, the call it became."""

    to: str
    caller_id: str | None
    ring_timeout_s: float
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(8)}")
    # The secret its requester is given (in the 201 only): it opens the call's resources, and the
    # answered session's, like a session token.
    token: str = field(default_factory=new_session_token)
    sip_call_id: str = field(default_factory=new_sip_call_id)
    status: str = "dialing"
    sip_status: int | None = None
    reason: str | None = None
    session: Any = None  # the DuplexSession (prepared before dialling, started when answered)
    created_at: float = field(default_factory=time.time)
    ringing_at: float | None = None
    answered_at: float | None = None
    ended_at: float | None = None
    # Set by the gateway's event handler: ("accepted", jsep) or ("hangup", code, reason).
    outcome: asyncio.Future | None = None
    early_answer: dict | None = None  # the 183's JSEP answer, when the far end sent early media
    give_up: str | None = None  # "no_answer" / "cancelled" once we decided to end the attempt
    cancel_sent: bool = False  # Janus was told to hang up (it sends CANCEL once the far end answered 1xx)
    line_free: asyncio.Event = field(default_factory=asyncio.Event)  # Janus closed the SIP side
    sent: asyncio.Future | None = None  # Janus took the call request ("calling") or refused it
    on_end: list[Callable[[str], None]] = field(default_factory=list)
    hung_up_by: str | None = None  # once completed: "far_end" (their BYE) or "server" (ours)
    _announced: set = field(default_factory=set)

    def far_end(self, kind: str, *details: Any) -> None:
        """What the far end (or Janus) said last about the INVITE: the attempt's outcome, once."""
        if self.outcome is not None and not self.outcome.done():
            self.outcome.set_result((kind, *details))
        if self.sent is not None and not self.sent.done():
            self.sent.set_result(None)

    @property
    def final(self) -> bool:
        return self.status in FINAL

    def set_status(self, status: str, sip_status: int | None = None, reason: str | None = None) -> None:
        """``sip_status``: the SIP status behind the new status. An attempt that ends unanswered ends
        with its final status or none (a 180 is no outcome); a reason says why when there is none."""
        if self.final or (status, sip_status) in self._announced:
            return
        self._announced.add((status, sip_status))
        self.status = status
        if sip_status is not None or (status in FINAL and status != "completed"):
            self.sip_status = sip_status
        if reason is not None:
            self.reason = reason
        now = time.time()
        if status == "ringing" and self.ringing_at is None:
            self.ringing_at = now
        elif status == "answered":
            self.answered_at = now
        if status in FINAL:
            self.ended_at = now
        if self.session is not None and not self.session.closed:
            fields: dict[str, Any] = {"call_id": self.id, "status": status}
            if self.sip_status is not None:
                fields["sip_status"] = self.sip_status
            if self.reason is not None:
                fields["reason"] = self.reason
            if status == "completed":
                fields.update(duration_s=self.duration_s, hung_up_by=self.hung_up_by)
            self.session.emit("call.status", **fields)

    def end(self, reason: str) -> None:
        """The answered call is ending (its session closing for ``reason``), its last events not sent yet."""
        if self.final:
            return
        self.hung_up_by = "far_end" if reason in FAR_END_REASONS else "server"
        self.set_status("completed", reason=reason)

    @property
    def duration_s(self) -> float | None:
        """From the answer to the end (or to now), once answered."""
        if self.answered_at is None:
            return None
        return round((self.ended_at or time.time()) - self.answered_at, 3)

    def close_listeners(self) -> None:
        """Tell whoever watches the attempt (its event streams) that it is over, its last events sent."""
        listeners, self.on_end = self.on_end, []
        for listener in listeners:
            listener(self.status)

    def resource(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id, "object": "telephony.call", "direction": "outbound", "to": self.to,
            "from": self.caller_id, "status": self.status, "sip_status": self.sip_status, "reason": self.reason,
            "sip_call_id": self.sip_call_id,
            "session_id": self.session.id if self.session is not None and self.answered_at is not None else None,
            "created_at": self.created_at, "ringing_at": self.ringing_at, "answered_at": self.answered_at,
            "ended_at": self.ended_at, "duration_s": self.duration_s if self.status == "completed" else None,
            "hung_up_by": self.hung_up_by,
        }
        return body
