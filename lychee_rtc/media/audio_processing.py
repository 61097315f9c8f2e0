"""The uplink's cleaning stage: WebRTC's audio processing module (AEC3 echo canceller, noise
suppression, high-pass filter, gain control) per session, in front of the engine.

The library is the ``livekit`` package's ``AudioProcessingModule`` (the optional ``aec`` extra);
without it, every stage stays off and asking for one is refused (``ProcessingUnavailable``).

Rate: the stage runs at the session's input rate (16 kHz for both engines), after the transport's
own resampling: one rate for 8 kHz phone legs and 48 kHz WebRTC alike, the rate the engine and its
VAD hear, and the cheapest one for AEC3 (a single band; 32 and 48 kHz are split into bands).

The far end: the echo canceller must know what the caller's loudspeaker played. The transports
tell the stage what left at the moment it left (``far_end``), including the silence between
answers, so the reference is what the caller heard, cut at interruptions. The reference is kept on
a timeline of its own, sample k at ``t0 + k / rate``: a frame that leaves early (a carrier's lead)
continues the stream where the previous one ended, since the carrier plays it after that one; time
in which nothing left is silence. Before each 10 ms of uplink is processed, the reference up to
that moment is handed to the canceller, so render and capture interleave as they would in a
phone. AEC3 finds the remaining delay (network, jitter buffers, the room) itself; measured here up
to about 500 ms (docs/echo.md).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from lychee_rtc.config import AudioProcessing
from lychee_rtc.pcm import PcmResampler
from lychee_rtc.session.processing import ProcessingUnavailable

log = logging.getLogger(__name__)

FRAME_MS = 10  # the module processes exactly 10 ms at a time
SUPPORTED_RATES = (8000, 16000, 32000, 48000)
# Reference kept ahead of the uplink, at most: longer than any echo path AEC3 can follow (~0.5 s).
MAX_REFERENCE_S = 1.0
# Reference this far behind the uplink (the uplink resumed after a stall) is skipped, not replayed.
MAX_REFERENCE_LAG_S = 0.25
# Far end that leaves this much later than the end of what left before is taken as a pause (the
# caller heard silence); less is sending jitter or a sender catching up after a stall (the WebRTC
# track does up to 0.2 s), which the caller's jitter buffer plays on seamlessly.
REFERENCE_JITTER_S = 0.25
# The uplink is placed in time by its sample count from the earliest arrival seen over this long:
# packets that come late or in a burst (a busy loop, network jitter) keep their place in the stream,
# while a path that really became slower moves the placement within this time.
ARRIVAL_WINDOW_S = 2.0
INSTALL_HINT = "install the 'aec' extra (pip install 'lychee-rtc[aec]')"


def _load_module() -> Any:
    try:
        from livekit.rtc import AudioFrame, AudioProcessingModule
    except ImportError as exc:
        raise ProcessingUnavailable(f"audio processing needs the livekit package: {INSTALL_HINT}") from exc
    return AudioFrame, AudioProcessingModule


def processing_available() -> bool:
    try:
        _load_module()
    except ProcessingUnavailable:
        return False
    return True


def _to_int16(x: np.ndarray) -> bytearray:
    return bytearray((np.clip(x, -1.0, 1.0) * 32767.0).astype(np.int16).tobytes())


@dataclass
class ProcessingCounters:
    frames: int = 0  # 10 ms uplink frames processed
    reference_frames: int = 0  # 10 ms far-end frames given to the canceller
    reference_skipped_s: float = 0.0  # far end dropped: too far ahead, or behind a stalled uplink
    reference_cut_s: float = 0.0  # far end taken back at interruptions (never reached the caller)


class AudioProcessingStage:
    """One session's processing (``session.processing.UplinkProcessing``) and its far-end reference."""

    def __init__(self, rate: int, settings: AudioProcessing, t0: float) -> None:
        if rate not in SUPPORTED_RATES:
            raise ValueError(f"audio processing runs at {SUPPORTED_RATES} Hz, not {rate}")
        self.rate = rate
        self.frame = rate * FRAME_MS // 1000
        self.counters = ProcessingCounters()
        self.settings = AudioProcessing()
        self.unavailable: str | None = None  # why a stage that was asked for is not running
        self._t0 = t0
        self._apm: Any = None
        self._frame_cls: Any = None
        self._held = np.zeros(0, np.float32)  # uplink short of a 10 ms frame
        self._reference = np.zeros(0, np.float32)  # far end not yet given to the canceller
        self._fed = 0  # reference samples given so far: _reference[0] is sample _fed of the timeline
        self._resampler: PcmResampler | None = None
        self._captured = 0  # uplink samples processed (gaps included): the uplink's own clock
        self._arrivals: deque[tuple[float, float]] = deque()  # (arrived at, where sample 0 would have)
        self.configure(settings)

    # --- the session's side (session.processing.UplinkProcessing) ----------------------------------

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.settings.model_dump(), "sample_rate": self.rate}
        if self.unavailable:
            out["unavailable"] = self.unavailable
        return out

    def configure(self, settings: AudioProcessing) -> np.ndarray:
        held = self._flush_held()
        if settings == self.settings and (self._apm is not None) == settings.active:
            return held
        if settings.active:
            frame_cls, module = _load_module()
            self._apm = module(echo_cancellation=settings.echo_cancellation,
                               noise_suppression=settings.noise_suppression,
                               high_pass_filter=settings.high_pass_filter,
                               auto_gain_control=settings.auto_gain_control)
            self._frame_cls = frame_cls
        else:
            self._apm = None  # the native state goes with its handle
        self.settings = settings
        self.unavailable = None
        self._reference = np.zeros(0, np.float32)
        return held

    def process(self, samples: np.ndarray, now: float) -> np.ndarray:
        if self._apm is None:
            return samples
        data = np.concatenate([self._held, np.asarray(samples, np.float32)])
        n = len(data) // self.frame * self.frame
        self._held = data[n:].copy()
        out = np.empty(n, np.float32)
        origin = self._place(now, self._captured + len(data))
        for i in range(0, n, self.frame):
            ends_at = origin + (self._captured + self.frame) / self.rate
            out[i:i + self.frame] = self._process_frame(data[i:i + self.frame], ends_at)
        return out

    def process_gap(self, fill: np.ndarray, now: float) -> tuple[np.ndarray, np.ndarray]:
        if self._apm is None:
            return np.zeros(0, np.float32), fill
        held = self._flush_held()
        n = len(fill)
        padded = np.pad(np.asarray(fill, np.float32), (0, -n % self.frame))
        out = np.empty(len(padded), np.float32)
        origin = self._place(now, self._captured + n)
        for i in range(0, len(padded), self.frame):
            out[i:i + self.frame] = self._process_frame(padded[i:i + self.frame],
                                                        origin + (self._captured + self.frame) / self.rate)
        self._captured -= len(padded) - n  # the padding never came in
        return held, out[:n]

    def close(self) -> None:
        self._apm = None
        self._reference = np.zeros(0, np.float32)
        if self._resampler is not None:
            self._resampler.close()
            self._resampler = None

    # --- the transport's side: what the caller's loudspeaker played ------------------------------

    @property
    def wants_reference(self) -> bool:
        return self._apm is not None and self.settings.echo_cancellation

    def far_end(self, pcm: np.ndarray, rate: int, at: float) -> None:
        """``pcm`` at ``rate`` left for the caller at ``at`` (the transport's clock, the uplink's too)."""
        if not self.wants_reference:
            return
        if self._resampler is None or self._resampler.in_rate != rate:
            if self._resampler is not None:
                self._resampler.close()
            self._resampler = PcmResampler(rate, self.rate)
        samples = self._resampler.process(pcm)
        end = self._fed + len(self._reference)
        start = self._sample_at(at)
        if start > end + REFERENCE_JITTER_S * self.rate:  # nothing left for a while: the caller heard silence
            silence = min(start - end, int(MAX_REFERENCE_S * self.rate))
            self._reference = np.concatenate([self._reference, np.zeros(silence, np.float32)])
        self._reference = np.concatenate([self._reference, samples])
        excess = len(self._reference) - int(MAX_REFERENCE_S * self.rate)
        if excess > 0:  # bounded: the oldest goes (no uplink has come to use it)
            self._reference = self._reference[excess:]
            self._fed += excess
            self.counters.reference_skipped_s += excess / self.rate

    def cut_far_end(self, at: float) -> None:
        """An interruption at ``at``: what was sent ahead but not yet played is flushed at the caller."""
        keep = max(0, self._sample_at(at) - self._fed)
        if keep < len(self._reference):
            self.counters.reference_cut_s += (len(self._reference) - keep) / self.rate
            self._reference = self._reference[:keep]

    # --- inside ------------------------------------------------------------------------------------

    def _place(self, now: float, end: int) -> float:
        """When uplink sample 0 would have arrived, judged by the earliest arrivals of the last while."""
        self._arrivals.append((now, now - end / self.rate))
        while self._arrivals[0][0] < now - ARRIVAL_WINDOW_S:
            self._arrivals.popleft()
        return min(origin for _, origin in self._arrivals)

    def _sample_at(self, t: float) -> int:
        return int(round((t - self._t0) * self.rate))

    def _flush_held(self) -> np.ndarray:
        """The uplink held short of a frame, processed as a frame padded with silence."""
        held, self._held = self._held, np.zeros(0, np.float32)
        if self._apm is None or len(held) == 0:
            return held
        padded = np.pad(held, (0, self.frame - len(held)))
        out = self._process_frame(padded, None)[:len(held)]
        self._captured -= self.frame - len(held)
        return out

    def _feed_reference(self, until: float) -> None:
        """Give the canceller the far end played up to ``until``, 10 ms at a time."""
        target = self._sample_at(until)
        lag = target - self._fed - int(MAX_REFERENCE_LAG_S * self.rate)
        if lag > 0:  # the uplink stalled: what played meanwhile has no uplink left to cancel
            drop = min(lag, len(self._reference))
            self._reference = self._reference[drop:]
            self._fed += lag
            self.counters.reference_skipped_s += lag / self.rate
        while self._fed + self.frame <= target:
            chunk = self._reference[:self.frame]
            self._reference = self._reference[len(chunk):]
            if len(chunk) < self.frame:  # nothing left there: silence
                chunk = np.pad(chunk, (0, self.frame - len(chunk)))
            frame = self._frame_cls(_to_int16(chunk), self.rate, 1, self.frame)
            self._apm.process_reverse_stream(frame)
            self._fed += self.frame
            self.counters.reference_frames += 1

    def _process_frame(self, samples: np.ndarray, ends_at: float | None) -> np.ndarray:
        if self.settings.echo_cancellation:
            if ends_at is not None:
                self._feed_reference(ends_at)
            # AEC3 estimates the echo path's delay itself; the reference is already placed at the
            # moment it left, so nothing the server knows adds to it.
            self._apm.set_stream_delay_ms(0)
        frame = self._frame_cls(_to_int16(samples), self.rate, 1, self.frame)
        self._apm.process_stream(frame)
        self.counters.frames += 1
        self._captured += self.frame
        return np.frombuffer(frame.data, dtype=np.int16).astype(np.float32) / 32768.0
