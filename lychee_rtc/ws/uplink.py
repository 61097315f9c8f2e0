"""A socket client's audio on its way to the session: in order with its other events, at the engine's pace.

A WebSocket carries audio without timestamps, in appends of any size, as fast as the client sends
them: a framework streams 20-100 ms chunks in real time, an evaluation script sends a whole file at
once. Every append is decoded and resampled to the session's rate as it is read, then queued with
the client's other events in the order they came (``then``): a commit or a cancel sent after some
audio acts once that audio has reached the model. The queue is fed to the session one window at a
time, whenever the engine can take one (``DuplexSession.wait_input_room``), so audio sent faster
than real time is heard as fast as the engine steps and none of it is dropped; the session's
``StreamClock`` keeps the model listening (to silence) when the client stops.

The queue is bounded (``max_pending_s`` of audio): while it is full the transport stops reading the
socket (``wait_room``), so the client's own sends wait; one append larger than the whole bound is
refused with a typed error.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from lychee_rtc.session.session import DuplexSession
from lychee_rtc.ws.formats import AudioFormatError, InputDecoder, SocketAudioFormat

log = logging.getLogger(__name__)


@dataclass
class UplinkCounters:
    appends: int = 0
    appended_samples: int = 0  # at the session's rate
    fed_samples: int = 0
    cleared_samples: int = 0  # dropped by input_audio_buffer.clear before the model heard them
    refused_appends: int = 0
    waits_for_engine: int = 0  # the engine had no room: input waited (sent faster than real time)


class SocketUplink:
    def __init__(self, session: DuplexSession, max_pending_s: float) -> None:
        self.session = session
        self.rate = session.capabilities.input_rate
        self.window = session.capabilities.window_samples
        self.max_pending = int(max_pending_s * self.rate)
        self.counters = UplinkCounters()
        self._decoder = InputDecoder(self.rate)
        self._items: deque[np.ndarray | Callable[[], None]] = deque()
        self._queued = 0  # samples in _items
        self._wake = asyncio.Event()
        self._room = asyncio.Event()
        self._closed = False
        session.input_waiting = lambda: self._queued > 0

    @property
    def queued_samples(self) -> int:
        return self._queued

    @property
    def queued_s(self) -> float:
        return self._queued / self.rate

    # --- from the socket's reader (through the dialect) ---------------------------------------------

    def append(self, data: bytes, fmt: SocketAudioFormat) -> int:
        """Decode ``data`` and queue it; the samples queued (AudioFormatError if it cannot be)."""
        if self._closed:
            return 0
        if fmt.seconds(len(data)) * self.rate > self.max_pending:
            self.counters.refused_appends += 1
            raise AudioFormatError("input_backpressure", f"an append of {fmt.seconds(len(data)):.1f} s of audio "
                                   f"exceeds the {self.max_pending / self.rate:.0f} s this server queues per session")
        samples = self._decoder.decode(data, fmt)
        self.counters.appends += 1
        if len(samples):
            self._items.append(samples)
            self._queued += len(samples)
            self.counters.appended_samples += len(samples)
            self._wake.set()
        return len(samples)

    def then(self, control: Callable[[], None]) -> None:
        """Run ``control`` once the audio queued before it has been fed (at once if there is none)."""
        if self._closed:
            return
        if not self._items:
            control()
        else:
            self._items.append(control)
            self._wake.set()

    def clear(self) -> int:
        """Drop the audio not yet fed to the model (events queued behind it stay); the samples dropped."""
        dropped = self._queued
        self._items = deque(item for item in self._items if not isinstance(item, np.ndarray))
        self._queued = 0
        self.counters.cleared_samples += dropped
        self._room.set()
        return dropped

    def full(self) -> bool:
        return self._queued >= self.max_pending

    async def wait_room(self) -> None:
        """Until the queue is below its bound: the socket's reader waits here before the next frame."""
        while self.full() and not self._closed:
            self._room.clear()
            await self._room.wait()

    def close(self) -> None:
        self._closed = True
        self._items.clear()
        self._queued = 0
        self._room.set()
        self._wake.set()
        self._decoder.close()

    # --- the feeder task -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Feed the queue to the session: a window at a time while the engine has room; controls in turn."""
        while not self._closed:
            if not self._items:
                self._wake.clear()
                await self._wake.wait()
                continue
            head = self._items[0]
            if not isinstance(head, np.ndarray):
                self._items.popleft()
                try:
                    head()
                except Exception:  # a dialect's control reports its own errors; this is a bug
                    log.exception("session %s: a queued client event failed", self.session.id)
                continue
            if not self.session.has_input_room():
                self.counters.waits_for_engine += 1
                await self.session.wait_input_room()
                continue
            # Up to the end of the open window, so each push completes at most one window.
            take = min(len(head), self.window - self._open_fill())
            self.session.push_audio(head[:take])
            self.counters.fed_samples += take
            self._queued -= take
            if take == len(head):
                self._items.popleft()
            else:
                self._items[0] = head[take:]
            self._room.set()
            await asyncio.sleep(0)  # a long backlog must not hold the event loop

    def _open_fill(self) -> int:
        """Samples already in the session's open window."""
        return self.session.window_clock.open_samples
