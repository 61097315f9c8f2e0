"""The outbound audio track: engine PCM paced out as 20 ms (or 10 ms) frames on a monotonic schedule.

aiortc's sender pulls ``recv()`` as fast as it returns, so the pacing lives here: frame ``n`` is
released at ``t0 + n * frame_ms`` with pts ``n * frame_samples``, and a frame of silence goes out
whenever nothing is queued. RTP timestamps thus keep to the send clock: after a stall too long to
catch up on, the slots it took are skipped and the timestamps jump with them, so the receiver's
jitter buffer sees a gap instead of every later packet arriving late. The track writes at the
negotiated codec's clock (48 kHz for Opus, 8 kHz for G.711) so the encoder never has to resample.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError

from lychee_rtc.aio import wait_event
from lychee_rtc.media.epoch_sink import EpochSink, SinkCounters
from lychee_rtc.media.playout import EpochPlayout
from lychee_rtc.rtc.packet_time import EncoderHints, PcmFrame
from lychee_rtc.rtc.send_phase import ArrivalPhase, SendPhase

FRAME_MS = 20  # the default; rtc.send_frame_ms picks 10 (each frame is one RTP packet)
# Past this much lateness (an event-loop stall) the missed slots are skipped instead of sent in a burst.
MAX_CATCH_UP_S = 0.2
# Live mode: a frame may leave this much before its slot when its audio is already there, and a slot
# waits this much past its time for audio that is about to arrive before sending silence.
LIVE_LEAD_S = 0.015
LIVE_GRACE_S = 0.004
# Opus's algorithmic delay (libopus's lookahead, 312 samples at 48 kHz: measured through aiortc's
# encoder and decoder): what comes out of a decoder is this much older than what went into the encoder.
OPUS_DELAY_S = 312 / 48000


@dataclass
class TrackCounters(SinkCounters):
    frames: int = 0
    silent_frames: int = 0
    stalls: int = 0  # times the sender was too late to catch up and skipped slots
    skipped_frames: int = 0  # slots skipped after stalls (the RTP timestamps jumped over them)
    early_frames: int = 0  # live mode: sent ahead of schedule because the audio was there


class PacedAudioTrack(MediaStreamTrack, EpochSink):
    """An aiortc track, and the session's sink (``EpochSink``) it plays from."""

    kind = "audio"
    counters: TrackCounters
    reference_continuous = True  # a frame every slot, silence included (EpochSink)

    def __init__(
        self,
        in_rate: int,
        out_rate: int = 48000,
        max_buffer_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        live: bool = False,
        frame_ms: int = FRAME_MS,
        live_lead_s: float = LIVE_LEAD_S,
        encoder_hints: EncoderHints | None = None,
        steady: bool = False,
    ) -> None:
        super().__init__()  # MediaStreamTrack's
        EpochSink.__init__(self, EpochPlayout(in_rate, out_rate, max_buffer_s), TrackCounters())
        self._clock = clock
        self._t0: float | None = None
        self._frame_index = 0
        self.live = live
        self.frame_ms = frame_ms
        self.live_lead_s = live_lead_s
        self.encoder_hints = encoder_hints
        # Live mode: a steady send point after the arrivals (send_phase.py), or as soon as the
        # audio is there within the lead.
        self.send_phase = SendPhase(live_lead_s, frame_ms / 1000) if live and steady else None
        self.arrival_phase = ArrivalPhase() if live and not steady else None

    # --- configuration -------------------------------------------------------------------------

    @property
    def in_rate(self) -> int:
        return self.playout.in_rate

    @property
    def out_rate(self) -> int:
        return self.playout.out_rate

    def use_codec(self, name: str, rate: int) -> None:
        """The negotiated codec: its clock (only before the first frame is sent) and its delay."""
        opus = name.lower() == "opus"
        if self._t0 is None:
            self.playout.set_output_rate(48000 if opus else rate)
        self.codec_delay_s = OPUS_DELAY_S if opus else 0.0  # G.711 codes each sample alone

    @property
    def frame_samples(self) -> int:
        return self.out_rate * self.frame_ms // 1000

    @property
    def sent_samples(self) -> int:
        return self.playout.position

    def stop(self) -> None:
        super().stop()
        self.playout.close()

    # --- aiortc ----------------------------------------------------------------------------------

    async def recv(self) -> av.AudioFrame:
        """The next frame as aiortc's encoders take it (where the sender does not encode inline)."""
        return (await self.next_pcm()).to_av()

    async def next_pcm(self) -> PcmFrame:
        """The next frame, released on the send schedule, as 16-bit samples (``rtc/inline_encoder.py``)."""
        if self.readyState != "live":
            raise MediaStreamError
        now = self._clock()
        if self._t0 is None:
            self._t0 = now
        due = self._due()
        if now - due > MAX_CATCH_UP_S:
            self._skip_stalled_slots(now - due)
            due = self._due()
        if self.live:
            await self._wait_live(due)
        elif due > now:
            await asyncio.sleep(due - now)
        return self._next_frame()

    def _due(self) -> float:
        assert self._t0 is not None
        return self._t0 + self._frame_index * self.frame_ms / 1000

    def _skip_stalled_slots(self, late_s: float) -> None:
        """The slots a stall took stay unsent. Keeping the schedule and moving the stream position
        past them makes the RTP timestamps jump by the stall: had the schedule moved instead, every
        later packet would carry a timestamp that much older than its send time, and the receiver's
        jitter buffer would keep that as delay for the rest of the call (aiortc's for good, NetEq's
        until it slowly compresses it away). What the sink held stays queued (a passthrough engine's
        then reads as standing delay and is dropped)."""
        missed = int(late_s * 1000 // self.frame_ms)
        self._frame_index += missed
        self.playout.skip(missed * self.frame_samples)
        self.counters.stalls += 1
        self.counters.skipped_frames += missed

    async def _wait_live(self, due: float) -> None:
        """Send when the frame's audio is there and its send point (``_send_offset``) has come, or
        silence shortly after the slot when the audio is late."""
        n = self.frame_samples
        send_at = due + self._send_offset()
        give_up = max(due, send_at) + LIVE_GRACE_S
        ready_at: float | None = None
        arrived = False  # the audio came while this frame waited (not queued before it was asked for)
        waits = 0
        while True:
            now = self._clock()
            if ready_at is None and self.playout.depth_samples >= n:
                ready_at, arrived = now, waits > 0
            if (ready_at is not None and now >= send_at) or now >= give_up:
                break
            self._audio_arrived.clear()
            await wait_event(self._audio_arrived, (send_at if ready_at is not None else give_up) - now)
            waits += 1
        if ready_at is not None and self.send_phase is not None:
            self.send_phase.observe(ready_at, ready_at - due)
        if self.arrival_phase is not None:
            waited = send_at - ready_at if ready_at is not None and arrived else None
            assert self._t0 is not None
            self._t0 -= self.arrival_phase.observe(waited)  # the next frames' slots, not this one's
        if self._clock() < due:
            self.counters.early_frames += 1
        self.trim_standing_delay(n)

    def _send_offset(self) -> float:
        return self.send_phase.offset() if self.send_phase is not None else -self.live_lead_s

    def _next_frame(self) -> PcmFrame:
        first = self._frame_index == 0
        epoch = self.playout.epoch
        pcm, marks, offset = self.playout.read(self.frame_samples)
        self.played(pcm)  # silence too: the caller's loudspeaker played it (the echo reference)
        if self.sent_tap is not None:
            # RTP has no playout receipts: a frame is heard as it leaves, now. That is before its slot
            # when a passthrough engine's frame goes early (live mode) and after it when the loop is
            # late; the recording keeps each channel continuous and on its least-delayed frames.
            self.sent_tap.agent_sent(pcm, self.out_rate, self._clock())
        self._frame_index += 1
        self.counters.frames += 1
        if not marks and self.playout.playing is None:
            self.counters.silent_frames += 1
        for mark in marks:  # a WebRTC frame counts as heard once it leaves: RTP has no playout receipts
            self.playout.notify(epoch, mark, offset)
        pcm16 = (np.clip(pcm, -1.0, 1.0) * 32767.0).astype(np.int16)
        # The encoder sets itself up from the first frame.
        return PcmFrame(pcm16, offset, self.out_rate, self.encoder_hints if first else None)
