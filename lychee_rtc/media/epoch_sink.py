"""The session's audio sink as every transport's outbound side presents it.

A transport (the WebRTC track, the carrier pacer) owns one ``EpochPlayout`` and reads frames from it
at its own pace; the session writes into it through this wrapper, which counts writes of a stale
epoch and wakes the transport's sender when audio arrives. What is transport-specific (how a frame
leaves, when it counts as heard, what a cut must also flush) stays in the transport's subclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lychee_rtc.aio import Signal
from lychee_rtc.media.audio_processing import AudioProcessingStage
from lychee_rtc.media.playout import EpochPlayout, PlayoutCounters, PlayoutListener
from lychee_rtc.media.transit import TransitEstimate
from lychee_rtc.session.sink import CutReport

# A passthrough engine (loopback) keeps at most this much queued beyond the frame being sent (or the
# last chunk, if longer). More is standing delay (what queued behind a stall, a start-up backlog)
# when it stays for a whole window: then the least depth seen in the window is dropped. A queue that
# is deep for a frame or two (two packets arriving together after one was late) is left alone.
LIVE_MARGIN_S = 0.003
STANDING_WINDOW_S = 0.2


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
        self._audio_arrived = Signal()  # set on every accepted write: the sender may go on
        self._chunk_samples = 0  # the last accepted write, at the output rate
        self._standing: tuple[int, int] | None = None  # (samples sent, least excess) in this window
        # The session's uplink processing: told what left for the caller, as it leaves (its echo reference).
        self.reference: AudioProcessingStage | None = None
        # The path's one-way time, as the transport measures it (WebRTC: RTCP round trips); a
        # recording keeps the caller's time by it.
        self.transit = TransitEstimate()

    # How far ahead of the caller's playout this transport sends (a carrier's lead), and whether it
    # sends all the time, silence included (the WebRTC track): the stage's reference queue follows.
    reference_lead_s = 0.0
    reference_continuous = False
    # The codec's own delay, each way (Opus 6.5 ms; G.711 none): the caller hears a frame's audio
    # that much after it leaves, and said what arrives that much before it was encoded.
    codec_delay_s = 0.0

    def attach_reference(self, stage: AudioProcessingStage | None) -> None:
        """Feed ``stage`` what leaves for the caller from now on."""
        self.reference = stage
        if stage is not None:
            stage.reference_lead_s = self.reference_lead_s
            stage.reference_continuous = self.reference_continuous

    def played(self, pcm: np.ndarray) -> None:
        """``pcm`` (at the transport's rate) has just left for the caller."""
        if self.reference is not None:
            self.reference.far_end(pcm, self.playout.out_rate)

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
        self._chunk_samples = len(pcm) * self.playout.out_rate // self.playout.in_rate
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
        """A passthrough engine, once per frame sent: drop standing delay (``STANDING_WINDOW_S``).

        The excess is what is queued beyond ``LIVE_MARGIN_S`` past the next frame or the chunk that
        came last, whichever is longer (a 20 ms chunk sent as two 10 ms frames is current audio).
        """
        keep = max(frame_samples, self._chunk_samples) + int(LIVE_MARGIN_S * self.playout.out_rate)
        excess = self.playout.depth_samples - keep
        sent, least = self._standing or (0, excess)
        sent, least = sent + frame_samples, min(least, excess)
        if sent < STANDING_WINDOW_S * self.playout.out_rate:
            self._standing = (sent, least)
            return
        self._standing = None
        if least > 0:
            self.counters.trimmed_samples += self.playout.discard(least)
