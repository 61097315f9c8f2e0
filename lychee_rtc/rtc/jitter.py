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

import asyncio
import logging

from aiortc.jitterbuffer import JitterFrame
from aiortc.rtp import RtpPacket
from aiortc.utils import uint16_add

from lychee_rtc.config import RtcSettings

log = logging.getLogger(__name__)

# A sequence jump this large is a new stream (sender restart), not loss.
MAX_JUMP = 200
# Packets this far behind are dropped as late; only this many in a row mean the sender restarted.
RESTART_AFTER = 3
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
        self._behind = 0  # consecutive packets far behind the release point

    def add(self, packet: RtpPacket) -> list[JitterFrame]:
        """Returns the frames that can be decoded now, in order."""
        now = self._clock()
        seq = packet.sequence_number
        self.counters.packets += 1
        if self._next is None:
            self._next = seq
        distance = uint16_add(seq, -self._next)
        if distance >= 0x8000:  # behind the release point: late, a duplicate, or a restarted sender
            far = uint16_add(self._next, -seq) > MAX_JUMP
            self._behind = self._behind + 1 if far else 0
            if not far or self._behind < RESTART_AFTER:
                self.counters.late += 1
                return []
            self._reset(seq)
        elif distance > MAX_JUMP:
            self._reset(seq)
        self._behind = 0
        if seq in self._held:
            self.counters.late += 1
            return []
        self._held[seq] = (packet, now)
        return self._release(now)

    @property
    def waiting(self) -> bool:
        return bool(self._held)

    def release_due(self) -> list[JitterFrame]:
        """Called by a timer: give up on a missing packet even if no new packet arrives."""
        return self._release(self._clock()) if self._held else []

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


# The receiver internals the adapter uses (aiortc 1.x). install_jitter_buffer checks them first and
# keeps aiortc's own buffer, with a warning, if they are not there.
_RECEIVER_FIELDS = ("_RTCRtpReceiver__jitter_buffer", "_RTCRtpReceiver__codecs",
                    "_RTCRtpReceiver__timestamp_mapper", "_RTCRtpReceiver__decoder_queue",
                    "_RTCRtpReceiver__decoder_thread")


class _ReceiverAdapter:
    """Stands in for aiortc's buffer inside an RTCRtpReceiver.

    aiortc's receiver decodes at most the one frame ``add`` returns; after a loss we may release
    several, so ``add`` reports none and the frames go on from here: to ``decode`` (the call's
    ``InlineDecoder``, on the event loop) when given, else into the receiver's decoder queue, with
    the receiver's own timestamp mapping either way. A timer gives up on a missing packet when no
    further packet arrives (a talk spurt ending just after a loss).
    """

    def __init__(self, receiver, buffer: LowLatencyJitterBuffer,
                 decode: Callable[[object, bytes, int], None] | None = None) -> None:
        self.buffer = buffer
        self._receiver = receiver
        self._inline = decode
        self.capacity = MAX_HELD
        self._timer: asyncio.TimerHandle | None = None
        self._payload_type: int | None = None

    def add(self, packet: RtpPacket) -> tuple[bool, None]:
        self._payload_type = packet.payload_type
        self._decode(self.buffer.add(packet))
        if self.buffer.waiting:
            self._arm_timer()
        return False, None

    def _arm_timer(self) -> None:
        if self.buffer.waiting and self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.buffer.max_wait_s, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._decode(self.buffer.release_due())
        self._arm_timer()

    def _decode(self, frames: list[JitterFrame]) -> None:
        r = self._receiver
        if not frames or not r._RTCRtpReceiver__decoder_thread:
            return
        codec = r._RTCRtpReceiver__codecs.get(self._payload_type)
        if codec is None:
            return
        mapper = r._RTCRtpReceiver__timestamp_mapper
        for frame in frames:
            frame.timestamp = mapper.map(frame.timestamp)
            if self._inline is not None:
                self._inline(codec, frame.data, frame.timestamp)
            else:
                r._RTCRtpReceiver__decoder_queue.put((codec, frame))


def install_jitter_buffer(pc, track, settings: RtcSettings,
                          decode: Callable[[object, bytes, int], None] | None = None) -> LowLatencyJitterBuffer | None:
    """Replace aiortc's audio jitter buffer for ``track`` unless configured to keep it.

    ``decode(codec, payload, timestamp)``: decodes each released packet on the event loop instead of
    aiortc's decoder thread (which then gets nothing, and the track no frames). Returns None where
    aiortc's buffer stays; then so does its decoder thread, and ``decode`` is not used."""
    if settings.jitter_buffer != "lowlatency":
        return None
    for transceiver in pc.getTransceivers():
        receiver = transceiver.receiver
        if receiver is not None and receiver.track is track:
            missing = [f for f in _RECEIVER_FIELDS if not hasattr(receiver, f)]
            if missing:
                log.warning("aiortc's receiver lacks %s; keeping its own jitter buffer", ", ".join(missing))
                return None
            buffer = LowLatencyJitterBuffer(settings.jitter_target_ms / 1000.0)
            receiver._RTCRtpReceiver__jitter_buffer = _ReceiverAdapter(receiver, buffer, decode)
            return buffer
    return None
