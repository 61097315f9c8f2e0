"""Where in its slot a passthrough frame leaves: a steady point just after its audio usually arrives.

A passthrough engine (loopback) hands audio over as the caller's packets arrive. Sent the moment
it is there, a frame carries the uplink's arrival jitter straight on to the downlink, and the
receiver's jitter buffer (NetEq sizes its target from the worst delays it sees) grows to cover it.
Sent at a fixed point of a send clock whose phase has nothing to do with the arrivals, a frame
waits up to a whole frame, and a late arrival misses its slot. ``SendPhase`` puts the send point
just after the 99th percentile of the last 3 s of arrival times, relative to the slot: packets
leave at regular times (one offset for every frame while the arrivals keep their pattern) and
hold the audio only as long as the arrival spread needs.
"""

from __future__ import annotations

import bisect
from collections import deque

# A long window and a high quantile: the send point moves seldom, and every move is itself a delay
# change the receiver's jitter buffer sees (3 s and 0.99 measured better than 1 s and 0.95 in
# docs/benchmarks.md). A packet in a hundred may still be late (a loss, filled in by the next).
QUANTILE = 0.99
WINDOW_S = 3.0
MARGIN_S = 0.001  # the loop's own wake-up slack


class SendPhase:
    """``offset()``: seconds from a frame's slot to when it leaves (negative: before the slot)."""

    def __init__(self, max_lead_s: float, max_hold_s: float, window_s: float = WINDOW_S,
                 quantile: float = QUANTILE, margin_s: float = MARGIN_S) -> None:
        self.max_lead_s = max_lead_s
        self.max_hold_s = max_hold_s
        self.window_s = window_s
        self.quantile = quantile
        self.margin_s = margin_s
        self._seen: deque[tuple[float, float]] = deque()  # (when, ready - due), oldest first
        self._sorted: list[float] = []  # the same readiness values, sorted

    def observe(self, now: float, ready_minus_due: float) -> None:
        """A frame's audio was all there ``ready_minus_due`` seconds after its slot."""
        self._seen.append((now, ready_minus_due))
        bisect.insort(self._sorted, ready_minus_due)
        while self._seen and now - self._seen[0][0] > self.window_s:
            _, old = self._seen.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def offset(self) -> float:
        if not self._sorted:  # nothing known yet: as early as allowed, like the first frames
            return -self.max_lead_s
        late = self._sorted[min(len(self._sorted) - 1, int(self.quantile * len(self._sorted)))]
        return min(max(late + self.margin_s, -self.max_lead_s), self.max_hold_s)


# Arrival pacing: a frame whose audio comes more than the lead before its slot waits for the lead,
# on a timer: a second wake-up of the process for that frame, which on a virtual machine costs more
# CPU than the frame's own work (docs/benchmarks.md, "Concurrent calls"), and a few milliseconds of
# delay. A call's packets keep the phase they arrive at, so a call that starts in that part of the
# slot waited on every frame. ``ArrivalPhase`` moves its send clock earlier, by the least wait of a
# run of frames that all waited: from then on they leave as they arrive.
REPHASE_FRAMES = 10
REPHASE_MARGIN_S = 0.001  # the arrivals' own spread: past the send point, not just at it


class ArrivalPhase:
    """``observe(wait)``: how much earlier the send clock should move (0.0: not at all)."""

    def __init__(self, frames: int = REPHASE_FRAMES, margin_s: float = REPHASE_MARGIN_S) -> None:
        self.frames = frames
        self.margin_s = margin_s
        self._run = 0  # frames in a row that waited for their send point after their audio came
        self._least = 0.0  # ... the least of those waits

    def observe(self, waited_s: float | None) -> float:
        """A frame left; ``waited_s``: from its audio's arrival (while the sender waited for it) to its
        send point, or None where the audio was there before the sender asked (a backlog, a burst)
        or never came (silence): only a steady early arrival moves the clock, never a queue."""
        if waited_s is None or waited_s <= 0.0:
            self._run = 0
            return 0.0
        self._least = waited_s if self._run == 0 else min(self._least, waited_s)
        self._run += 1
        if self._run < self.frames:
            return 0.0
        self._run = 0
        return self._least + self.margin_s
