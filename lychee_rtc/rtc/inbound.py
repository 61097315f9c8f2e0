"""Inbound audio: the caller's decoded audio, at the engine's rate (mono float32), placed on the
session's timeline.

Two ways in. With our jitter buffer (``rtc.jitter_buffer: lowlatency``, the default) each packet is
decoded on the event loop as the buffer releases it (``InlineDecoder``): Opus straight to the
engine's rate by libopus (``rtc/opus.py``), other codecs by aiortc's decoder and one stateful PyAV
resampler. With aiortc's own buffer, the track's frames come from aiortc's decoder thread and
``consume_audio`` reads them. Both hand frames to one ``InboundAudio``.

Loss shows up as a jump in the frames' timestamps; it is reported to the session as a gap so the
missing time keeps its place (``media.uplink``) instead of shifting everything after it.
"""

from __future__ import annotations

import logging

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from lychee_rtc.media.uplink import InboundCounters, UplinkTimeline
from lychee_rtc.pcm import FrameResampler, frames_to_array
from lychee_rtc.rtc import opus
from lychee_rtc.session.session import DuplexSession

log = logging.getLogger(__name__)


class InboundAudio:
    """One call's uplink, frame by frame: timing, loss, codec switches, resampling where needed."""

    def __init__(self, session: DuplexSession, counters: InboundCounters) -> None:
        self.session = session
        self.counters = counters
        self.rate = session.capabilities.input_rate
        self.timeline = UplinkTimeline(self.rate, counters)
        self._resampler: FrameResampler | None = None
        self._source: tuple | None = None  # the stream's shape: a new one is a codec switch
        self._aligned = False

    def frame(self, frame: av.AudioFrame) -> None:
        """A decoded frame at any rate and layout (PyAV), resampled here."""
        if self.session.closed:
            return
        self.counters.frames += 1
        self._shape((frame.sample_rate, frame.layout.name, frame.format.name))
        if frame.pts is not None and frame.time_base is not None and frame.sample_rate:
            if not self._place(float(frame.pts * frame.time_base), frame.samples / frame.sample_rate):
                return
        if self._resampler is None:
            self._resampler = FrameResampler("flt", "mono", self.rate)
        try:
            samples = frames_to_array(self._resampler.resample(frame))
        except (ValueError, av.FFmpegError) as exc:
            self.counters.bad_frames += 1
            log.warning("session %s: dropping undecodable audio frame: %s", self.session.id, exc)
            return
        if not self._aligned:
            # The resampler's filter delay makes its first output a little short of a frame. Dropping
            # that first chunk puts window boundaries on packet boundaries, so a window completes
            # with the packet that carries its last sample instead of one packet later.
            self._aligned = True
            if len(samples) < round(frame.samples * self.rate / frame.sample_rate):
                return
        self._hear(samples)

    def samples(self, samples: np.ndarray, start_s: float, source: tuple) -> None:
        """Audio already decoded at the engine's rate, starting at stream time ``start_s``."""
        if self.session.closed:
            return
        self.counters.frames += 1
        self._shape(source)
        if self._place(start_s, len(samples) / self.rate):
            self._hear(samples)

    def bad_frame(self, reason: str) -> None:
        self.counters.bad_frames += 1
        log.warning("session %s: dropping undecodable audio frame: %s", self.session.id, reason)

    def close(self) -> None:
        if self._resampler is not None:
            self._resampler.close()  # its filter graph goes now, not when the collector runs
            self._resampler = None

    def _shape(self, shape: tuple) -> None:
        if shape != self._source:
            if self._source is not None:  # the sender switched codec: a new stream of another shape
                self.counters.stream_breaks += 1
                self.close()
                self.timeline.restart()
            self._source = shape

    def _place(self, start_s: float, duration_s: float) -> bool:
        gap = self.timeline.place(start_s, duration_s)
        if gap is None:
            return False
        if gap:
            self.session.push_gap(gap, fill=self.timeline.concealment(gap, duration_s))
        return True

    def _hear(self, samples: np.ndarray) -> None:
        if len(samples):
            self.timeline.heard(samples)
            self.session.push_audio(samples)


class InlineDecoder:
    """Decodes each packet the jitter buffer releases, on the event loop, into an ``InboundAudio``.

    No thread and no queue between packet and session: aiortc's decoder thread hands every frame back
    to the loop with ``run_coroutine_threadsafe``, which costs more than decoding it here.
    """

    def __init__(self, inbound: InboundAudio) -> None:
        self.inbound = inbound
        self._codec_key: tuple | None = None
        self._opus: opus.OpusDecoder | None = None
        self._other = None  # aiortc's decoder for a codec libopus does not cover

    def __call__(self, codec, data: bytes, timestamp: int) -> None:
        """``codec``: the packet's RTCRtpCodecParameters; ``timestamp``: its mapped RTP timestamp."""
        key = (codec.mimeType.lower(), codec.clockRate)
        if key != self._codec_key:
            self._switch(codec, key)
        if self._opus is not None:
            try:
                pcm = self._opus.decode(data)
            except opus.OpusError as exc:
                self.inbound.bad_frame(str(exc))
                return
            self.inbound.samples(pcm, timestamp / codec.clockRate, key)
            return
        from aiortc.jitterbuffer import JitterFrame

        try:
            frames = self._other.decode(JitterFrame(data=data, timestamp=timestamp))
        except av.FFmpegError as exc:
            self.inbound.bad_frame(str(exc))
            return
        for frame in frames:
            self.inbound.frame(frame)

    def _switch(self, codec, key: tuple) -> None:
        self.close()
        self._codec_key = key
        if key[0] == "audio/opus" and opus.available() and self.inbound.rate in opus.RATES:
            self._opus = opus.OpusDecoder(self.inbound.rate)
        else:
            from aiortc.codecs import get_decoder

            self._other = get_decoder(codec)

    def close(self) -> None:
        if self._opus is not None:
            self._opus.close()
        self._opus = self._other = None


async def consume_audio(track: MediaStreamTrack, session: DuplexSession, counters: InboundCounters,
                        inbound: InboundAudio | None = None) -> None:
    """Read ``track`` until it ends. When its packets are decoded inline (``inbound`` is fed by an
    ``InlineDecoder``), no frame comes this way and this only waits for the track's end."""
    inbound = inbound or InboundAudio(session, counters)
    try:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            if session.closed:
                return
            inbound.frame(frame)
    finally:
        inbound.close()


async def drain(track: MediaStreamTrack) -> None:
    """Read and discard a track nobody needs, so its frames do not pile up."""
    while True:
        try:
            await track.recv()
        except MediaStreamError:
            return
