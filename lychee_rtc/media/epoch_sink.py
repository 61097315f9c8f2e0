"""The session's audio sink as every transport's outbound side presents it.

A transport (the WebRTC track, the carrier pacer) owns one ``EpochPlayout`` and reads frames from it
at its own pace; the session writes into it through this wrapper, which counts writes of a stale
epoch and wakes the transport's sender when audio arrives. What is transport-specific (how a frame
leaves, when it counts as heard, what a cut must also flush) stays in the transport's subclass.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lychee_rtc.media.playout import EpochPlayout, PlayoutCounters, PlayoutListener
from lychee_rtc.session.sink import CutReport

# A passthrough engine (loopback) keeps at most this much queued beyond the frame being sent; more
# is standing delay (a burst after a loss or a stall, a start-up backlog) and is dropped at once.
LIVE_MARGIN_S = 0.003


@dataclass
class SinkCounters:
    stale_chunks: int = 0  # writes rejected because their epoch was no longer live
    trimmed_samples: int = 0  # passthrough engines: standing delay dropped


class SentAudioTap(Protocol):
    """Who hears what left for the caller (a call's recording)."""

    def agent_sent(self, pcm: np.ndarray, rate: int, at: float) -> None:
        """A frame left; ``at`` (monotonic): when the caller starts hearing it."""

    def agent_cut(self, at: float) -> None:
        """What was sent but not heard by ``at`` was taken back (a carrier's flush)."""


class EpochSink:
    """An ``AudioSink`` (session.sink) over one ``EpochPlayout``; ``counters`` is the transport's own.

    ``sent_tap``: told of every frame as it leaves, by the transport, which alone knows when that is.
    """

    def __init__(self, playout: EpochPlayout, counters: SinkCounters) -> None:
        self.playout = playout
        self.counters = counters
        self.sent_tap: SentAudioTap | None = None
        self._audio_arrived = asyncio.Event()  # set on every accepted write: the sender may go on

    @property
    def listener(self) -> PlayoutListener | None:
        return self.playout.listener

    @listener.setter
    def listener(self, listener: PlayoutListener | None) -> None:
        self.playout.listener = listener

    @property
    def epoch(self) -> int:
        return self.playout.epoch

    @property
    def depth_ms(self) -> float:
        return self.playout.depth_ms

    def write(self, epoch: int, response_id: str, pcm: np.ndarray) -> bool:
        if not self.playout.write(epoch, response_id, pcm):
            self.counters.stale_chunks += 1
            return False
        self._audio_arrived.set()
        return True

    def end_response(self, epoch: int, response_id: str) -> bool:
        if not self.playout.end_response(epoch, response_id):
            self.counters.stale_chunks += 1
            return False
        self._audio_arrived.set()  # a short tail may go out now instead of waiting for more audio
        return True

    def cut(self, new_epoch: int) -> CutReport:
        """Drop everything queued and start a fresh buffer for ``new_epoch``."""
        return self.playout.cut(new_epoch)

    def playout_counters(self) -> PlayoutCounters:
        return self.playout.playout_counters()

    def trim_standing_delay(self, frame_samples: int) -> None:
        """A passthrough engine: drop what queued up beyond the next frame and ``LIVE_MARGIN_S``."""
        excess = self.playout.depth_samples - frame_samples - int(LIVE_MARGIN_S * self.playout.out_rate)
        if excess > 0:
            self.counters.trimmed_samples += self.playout.discard(excess)
