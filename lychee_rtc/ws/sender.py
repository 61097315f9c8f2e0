"""The session's answer on a socket: audio events as soon as the engine made them, epoch-fenced.

A socket client plays what it receives (a framework's audio output, a file being written), so the
answer leaves as the engine makes it, in chunks of at most ``MAX_CHUNK_S``, the way OpenAI's own
service sends faster than real time; the client tells what it really played (``truncate``,
``playback.ack``), which the session's ledger keeps. A socket has no playout receipt of its own:
a response counts as started and finished when its first and last samples left.

Audio moves from the playout buffer to the socket only while the socket's queue has room
(``has_room``): a client that reads slowly holds the rest in the playout buffer, whose bound
(``session.playout_max_s``) drops the oldest audio and counts it; its other events are the
socket's business. On a cut the queue gives back the chunks of the old epoch not yet written
(``on_cut``), so nothing of a cancelled response follows its end.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

import numpy as np

from lychee_rtc.media.epoch_sink import EpochSink, SinkCounters
from lychee_rtc.media.playout import EpochPlayout, PlayoutMark
from lychee_rtc.session.sink import CutReport

MAX_CHUNK_S = 0.2

# (epoch, response id, PCM at the engine's output rate) -> False if the socket could not take it.
Deliver = Callable[[int, str, np.ndarray], bool]


@dataclass
class SocketSenderCounters(SinkCounters):
    chunks: int = 0
    sent_samples: int = 0
    refused_chunks: int = 0  # the socket refused a chunk (closed under us)


class SocketSender(EpochSink):
    counters: SocketSenderCounters

    def __init__(self, rate: int, max_buffer_s: float) -> None:
        super().__init__(EpochPlayout(rate, rate, max_buffer_s), SocketSenderCounters())
        self.rate = rate
        self.deliver: Deliver | None = None  # set by the dialect that writes audio events
        self.has_room: Callable[[], bool] = lambda: True
        self.on_cut: Callable[[int], None] | None = None  # the socket takes back chunks of older epochs
        self.room = asyncio.Event()  # set when the socket's queue drains
        self._current: str | None = None  # the response whose audio is being read
        self._stopped = False

    def cut(self, new_epoch: int) -> CutReport:
        report = super().cut(new_epoch)
        self._current = None
        if self.on_cut is not None:
            self.on_cut(new_epoch)
        return report

    def stop(self) -> None:
        self._stopped = True
        self._audio_arrived.set()
        self.room.set()
        self.playout.close()

    async def run(self) -> None:
        """The sender task: drain whatever the engine wrote, whenever the socket has room."""
        while not self._stopped:
            self._audio_arrived.clear()
            self.room.clear()
            blocked = self.drain()
            await (self.room.wait() if blocked else self._audio_arrived.wait())

    def drain(self) -> bool:
        """Send what is queued; True if the socket's queue stopped it (wait for room, not for audio)."""
        step = int(MAX_CHUNK_S * self.rate)
        while self.playout.queued and not self._stopped:
            if not self.has_room():
                return True
            epoch = self.playout.epoch
            pcm, marks, offset = self.playout.read(min(step, self.playout.depth_samples))
            self._pass_on(epoch, pcm, marks, offset)
        return False

    def _pass_on(self, epoch: int, pcm: np.ndarray, marks: list[PlayoutMark], offset: int) -> None:
        """Hand on the frame's audio response by response; marks are reported where they fall."""
        cursor, current = 0, self._current
        for mark in marks:
            if mark.offset > cursor and current is not None:
                self._send(epoch, current, pcm[cursor:mark.offset])
                cursor = mark.offset
            if mark.kind == "started":
                current = mark.response_id
                self.playout.notify(epoch, mark, offset)
            else:
                self.playout.notify(epoch, mark, offset)
                if current == mark.response_id:
                    current = None
        if cursor < len(pcm) and current is not None:
            self._send(epoch, current, pcm[cursor:])
        self._current = current

    def _send(self, epoch: int, response_id: str, pcm: np.ndarray) -> None:
        if self.deliver is None or not len(pcm):
            return
        if self.deliver(epoch, response_id, pcm):
            self.counters.chunks += 1
            self.counters.sent_samples += len(pcm)
        else:
            self.counters.refused_chunks += 1
