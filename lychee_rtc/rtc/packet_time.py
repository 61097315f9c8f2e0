"""Packet time: how much audio one RTP packet carries, in each direction.

Sending: aiortc's audio encoders packetize 20 ms whatever they are given (their resampler re-frames
the input, and FFmpeg's libopus encodes 20 ms frames by default). ``TrackFramedEncoder`` makes an
encoder packetize at the duration of the first frame the track hands it, so the paced track's
``frame_ms`` (``rtc.send_frame_ms``) is what goes on the wire: a 10 ms packet leaves 10 ms sooner,
and the receiver's jitter buffer works in 10 ms steps.

Receiving: ``a=ptime`` in the answer (``with_ptime``, RFC 4566 section 6) asks the peer to send
packets of that length; libwebrtc sizes its Opus frames from it, other senders may ignore it, and
the inbound path takes any packet length either way.

The track also picks libopus's application (``rtc.opus_application``): it puts an ``EncoderHints``
on its first frame (``frame.opaque``), which the wrapped encoder reads when it sizes itself.
"""

from __future__ import annotations

import fractions
import re
from dataclasses import dataclass
from typing import Any

import av
import numpy as np

from lychee_rtc.pcm import FrameResampler

# Packet lengths both directions accept: what every Opus and G.711 stack sends and receives.
PACKET_MS = (10, 20)


@dataclass(frozen=True)
class EncoderHints:
    """What a track asks of the encoder that packetizes it, riding on its first frame."""

    opus_application: str | None = None  # libopus: "voip", "audio" or "lowdelay"


@dataclass(frozen=True)
class PcmFrame:
    """One frame of the paced track: 16-bit mono samples from stream position ``pts`` at ``rate``."""

    pcm: np.ndarray
    pts: int
    rate: int
    hints: EncoderHints | None = None  # on the first frame only

    def to_av(self) -> av.AudioFrame:
        frame = av.AudioFrame.from_ndarray(self.pcm[None, :], format="s16", layout="mono")
        frame.sample_rate = self.rate
        frame.pts = self.pts
        frame.time_base = fractions.Fraction(1, self.rate)
        if self.hints is not None:
            frame.opaque = self.hints
        return frame


class TrackFramedEncoder:
    """Wraps one of aiortc's audio encoders; set up from the first frame, then passes through."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._sized = False

    def encode(self, frame: Any, force_keyframe: bool = False) -> tuple[list[bytes], int | None]:
        if not self._sized:
            self._sized = True
            self._set_up_for(frame)
        return self._inner.encode(frame, force_keyframe)

    def pack(self, packet: Any) -> tuple[list[bytes], int]:
        return self._inner.pack(packet)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _set_up_for(self, frame: Any) -> None:
        context = getattr(self._inner, "codec", None)
        options: dict[str, str] = {}
        hints = getattr(frame, "opaque", None)
        if isinstance(hints, EncoderHints) and hints.opus_application:
            options["application"] = hints.opus_application
        ms = frame.samples * 1000 / frame.sample_rate
        resampler = getattr(self._inner, "resampler", None)
        # An encoder we do not know how to re-frame keeps its own packet time.
        if ms in PACKET_MS and isinstance(resampler, FrameResampler):
            samples = resampler.rate * int(ms) // 1000
            if resampler.frame_size != samples:
                self._inner.resampler = FrameResampler(resampler.format, resampler.layout, resampler.rate, samples)
                options["frame_duration"] = str(int(ms))
        if options and context is not None and context.name == "libopus":  # read when it opens, at its first frame
            context.options = {**dict(context.options), **options}


def frame_by_track(encoder: Any) -> TrackFramedEncoder:
    return TrackFramedEncoder(encoder)


def with_ptime(sdp: str, ptime_ms: int) -> str:
    """``sdp`` with ``a=ptime:<ptime_ms>`` in every audio section (replacing one that is there)."""
    lines = sdp.split("\r\n")
    out: list[str] = []
    in_audio = False
    for line in lines:
        if line.startswith("m="):
            if in_audio:
                _insert_before_trailing_blank(out, f"a=ptime:{ptime_ms}")
            in_audio = line.startswith("m=audio ")
        elif in_audio and re.match(r"a=ptime:", line):
            continue
        out.append(line)
    if in_audio:
        _insert_before_trailing_blank(out, f"a=ptime:{ptime_ms}")
    return "\r\n".join(out)


def _insert_before_trailing_blank(out: list[str], line: str) -> None:
    at = len(out)
    while at > 0 and out[at - 1] == "":
        at -= 1
    out.insert(at, line)
