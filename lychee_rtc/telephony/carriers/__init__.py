"""Carrier dialects, and telling which carrier is on the line from its first frames."""

from __future__ import annotations

from typing import Any

from lychee_rtc.telephony.carriers.base import Dialect
from lychee_rtc.telephony.carriers.exotel import ExotelDialect
from lychee_rtc.telephony.carriers.plivo import PlivoDialect
from lychee_rtc.telephony.carriers.telnyx import TelnyxDialect
from lychee_rtc.telephony.carriers.twilio import TwilioDialect
from lychee_rtc.telephony.carriers.vonage import VonageDialect

DIALECTS: dict[str, type[Dialect]] = {
    d.name: d for d in (TwilioDialect, TelnyxDialect, PlivoDialect, ExotelDialect, VonageDialect)
}
# Frames some carriers send before their start frame; nothing to act on.
HANDSHAKE_EVENTS = frozenset({"connected"})


def detect(first: dict[str, Any]) -> type[Dialect] | None:
    for dialect in DIALECTS.values():
        if dialect.detect(first):
            return dialect
    return None


__all__ = ["DIALECTS", "HANDSHAKE_EVENTS", "Dialect", "detect"]
