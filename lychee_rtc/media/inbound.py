"""Inbound audio: every remote audio track is consumed, decoded frames resampled to the engine's
rate (mono float32) with one stateful PyAV resampler, and handed to the session's window clock.

Loss shows up as a jump in the frames' timestamps; it is reported to the session as a gap so the
missing time keeps its place (as silence) instead of shifting everything after it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import av
import numpy as np
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from lychee_rtc.media.conceal import conceal
from lychee_rtc.pcm import FrameResampler, frames_to_array
from lychee_rtc.session.session import DuplexSession

log = logging.getLogger(__name__)

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


async def consume_audio(track: MediaStreamTrack, session: DuplexSession, counters: InboundCounters) -> None:
    rate = session.capabilities.input_rate
    resampler = FrameResampler("flt", "mono", rate)
    source: tuple | None = None  # (rate, layout, format) the resampler was set up for
    expected: float | None = None  # stream time (s) where the next frame should start
    aligned = False
    previous = np.zeros(0, dtype=np.float32)  # the last decoded audio, for concealment
    try:
        while True:
            try:
                frame = await track.recv()
            except MediaStreamError:
                return
            if session.closed:
                return
            counters.frames += 1
            shape = (frame.sample_rate, frame.layout.name, frame.format.name)
            if shape != source:
                if source is not None:  # the sender switched codec: a new stream of another shape
                    counters.stream_breaks += 1
                    resampler.close()
                    resampler = FrameResampler("flt", "mono", rate)
                    expected = None
                source = shape
            if frame.pts is not None and frame.time_base is not None and frame.sample_rate:
                start = float(frame.pts * frame.time_base)
                duration = frame.samples / frame.sample_rate
                if expected is not None:
                    delta = start - expected
                    if abs(delta) > MAX_GAP_S:
                        counters.stream_breaks += 1  # real time kept flowing: the window clock filled it
                    elif delta > duration / 2:
                        counters.gaps += 1
                        counters.gap_seconds += delta
                        n = round(delta * rate)
                        session.push_gap(n, fill=conceal(previous, n, fade=round(duration * rate)))
                    elif delta < -duration / 2:
                        counters.reordered_frames += 1
                        continue
                expected = start + duration
            try:
                samples = frames_to_array(resampler.resample(frame))
            except (ValueError, av.FFmpegError) as exc:
                counters.bad_frames += 1
                log.warning("session %s: dropping undecodable audio frame: %s", session.id, exc)
                continue
            if not aligned:
                # The resampler's filter delay makes its first output a little short of a frame. Dropping
                # that first chunk puts window boundaries on packet boundaries, so a window completes
                # with the packet that carries its last sample instead of one packet later.
                aligned = True
                if len(samples) < round(frame.samples * rate / frame.sample_rate):
                    continue
            if len(samples):
                previous = samples
                session.push_audio(samples)
    finally:
        resampler.close()  # its filter graph goes now, not when the collector runs


async def drain(track: MediaStreamTrack) -> None:
    """Read and discard a track nobody needs, so its frames do not pile up."""
    while True:
        try:
            await track.recv()
        except MediaStreamError:
            return
