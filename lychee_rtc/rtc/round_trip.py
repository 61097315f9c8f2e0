"""The call's round-trip time as RTCP measures it, handed to the track's ``TransitEstimate``.

aiortc's sender works the round trip out of each receiver report that answers its latest sender
report (arrival - LSR - DLSR, RFC 3550 6.4.1) and keeps it, smoothed, in its ``remote-inbound-rtp``
stats; a report that answers an older one leaves it as it was. That is public (``getStats``), so it
is read here twice a second and passed on whenever a new report came.
"""

from __future__ import annotations

import asyncio
import logging

from lychee_rtc.media.transit import TransitEstimate

log = logging.getLogger(__name__)

POLL_S = 0.5  # RTCP reports come every 0.5-1.5 s; the first one matters most (until then no transit)
SOURCE = "rtcp_round_trip"


def latest_round_trip(report) -> tuple[object, float] | None:
    """(the report's timestamp, its round trip in s) from a ``getStats`` report, if it has one."""
    for stats in report.values():
        if getattr(stats, "type", None) == "remote-inbound-rtp":
            rtt = getattr(stats, "roundTripTime", None)
            if isinstance(rtt, (int, float)):
                return stats.timestamp, float(rtt)
    return None


async def watch_round_trip(sender, estimate: TransitEstimate, poll_s: float = POLL_S) -> None:
    """Until cancelled (the call's path is dropped): each new receiver report's round trip."""
    seen = None
    while True:
        await asyncio.sleep(poll_s)
        try:
            found = latest_round_trip(await sender.getStats())
        except Exception as exc:  # a sender whose transport is closing: nothing to measure
            log.debug("no RTCP stats: %r", exc)
            continue
        if found is not None and found[0] != seen:
            seen = found[0]
            estimate.observe(found[1], SOURCE)
