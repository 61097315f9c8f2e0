"""Inbound jitter handling tuned for a model, not a loudspeaker.

aiortc's audio jitter buffer holds four packets before releasing one, and after a loss it waits for
its 16-packet ring to overflow, then keeps that extra depth for the rest of the call. Our consumer
is the window clock, which tolerates arrival jitter by itself (a window only needs its samples by
its deadline), so this buffer does two things only: put packets back in order, and give up on a
missing packet after a short wait. Packets in order are released at once; after a loss every
packet that was waiting is released together, so no delay is ever kept. The missing time shows up
as a timestamp gap, which the inbound path fills in place.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from aiortc.jitterbuffer import JitterFrame
from aiortc.rtp import RtpPacket
from aiortc.utils import uint16_add

from lychee_rtc.config import RtcSettings

# A sequence jump this large is a new stream (sender restart), not loss.
MAX_JUMP = 200
# Never hold more than this many packets waiting for a missing one.
MAX_HELD = 32


@dataclass
class JitterCounters:
    packets: int = 0
    released: int = 0
    lost: int = 0  # declared lost after the wait
    late: int = 0  # arrived after their slot was given up (or duplicates)
    resets: int = 0


class LowLatencyJitterBuffer:
    def __init__(self, max_wait_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_wait_s = max_wait_s
        self.counters = JitterCounters()
        self._clock = clock
        self._next: int | None = None  # next sequence number to release
        self._held: dict[int, tuple[RtpPacket, float]] = {}

    def add(self, packet: RtpPacket) -> list[JitterFrame]:
        """Returns the frames that can be decoded now, in order."""
        now = self._clock()
        seq = packet.sequence_number
        self.counters.packets += 1
        if self._next is None:
            self._next = seq
        distance = uint16_add(seq, -self._next)
        if distance >= 0x8000:  # behind the release point: late or duplicate
            if uint16_add(self._next, -seq) > MAX_JUMP:
                self._reset(seq)
            else:
                self.counters.late += 1
                return []
        elif distance > MAX_JUMP:
            self._reset(seq)
        if seq in self._held:
            self.counters.late += 1
            return []
        self._held[seq] = (packet, now)
        return self._release(now)

    def _reset(self, seq: int) -> None:
        self.counters.resets += 1
        self._held.clear()
        self._next = seq

    def _release(self, now: float) -> list[JitterFrame]:
        out: list[JitterFrame] = []
        while self._held:
            assert self._next is not None
            item = self._held.pop(self._next, None)
            if item is not None:
                out.append(JitterFrame(data=item[0]._data, timestamp=item[0].timestamp))  # type: ignore[attr-defined]
                self._next = uint16_add(self._next, 1)
                continue
            # The head is missing: wait for it, but only briefly and only for so many packets.
            oldest = min(t for _, t in self._held.values())
            if now - oldest < self.max_wait_s and len(self._held) < MAX_HELD:
                break
            first = min(self._held, key=lambda s: uint16_add(s, -self._next))
            self.counters.lost += uint16_add(first, -self._next)
            self._next = first
        self.counters.released += len(out)
        return out


class _ReceiverAdapter:
    """Stands in for aiortc's buffer inside an RTCRtpReceiver.

    aiortc's receiver decodes at most the one frame ``add`` returns; after a loss we may release
    several, so frames go straight into the receiver's decoder queue (with the receiver's own
    timestamp mapping) and ``add`` reports none.
    """

    def __init__(self, receiver, buffer: LowLatencyJitterBuffer) -> None:
        self.buffer = buffer
        self._receiver = receiver
        self.capacity = MAX_HELD

    def add(self, packet: RtpPacket) -> tuple[bool, None]:
        frames = self.buffer.add(packet)
        if frames:
            r = self._receiver
            codec = r._RTCRtpReceiver__codecs[packet.payload_type]
            mapper = r._RTCRtpReceiver__timestamp_mapper
            if r._RTCRtpReceiver__decoder_thread:
                for frame in frames:
                    frame.timestamp = mapper.map(frame.timestamp)
                    r._RTCRtpReceiver__decoder_queue.put((codec, frame))
        return False, None


def install_jitter_buffer(pc, track, settings: RtcSettings) -> LowLatencyJitterBuffer | None:
    """Replace aiortc's audio jitter buffer for ``track`` unless configured to keep it."""
    if settings.jitter_buffer != "lowlatency":
        return None
    for transceiver in pc.getTransceivers():
        receiver = transceiver.receiver
        if receiver is not None and receiver.track is track:
            buffer = LowLatencyJitterBuffer(settings.jitter_target_ms / 1000.0)
            receiver._RTCRtpReceiver__jitter_buffer = _ReceiverAdapter(receiver, buffer)
            return buffer
    return None
