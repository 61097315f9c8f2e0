"""What no server-side stamp sees of the caller's time, as the transport measures it.

A caller's audio was said some time before it reached us (the way in), and our audio is heard some
time after it left (the way out, and the far end's playout). What a transport measures is their sum:
WebRTC the round trip (RTCP receiver reports answering our sender reports, RFC 3550 6.4.1), taken
as symmetric, half each way; a carrier the lag of its playout receipts (a mark echoed later than the
pacer expected its audio to finish), put on the way out, where the carrier's buffer is. Reports come
every second or so and one can be held up by a stall at either end, so the estimate is the median of
the last few, bounded; with no report yet it is 0 (the stamps then keep only what the server sees).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

# A report past this is a stalled end, not a path: it is bounded here rather than trusted.
MAX_ROUND_TRIP_S = 0.5
# The median of this many reports (about the last five seconds of them).
HISTORY = 5


class TransitEstimate:
    """The unseen part of the caller's loop (said -> reached us, left us -> heard), as reported;
    ``way_in_s``/``way_out_s`` split its recent median by the reporting transport's ``out_share``."""

    def __init__(self, history: int = HISTORY, max_round_trip_s: float = MAX_ROUND_TRIP_S) -> None:
        self._round_trips: deque[float] = deque(maxlen=history)
        self.max_round_trip_s = max_round_trip_s
        self.reports = 0
        self.source = "none"  # what measured it (recorded with the compensation it gives)
        self.out_share = 0.5
        self._median = 0.0

    def observe(self, round_trip_s: float, source: str, out_share: float = 0.5) -> None:
        """A report: ``out_share`` of it lies on the way out (0.5: a symmetric path; 1: a far-end buffer)."""
        if not isinstance(round_trip_s, (int, float)) or not math.isfinite(round_trip_s) or round_trip_s < 0:
            return
        self._round_trips.append(min(float(round_trip_s), self.max_round_trip_s))
        self.reports += 1
        self.source = source
        self.out_share = min(1.0, max(0.0, out_share))
        self._median = statistics.median(self._round_trips)  # here, once a report: the stamps read it per frame

    def round_trip_s(self) -> float:
        return self._median

    def way_in_s(self) -> float:
        """How long before it reached us the caller said what arrives now."""
        return self.round_trip_s() * (1.0 - self.out_share)

    def way_out_s(self) -> float:
        """How long after it leaves the caller hears what leaves now."""
        return self.round_trip_s() * self.out_share
