"""What a refused call action (transfer, hold, consultation) says: HTTP status, error code, message."""

from __future__ import annotations

from lychee_rtc.gateway.dial_out import sip_uri
from lychee_rtc.strict_text import UnsafeText


class CallActionRefused(Exception):
    """A call action (transfer, hold) refused: an HTTP status, an error code and a message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def checked_uri(value: object, what: str) -> str:
    """A URI about to go into a SIP message, checked at the gateway's edge whatever checked it
    before (``dial_out.sip_uri``); refused as a 400 ``invalid_target``."""
    try:
        return sip_uri(value, what)
    except UnsafeText as exc:
        raise CallActionRefused(400, "invalid_target", str(exc)) from None
