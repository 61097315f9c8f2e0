"""Inbound audio: every remote audio track is consumed, decoded frames resampled to the engine's
rate (mono float32) with one stateful PyAV resampler, and handed to the session's window clock.

Loss shows up as a jump in the frames' timestamps; it is reported to the session as a gap so the
missing time keeps its place (``media.uplink``) instead of shifting everything after it.
"""

from __future__ import annotations

import logging

import av
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from lychee_rtc.media.uplink import InboundCounters, UplinkTimeline
from lychee_rtc.pcm import FrameResampler, frames_to_array
from lychee_rtc.session.session import DuplexSession

log = logging.getLogger(__name__)


async def consume_audio(track: MediaStreamTrack, session: DuplexSession, counters: InboundCounters) -> None:
    rate = session.capabilities.input_rate
    resampler = FrameResampler("flt", "mono", rate)
    source: tuple | None = None  # (rate, layout, format) the resampler was set up for
    timeline = UplinkTimeline(rate, counters)
    aligned = False
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
                    timeline.restart()
                source = shape
            if frame.pts is not None and frame.time_base is not None and frame.sample_rate:
                duration = frame.samples / frame.sample_rate
                gap = timeline.place(float(frame.pts * frame.time_base), duration)
                if gap is None:
                    continue
                if gap:
                    session.push_gap(gap, fill=timeline.concealment(gap, duration))
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
                timeline.heard(samples)
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
