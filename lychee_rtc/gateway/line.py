"""One Janus SIP plugin handle ("line"): it carries at most one call at a time."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from lychee_rtc.gateway.dial_out import OutboundCall
from lychee_rtc.gateway.transfer import Transfer


@dataclass
class Line:
    """One Janus SIP plugin handle: at most one call at a time."""

    handle_id: int
    helper: bool
    session_id: str | None = None  # the session answering the current call
    sip_call_id: str | None = None
    answering: bool = False
    caller_hung_up: bool = False
    registered: asyncio.Future | None = None
    outbound: OutboundCall | None = None  # the call placed on this line, from dialling to its end
    transfer: Transfer | None = None  # the current call's blind transfer, once asked for
    pending_call: str | None = None  # the call id a webhook announced, while the application decides

    @property
    def free(self) -> bool:
        return self.session_id is None and not self.answering and self.outbound is None
