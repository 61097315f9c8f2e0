"""Encoding the paced track's frames on the event loop, in the sender's own loop.

aiortc's RTCRtpSender, for every audio frame, computes the RFC 6465 audio level in pure Python (a
loop over 960 samples), then encodes in the loop's thread pool: a thread hand-off each way per
packet, and an Opus encoder that resamples each frame to stereo through an FFmpeg filter graph.
``install_inline_encoding`` replaces the sender's one step that fetches and encodes the next frame:
it takes 16-bit samples from the track (``PacedAudioTrack.next_pcm``), encodes mono Opus with
libopus (``rtc/opus.py``, set up as aiortc's encoder was, see ``OPUS_BITRATE``) or, for G.711, with
aiortc's own encoder, inline, and computes the level with numpy. Everything after that step (RTP packets, header extensions with the same audio level,
SRTP, RTCP sender reports) stays aiortc's.

This relies on two of the sender's internals, both unchanged in aiortc 1.9 to 1.16:
``_next_encoded_frame(codec)`` and its ``RTCEncodedFrame``. Where they are missing the sender is
left as it is, with a warning.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from lychee_rtc.rtc import opus
from lychee_rtc.rtc.packet_time import PcmFrame

log = logging.getLogger(__name__)

# What a caller hears does not change with the encoder: aiortc's Opus encoder runs libopus through
# FFmpeg at 96 kb/s, complexity 10, unconstrained VBR, and upmixes the track's mono to stereo at
# -3 dB per channel (FFmpeg's centre mix level). A mono stream decodes to both channels at its own
# level, so it is sent at that gain. (Constrained VBR or the louder level left an audible-in-tests
# tail after a cut: up to 3e-3 of full scale 10-20 ms on, against 8e-4.)
OPUS_BITRATE = 96000
OPUS_COMPLEXITY = 10
UPMIX_GAIN = 0.70710677
MIN_LEVEL_DBOV = -127


def audio_level_dbov(pcm: np.ndarray) -> int:
    """The RFC 6465 level of 16-bit samples, in dBov (-127 to 0), as aiortc computes it."""
    if len(pcm) == 0:
        return MIN_LEVEL_DBOV
    x = pcm.astype(np.float32)
    mean_square = float(np.dot(x, x)) / (len(pcm) * 32767.0 * 32767.0)
    if mean_square <= 0.0:
        return MIN_LEVEL_DBOV
    return round(min(0.0, max(float(MIN_LEVEL_DBOV), 10.0 * math.log10(mean_square))))


class InlineEncoding:
    """Stands in for one sender's ``_next_encoded_frame``; owns the encoder it sets up."""

    def __init__(self, sender: Any, track: Any, encoded_frame: type) -> None:
        self._sender = sender
        self._track = track
        self._encoded_frame = encoded_frame
        self._codec_key: tuple | None = None
        self._opus: opus.OpusEncoder | None = None
        self._other: Any = None  # aiortc's encoder (G.711), called inline
        self.frames = 0

    async def next_encoded_frame(self, codec: Any) -> Any:
        frame: PcmFrame = await self._track.next_pcm()
        if not self._sender._enabled:
            return None  # as aiortc: the frame is read and dropped while the sender is disabled
        key = (codec.mimeType.lower(), codec.clockRate, frame.rate)
        if key != self._codec_key:
            self._set_up(codec, key, frame)
        if self._opus is not None:
            payloads = [self._opus.encode(np.rint(frame.pcm * UPMIX_GAIN).astype(np.int16))]
            timestamp = frame.pts * codec.clockRate // frame.rate  # Opus's RTP clock is 48 kHz at any rate
        else:
            payloads, timestamp = self._other.encode(frame.to_av())  # the first carries the track's hints
            if not payloads:
                return None
        self.frames += 1
        return self._encoded_frame(payloads, timestamp, audio_level_dbov(frame.pcm))

    def _set_up(self, codec: Any, key: tuple, frame: PcmFrame) -> None:
        self.close()
        self._codec_key = key
        if key[0] == "audio/opus" and opus.available() and frame.rate in opus.RATES:
            application = (frame.hints.opus_application if frame.hints is not None else None) or "voip"
            self._opus = opus.OpusEncoder(frame.rate, application, OPUS_BITRATE, OPUS_COMPLEXITY, constrained_vbr=False)
        else:
            from aiortc import rtcrtpsender

            self._other = rtcrtpsender.get_encoder(codec)  # thread-limited and track-framed (codec_threads)

    def close(self) -> None:
        if self._opus is not None:
            self._opus.close()
        self._opus = self._other = None


def install_inline_encoding(sender: Any, track: Any) -> InlineEncoding | None:
    """Encode ``track``'s frames inline in ``sender`` (an aiortc RTCRtpSender); None if it cannot."""
    try:
        from aiortc.rtcrtpsender import RTCEncodedFrame
    except ImportError:
        RTCEncodedFrame = None  # type: ignore[assignment]
    if RTCEncodedFrame is None or not hasattr(sender, "_next_encoded_frame") or not hasattr(sender, "_enabled"):
        log.warning("aiortc's sender lacks the internals inline encoding uses; it keeps encoding in threads")
        return None
    encoding = InlineEncoding(sender, track, RTCEncodedFrame)
    sender._next_encoded_frame = encoding.next_encoded_frame
    return encoding
