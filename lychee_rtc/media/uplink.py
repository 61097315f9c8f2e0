"""Where each decoded uplink chunk belongs on the session's stream, judged by its timestamp.

Shared by every transport that carries timestamps (RTP over WebRTC, carrier media frames): a chunk
that starts later than the previous one ended is preceded by lost time, which keeps its place as a
fading repeat of the last audio (``conceal``) instead of shifting everything after it; a chunk that
starts earlier is late or reordered and is dropped; a jump too large to be loss is a restarted
stream, and the timeline re-anchors on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lychee_rtc.media.conceal import conceal

# A timestamp jump larger than this is a broken or restarted stream, not loss: the stream is
# re-anchored instead of filling the jump (a backward step would otherwise read as a huge gap).
MAX_GAP_S = 2.0


@dataclass
class InboundCounters:
    frames: int = 0
    gaps: int = 0
    gap_seconds: float = 0.0
    reordered_frames: int = 0  # older than what was already consumed: dropped
    bad_frames: int = 0
    stream_breaks: int = 0  # timestamp jumps too large to be loss (source restart, codec switch)


class UplinkTimeline:
    """``slack``: how far (in chunk lengths) a chunk may start off its expected place and still be
    taken as contiguous; RTP timestamps are exact, some carriers' are arrival times."""

    def __init__(self, rate: int, counters: InboundCounters, slack: float = 0.5) -> None:
        self.rate = rate
        self.counters = counters
        self.slack = slack
        self._expected: float | None = None  # stream time (s) where the next chunk should start
        self._previous = np.zeros(0, dtype=np.float32)  # the last decoded audio, for concealment

    def restart(self) -> None:
        """A new stream of another shape: forget the old timing."""
        self._expected = None

    def place(self, start_s: float, duration_s: float) -> int | None:
        """Samples (at ``rate``) lost before this chunk, or None if the chunk is late and must be dropped."""
        gap = 0
        if self._expected is not None:
            delta = start_s - self._expected
            if abs(delta) > MAX_GAP_S:
                self.counters.stream_breaks += 1  # real time kept flowing: the window clock filled it
            elif delta > duration_s * self.slack:
                self.counters.gaps += 1
                self.counters.gap_seconds += delta
                gap = round(delta * self.rate)
            elif delta < -duration_s * self.slack:
                self.counters.reordered_frames += 1
                return None
        self._expected = start_s + duration_s
        return gap

    def concealment(self, n: int, fade_s: float) -> np.ndarray:
        """What to play for ``n`` lost samples: the last audio repeated, fading out over ``fade_s``."""
        return conceal(self._previous, n, fade=round(fade_s * self.rate))

    def heard(self, samples: np.ndarray) -> None:
        if len(samples):
            self._previous = samples
