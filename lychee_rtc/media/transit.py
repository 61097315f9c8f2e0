"""How long audio takes between the server and the caller, one way, as the transport measures it.

No server-side stamp sees the network or the far end's processing: a caller's audio was said that
long before it reached us, and our audio is heard that long after it left. What a transport does
measure is the round trip (WebRTC: RTCP receiver reports answering our sender reports, RFC 3550
6.4.1), and half of it is the one-way estimate, the path taken as symmetric. Reports come every
second or so and one can be delayed by a stall at either end, so the estimate is the median of the
last few, bounded; with no report yet it is 0 (the stamps then keep only what the server sees).
"""

from __future__ import annotations

import math
from collections import deque

# A report past this is a stalled end, not a path: it is bounded here rather than trusted.
MAX_ROUND_TRIP_S = 0.5
# The median of this many reports (about the last five seconds of them).
HISTORY = 5


class TransitEstimate:
    """Round trips reported by the transport; ``one_way_s`` is half their recent median."""

    def __init__(self, history: int = HISTORY, max_round_trip_s: float = MAX_ROUND_TRIP_S) -> None:
        self._round_trips: deque[float] = deque(maxlen=history)
        self.max_round_trip_s = max_round_trip_s
        self.reports = 0
        self.source = "none"  # what measured it (recorded with the compensation it gives)

    def observe(self, round_trip_s: float, source: str) -> None:
        if not isinstance(round_trip_s, (int, float)) or not math.isfinite(round_trip_s) or round_trip_s < 0:
            return
        self._round_trips.append(min(float(round_trip_s), self.max_round_trip_s))
        self.reports += 1
        self.source = source

    def one_way_s(self) -> float:
        if not self._round_trips:
            return 0.0
        ordered = sorted(self._round_trips)
        mid = len(ordered) // 2
        median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
        return median / 2
