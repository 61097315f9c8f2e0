"""The caller's audio: carrier payloads decoded, placed by their timestamps, resampled to the session.

Carriers send 20-100 ms chunks over TCP, so nothing is lost on the way from them, but a carrier
may have lost packets from the phone network (its timestamps jump) or, Telnyx says, deliver frames
out of order; both are handled by the same timeline as RTP (``media.uplink``). Carriers without
timestamps (Vonage) are taken as contiguous.
"""

from __future__ import annotations

from lychee_rtc.media.uplink import InboundCounters, UplinkTimeline
from lychee_rtc.pcm import PcmResampler
from lychee_rtc.session.session import DuplexSession
from lychee_rtc.telephony.frames import AudioFormat

# Carriers' timestamps may be arrival times: only a shift of most of a chunk is loss or reordering.
TIMESTAMP_SLACK = 0.75


class CarrierUplink:
    def __init__(self, session: DuplexSession, audio: AudioFormat) -> None:
        self.session = session
        self.audio = audio
        self.counters = InboundCounters()
        rate = session.capabilities.input_rate
        self._resampler = PcmResampler(audio.rate, rate)
        self._timeline = UplinkTimeline(rate, self.counters, slack=TIMESTAMP_SLACK)
        self._first_ms: float | None = None
        self._stream_s = 0.0  # where the next chunk starts when the carrier gives no timestamps

    def close(self) -> None:
        """The call has ended: free the resampler now, not when the collector runs."""
        self._resampler.close()

    def push(self, payload: bytes, timestamp_ms: float | None) -> None:
        """One chunk from the carrier (raises FrameError if it cannot be decoded)."""
        samples = self.audio.decode(payload)
        self.counters.frames += 1
        if len(samples) == 0:
            return
        duration = len(samples) / self.audio.rate
        if timestamp_ms is None:
            start = self._stream_s
        else:
            if self._first_ms is None:
                self._first_ms = timestamp_ms
            start = (timestamp_ms - self._first_ms) / 1000.0
        gap = self._timeline.place(start, duration)
        if gap is None:
            return
        self._stream_s = start + duration
        if gap:
            self.session.push_gap(gap, fill=self._timeline.concealment(gap, duration))
        out = self._resampler.process(samples)
        if len(out):
            self._timeline.heard(out)
            self.session.push_audio(out)
