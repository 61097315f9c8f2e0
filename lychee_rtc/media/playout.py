"""The playout buffer: engine PCM of one epoch, waiting to be paced out, and the epoch-fenced sink
built on it that every transport (WebRTC track, carrier WebSocket) plays from.

A buffer belongs to exactly one epoch. On interruption the sink drops the whole object and starts
a new one, so a producer still holding the old buffer (or writing with an old epoch) can never put
audio into the live stream. Each response gets its own resampler for the same reason. Nothing here
imports a transport library: the WebRTC and telephony edges share it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from lychee_rtc.pcm import PcmResampler
from lychee_rtc.session.sink import CutReport


@dataclass(frozen=True)
class PlayoutMark:
    """Something that happened inside a frame read from the buffer."""

    kind: str  # "started" | "finished"
    response_id: str
    offset: int  # sample offset inside the frame just read
    played_samples: int = 0  # for "finished": samples of this response that were played


@dataclass
class _Segment:
    response_id: str
    samples: np.ndarray
    end: bool = False  # marks the end of its response; carries no samples


@dataclass
class PlayoutCounters:
    written_samples: int = 0
    played_samples: int = 0
    overflow_samples: int = 0  # dropped because the buffer hit its bound
    underrun_samples: int = 0  # silence played while a response was still expected to continue


class PlayoutBuffer:
    def __init__(self, epoch: int, in_rate: int, out_rate: int, max_samples: int) -> None:
        self.epoch = epoch
        self.in_rate = in_rate
        self.out_rate = out_rate
        self.max_samples = max_samples
        self.counters = PlayoutCounters()
        self._segments: deque[_Segment] = deque()
        self._size = 0
        self._writer: tuple[str, PcmResampler] | None = None
        self._playing: str | None = None  # response whose samples are being read
        # Played samples of the responses still queued or playing; an entry goes when its response ends.
        self._played: dict[str, int] = {}

    @property
    def depth_samples(self) -> int:
        return self._size

    @property
    def queued(self) -> bool:
        """Anything left to read, audio or an end-of-response marker."""
        return bool(self._segments)

    @property
    def ending(self) -> bool:
        """An end-of-response marker is queued: what is left will not grow into a full frame."""
        return any(seg.end for seg in self._segments)

    @property
    def playing(self) -> tuple[str, int] | None:
        """(response_id, samples played so far) of the response currently audible."""
        if self._playing is None:
            return None
        return self._playing, self._played.get(self._playing, 0)

    def played_samples(self, response_id: str) -> int:
        return self._played.get(response_id, 0)

    def write(self, response_id: str, pcm: np.ndarray) -> None:
        resampler = self._resampler_for(response_id)
        self._append(response_id, resampler.process(pcm))

    def end_response(self, response_id: str) -> None:
        if self._writer is not None and self._writer[0] == response_id:
            self._append(response_id, self._writer[1].flush())
            self._writer = None
        self._segments.append(_Segment(response_id, np.zeros(0, np.float32), end=True))

    def read(self, n: int) -> tuple[np.ndarray, list[PlayoutMark]]:
        out = np.zeros(n, dtype=np.float32)
        marks: list[PlayoutMark] = []
        pos = 0
        while pos < n and self._segments:
            seg = self._segments[0]
            if seg.end:
                self._segments.popleft()
                marks.append(PlayoutMark("finished", seg.response_id, pos, self._played.pop(seg.response_id, 0)))
                if self._playing == seg.response_id:
                    self._playing = None
                continue
            if self._playing != seg.response_id:
                self._playing = seg.response_id
                self._forget_finished(seg.response_id)
                self._played.setdefault(seg.response_id, 0)
                marks.append(PlayoutMark("started", seg.response_id, pos))
            take = min(n - pos, len(seg.samples))
            out[pos:pos + take] = seg.samples[:take]
            seg.samples = seg.samples[take:]
            pos += take
            self._size -= take
            self._played[seg.response_id] += take
            if len(seg.samples) == 0:
                self._segments.popleft()
        self.counters.played_samples += pos
        if pos < n and self._playing is not None:
            self.counters.underrun_samples += n - pos
        # A response that ended exactly on the frame boundary reports its end now, not a frame late.
        if self._segments and self._segments[0].end:
            seg = self._segments.popleft()
            marks.append(PlayoutMark("finished", seg.response_id, pos, self._played.pop(seg.response_id, 0)))
            if self._playing == seg.response_id:
                self._playing = None
        return out, marks

    def _forget_finished(self, playing: str) -> None:
        """Drop the counts of responses that ended without an end mark (superseded): nothing of them is left."""
        queued = {seg.response_id for seg in self._segments}
        for response_id in [r for r in self._played if r != playing and r not in queued]:
            del self._played[response_id]

    def close(self) -> None:
        """Free the response resampler now; the buffer is not written to afterwards."""
        if self._writer is not None:
            self._writer[1].close()
            self._writer = None

    def discard(self, n: int) -> int:
        """Drop up to ``n`` of the oldest queued samples (end markers stay); returns how many."""
        dropped = 0
        for seg in self._segments:
            if dropped >= n:
                break
            k = min(len(seg.samples), n - dropped)
            seg.samples = seg.samples[k:]
            dropped += k
        self._size -= dropped
        self._segments = deque(s for s in self._segments if s.end or len(s.samples))
        return dropped

    def _resampler_for(self, response_id: str) -> PcmResampler:
        if self._writer is None or self._writer[0] != response_id:
            if self._writer is not None:  # previous response never ended: keep its tail (flush frees it)
                self._append(self._writer[0], self._writer[1].flush())
            self._writer = (response_id, PcmResampler(self.in_rate, self.out_rate))
        return self._writer[1]

    def _append(self, response_id: str, samples: np.ndarray) -> None:
        if len(samples) == 0:
            return
        self._segments.append(_Segment(response_id, samples))
        self._size += len(samples)
        self.counters.written_samples += len(samples)
        # Bounded: drop the oldest audio rather than grow; a paced producer never gets here.
        if self._size > self.max_samples:
            self.counters.overflow_samples += self.discard(self._size - self.max_samples)


class PlayoutListener(Protocol):
    """Who hears about playout marks (the session)."""

    def on_playout_started(self, epoch: int, response_id: str, sample_offset: int, rate: int) -> None: ...

    def on_playout_finished(
        self, epoch: int, response_id: str, played_samples: int, sample_offset: int, rate: int
    ) -> None: ...


class EpochPlayout:
    """The session's audio sink, whatever carries the audio: one ``PlayoutBuffer`` per epoch.

    A transport reads fixed frames from it at its own pace (``read``), which advances the outbound
    stream position; a cut starts a fresh buffer so nothing of an older epoch can be read again.
    The transport decides when a read frame counts as heard and tells the listener (``notify``):
    at once for WebRTC, when the carrier echoes a mark for a phone call.
    """

    def __init__(self, in_rate: int, out_rate: int, max_buffer_s: float) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self.max_buffer_s = max_buffer_s
        self.listener: PlayoutListener | None = None
        self.stale_chunks = 0  # writes rejected because their epoch was no longer live
        self.position = 0  # outbound samples read or skipped so far: the stream offset of the next read
        self._buffer = self._new_buffer(0)
        self._retired = PlayoutCounters()

    def set_output_rate(self, rate: int) -> None:
        """Match the transport's clock; only before the first read."""
        if self.position or rate == self.out_rate:
            return
        self.out_rate = rate
        self._buffer.close()
        self._buffer = self._new_buffer(self._buffer.epoch)

    # --- the AudioSink protocol (session.sink) ---------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._buffer.epoch

    @property
    def depth_samples(self) -> int:
        return self._buffer.depth_samples

    @property
    def depth_ms(self) -> float:
        return 1000.0 * self._buffer.depth_samples / self.out_rate

    @property
    def playing(self) -> tuple[str, int] | None:
        return self._buffer.playing

    @property
    def queued(self) -> bool:
        return self._buffer.queued

    @property
    def ending(self) -> bool:
        return self._buffer.ending

    def write(self, epoch: int, response_id: str, pcm: np.ndarray) -> bool:
        if epoch != self._buffer.epoch:
            self.stale_chunks += 1
            return False
        self._buffer.write(response_id, pcm)
        return True

    def end_response(self, epoch: int, response_id: str) -> bool:
        if epoch != self._buffer.epoch:
            self.stale_chunks += 1
            return False
        self._buffer.end_response(response_id)
        return True

    def cut(self, new_epoch: int) -> CutReport:
        """Drop everything queued and start a fresh buffer for ``new_epoch``."""
        old = self._buffer
        playing = old.playing
        self._fold(old.counters)
        old.close()
        self._buffer = self._new_buffer(new_epoch)
        return CutReport(
            old_epoch=old.epoch,
            response_id=playing[0] if playing else None,
            played_samples=playing[1] if playing else 0,
            discarded_samples=old.depth_samples,
            sample_offset=self.position,
            rate=self.out_rate,
        )

    def close(self) -> None:
        """The transport has stopped: free the live buffer's resampler now."""
        self._buffer.close()

    # --- the transport's side --------------------------------------------------------------------

    def read(self, n: int) -> tuple[np.ndarray, list[PlayoutMark], int]:
        """The next ``n`` outbound samples, the marks inside them, and their stream offset."""
        pcm, marks = self._buffer.read(n)
        offset = self.position
        self.position += n
        return pcm, marks, offset

    def discard(self, n: int) -> int:
        return self._buffer.discard(n)

    def skip(self, n: int) -> None:
        """``n`` samples of outbound stream time went by unsent (the sender stalled): the next read
        starts that much later on the stream, with nothing taken from the queue."""
        self.position += n

    def notify(self, epoch: int, mark: PlayoutMark, frame_offset: int) -> None:
        """Tell the listener that ``mark`` (read in the frame at ``frame_offset``) was heard."""
        if self.listener is None:
            return
        where = frame_offset + mark.offset
        if mark.kind == "started":
            self.listener.on_playout_started(epoch, mark.response_id, where, self.out_rate)
        else:
            self.listener.on_playout_finished(epoch, mark.response_id, mark.played_samples, where, self.out_rate)

    def playout_counters(self) -> PlayoutCounters:
        live = self._buffer.counters
        return PlayoutCounters(
            written_samples=self._retired.written_samples + live.written_samples,
            played_samples=self._retired.played_samples + live.played_samples,
            overflow_samples=self._retired.overflow_samples + live.overflow_samples,
            underrun_samples=self._retired.underrun_samples + live.underrun_samples,
        )

    def _new_buffer(self, epoch: int) -> PlayoutBuffer:
        return PlayoutBuffer(epoch, self.in_rate, self.out_rate, int(self.max_buffer_s * self.out_rate))

    def _fold(self, c: PlayoutCounters) -> None:
        self._retired.written_samples += c.written_samples
        self._retired.played_samples += c.played_samples
        self._retired.overflow_samples += c.overflow_samples
        self._retired.underrun_samples += c.underrun_samples
