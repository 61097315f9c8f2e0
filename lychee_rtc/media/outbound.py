"""The outbound audio track: engine PCM paced out as 20 ms frames on a monotonic schedule.

aiortc's sender pulls ``recv()`` as fast as it returns, so the pacing lives here: frame ``n`` is
released at ``t0 + n * 20 ms`` with pts ``n * frame_samples`` (continuous RTP timestamps), and a
frame of silence goes out whenever nothing is queued. The track writes at the negotiated codec's
clock (48 kHz for Opus, 8 kHz for G.711) so the encoder never has to resample.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError

from lychee_rtc.media.playout import PlayoutBuffer, PlayoutCounters, PlayoutMark
from lychee_rtc.session.sink import CutReport

FRAME_MS = 20
# Past this much lateness (an event-loop stall) the schedule is re-anchored instead of bursting.
MAX_CATCH_UP_S = 0.2
# Live mode keeps at most this much audio queued beyond the frame being sent; more is standing delay
# (a burst after a loss, a start-up backlog) and is dropped at once.
LIVE_MARGIN_S = 0.003
# Live mode: a frame may leave this much before its slot when its audio is already there, and a slot
# waits this much past its time for audio that is about to arrive before sending silence.
LIVE_LEAD_S = 0.015
LIVE_GRACE_S = 0.004


class PlayoutListener(Protocol):
    def on_playout_started(self, epoch: int, response_id: str, sample_offset: int, rate: int) -> None: ...

    def on_playout_finished(
        self, epoch: int, response_id: str, played_samples: int, sample_offset: int, rate: int
    ) -> None: ...


@dataclass
class TrackCounters:
    frames: int = 0
    silent_frames: int = 0
    stale_chunks: int = 0  # writes rejected because their epoch was no longer live
    reanchors: int = 0
    trimmed_samples: int = 0  # live mode: standing delay removed
    early_frames: int = 0  # live mode: sent ahead of schedule because the audio was there


class PacedAudioTrack(MediaStreamTrack):
    kind = "audio"

    def __init__(
        self,
        in_rate: int,
        out_rate: int = 48000,
        max_buffer_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        live: bool = False,
    ) -> None:
        super().__init__()
        self.in_rate = in_rate
        self.out_rate = out_rate
        self.max_buffer_s = max_buffer_s
        self.counters = TrackCounters()
        self.listener: PlayoutListener | None = None
        self._clock = clock
        self._buffer = self._new_buffer(0)
        self._retired = PlayoutCounters()
        self._t0: float | None = None
        self._frame_index = 0
        self.live = live
        self._audio_arrived = asyncio.Event()

    # --- configuration -------------------------------------------------------------------------

    def set_output_rate(self, rate: int) -> None:
        """Match the negotiated codec's clock; only before the first frame is sent."""
        if self._t0 is not None or rate == self.out_rate:
            return
        self.out_rate = rate
        self._buffer = self._new_buffer(self._buffer.epoch)

    @property
    def frame_samples(self) -> int:
        return self.out_rate * FRAME_MS // 1000

    # --- the sink the session writes into (session.sink.AudioSink) -------------------------------

    @property
    def epoch(self) -> int:
        return self._buffer.epoch

    @property
    def depth_ms(self) -> float:
        return 1000.0 * self._buffer.depth_samples / self.out_rate

    @property
    def sent_samples(self) -> int:
        return self._frame_index * self.frame_samples

    def write(self, epoch: int, response_id: str, pcm: np.ndarray) -> bool:
        if epoch != self._buffer.epoch:
            self.counters.stale_chunks += 1
            return False
        self._buffer.write(response_id, pcm)
        self._audio_arrived.set()
        return True

    def end_response(self, epoch: int, response_id: str) -> bool:
        if epoch != self._buffer.epoch:
            self.counters.stale_chunks += 1
            return False
        self._buffer.end_response(response_id)
        return True

    def cut(self, new_epoch: int) -> CutReport:
        """Drop everything queued and start a fresh buffer for ``new_epoch``."""
        old = self._buffer
        playing = old.playing
        self._fold_counters(old.counters)
        old.close()
        self._buffer = self._new_buffer(new_epoch)
        return CutReport(
            old_epoch=old.epoch,
            response_id=playing[0] if playing else None,
            played_samples=playing[1] if playing else 0,
            discarded_samples=old.depth_samples,
            sample_offset=self.sent_samples,
            rate=self.out_rate,
        )

    def stop(self) -> None:
        super().stop()
        self._buffer.close()

    def playout_counters(self) -> PlayoutCounters:
        live = self._buffer.counters
        return PlayoutCounters(
            written_samples=self._retired.written_samples + live.written_samples,
            played_samples=self._retired.played_samples + live.played_samples,
            overflow_samples=self._retired.overflow_samples + live.overflow_samples,
            underrun_samples=self._retired.underrun_samples + live.underrun_samples,
        )

    # --- aiortc ----------------------------------------------------------------------------------

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        now = self._clock()
        if self._t0 is None:
            self._t0 = now
        due = self._t0 + self._frame_index * FRAME_MS / 1000
        if now - due > MAX_CATCH_UP_S:
            self._t0 = now - self._frame_index * FRAME_MS / 1000
            self.counters.reanchors += 1
        elif self.live:
            await self._wait_live(due)
        elif due > now:
            await asyncio.sleep(due - now)
        return self._next_frame()

    async def _wait_live(self, due: float) -> None:
        """Send as soon as a frame of audio is there (bounded lead), or silence shortly after the slot."""
        n = self.frame_samples
        while True:
            now = self._clock()
            ready = self._buffer.depth_samples >= n
            if (ready and now >= due - LIVE_LEAD_S) or now >= due + LIVE_GRACE_S:
                break
            self._audio_arrived.clear()
            wake = (due - LIVE_LEAD_S) if ready else (due + LIVE_GRACE_S)
            try:
                await asyncio.wait_for(self._audio_arrived.wait(), wake - now)
            except asyncio.TimeoutError:
                pass
        if self._clock() < due:
            self.counters.early_frames += 1
        excess = self._buffer.depth_samples - n - int(LIVE_MARGIN_S * self.out_rate)
        if excess > 0:
            self.counters.trimmed_samples += self._buffer.discard(excess)

    def _next_frame(self) -> av.AudioFrame:
        n = self.frame_samples
        buffer = self._buffer
        pcm, marks = buffer.read(n)
        offset = self.sent_samples
        self._frame_index += 1
        self.counters.frames += 1
        if not marks and buffer.playing is None:
            self.counters.silent_frames += 1
        if self.listener is not None:
            for mark in marks:
                self._notify(buffer.epoch, mark, offset)
        pcm16 = (np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm16[None, :], format="s16", layout="mono")
        frame.sample_rate = self.out_rate
        frame.pts = offset
        frame.time_base = fractions.Fraction(1, self.out_rate)
        return frame

    def _notify(self, epoch: int, mark: PlayoutMark, frame_offset: int) -> None:
        assert self.listener is not None
        where = frame_offset + mark.offset
        if mark.kind == "started":
            self.listener.on_playout_started(epoch, mark.response_id, where, self.out_rate)
        else:
            self.listener.on_playout_finished(epoch, mark.response_id, mark.played_samples, where, self.out_rate)

    def _new_buffer(self, epoch: int) -> PlayoutBuffer:
        return PlayoutBuffer(epoch, self.in_rate, self.out_rate, int(self.max_buffer_s * self.out_rate))

    def _fold_counters(self, c: PlayoutCounters) -> None:
        self._retired.written_samples += c.written_samples
        self._retired.played_samples += c.played_samples
        self._retired.overflow_samples += c.overflow_samples
        self._retired.underrun_samples += c.underrun_samples
