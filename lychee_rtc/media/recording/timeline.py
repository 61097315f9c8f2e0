"""Where recorded audio lands on the recording's one clock: pure placement, no I/O.

Both channels arrive as streams that are continuous in samples (the uplink conceals its losses, the
outbound side reads a continuous playout) but stamped with times that jitter. A chunk is placed
right after the previous one of its channel while its stamp agrees with that within ``tolerance``;
a larger disagreement is a real break (the caller's media stopped, the carrier idled between
responses, a stall), and the channel re-anchors on the stamp. A chunk stamped earlier than its
place means the anchor was late (the first chunk of a segment was delayed on its way in): the
segment slides back to the earlier stamp, so each channel settles on its least-delayed arrival.
That keeps each channel free of clicks from timestamp jitter and still puts a barge-in where it
happened.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lychee_rtc.pcm import PcmResampler

RATE = 48000  # the recording's rate: Opus's own, so the agent's WebRTC audio goes in untouched
CHANNELS = ("caller", "agent")
# A stamp this far from where the stream says the chunk belongs is a break, not jitter.
TOLERANCE_S = 0.12
# A stamp this much earlier than its place slides the segment back to it.
SLIDE_S = 0.002
# Chunks that need resampling are held (``ChannelPlacer.settle``) up to this long, so that the
# resampler is called a few times a second rather than for every 20 ms chunk.
HOLD_S = 0.2


@dataclass
class PlacementCounters:
    late_samples: int = 0  # arrived after their place had been written out: dropped
    overflow_samples: int = 0  # beyond the buffer's reach (a stamp far in the future): dropped
    reanchors: int = 0
    slides: int = 0


class MixBuffer:
    """The not-yet-written stretch of the recording: ``base`` is the first sample not encoded.

    The stretch lives at ``offset`` in an array twice its capacity, so that handing out what is
    encoded moves a mark instead of the whole buffer; the stretch goes back to the array's start
    once in every ``capacity`` samples handed out (one copy a sample, where moving it at every
    40 ms block copied 4 s of both channels 25 times a second)."""

    def __init__(self, capacity: int, counters: PlacementCounters) -> None:
        self.base = 0
        self.capacity = capacity
        self.counters = counters
        self._data = np.zeros((2 * capacity, len(CHANNELS)), dtype=np.float32)
        self._offset = 0  # where ``base`` is in ``_data``; beyond the stretch everything is zero
        self.end = 0  # one past the last sample placed (absolute position)

    @property
    def data(self) -> np.ndarray:
        """The stretch ``[base, base + capacity)``, a view."""
        return self._data[self._offset:self._offset + self.capacity]

    def place(self, channel: int, position: int, samples: np.ndarray) -> None:
        start = position - self.base
        if start < 0:
            late = min(-start, len(samples))
            self.counters.late_samples += late
            samples = samples[late:]
            start = 0
        room = self.capacity - start
        if len(samples) > room:
            self.counters.overflow_samples += len(samples) - max(room, 0)
            samples = samples[:max(room, 0)]
        if len(samples):
            at = self._offset + start
            self._data[at:at + len(samples), channel] = samples
            self.end = max(self.end, self.base + start + len(samples))

    def erase(self, channel: int, position: int) -> None:
        """Silence ``channel`` from ``position`` on (what a carrier's flush took back)."""
        start = max(0, position - self.base)
        self.data[start:, channel] = 0.0

    def take(self, upto: int) -> np.ndarray:
        """Samples ``[base, upto)``, handed out for encoding and forgotten here."""
        n = max(0, min(upto - self.base, self.capacity))
        out = self._data[self._offset:self._offset + n].copy()
        self._offset += n
        self.base += n
        if self._offset >= self.capacity:  # what is left of the stretch runs to the array's end
            left = len(self._data) - self._offset
            self._data[:left] = self._data[self._offset:]
            self._data[left:] = 0.0
            self._offset = 0
        return out


class ChannelPlacer:
    """One channel's continuity: a resampler to ``RATE`` and where its next sample goes."""

    def __init__(self, channel: int, counters: PlacementCounters, tolerance_s: float = TOLERANCE_S) -> None:
        self.channel = channel
        self.counters = counters
        self.tolerance_s = tolerance_s
        self._rate = 0
        self._resampler: PcmResampler | None = None
        self._next: int | None = None  # output position of the next resampled sample
        self._anchor_s = 0.0  # recording time of the segment's first input sample
        self._consumed = 0  # input samples of this segment so far
        self._pending: list[np.ndarray] = []  # pushed, continuous, not yet resampled (``flush``)

    def expected_s(self) -> float | None:
        return None if self._next is None else self._anchor_s + self._consumed / self._rate

    def push(self, buffer: MixBuffer, at_s: float, samples: np.ndarray, rate: int) -> None:
        expected = self.expected_s()
        if expected is None or rate != self._rate or abs(at_s - expected) > self.tolerance_s:
            if expected is not None:
                self.counters.reanchors += 1
            self._finish_segment(buffer)
            self._rate = rate
            self._resampler = PcmResampler(rate, RATE) if rate != RATE else None
            self._next = round(at_s * RATE)
            self._anchor_s = at_s
            self._consumed = 0
        elif at_s < expected - SLIDE_S and self._next is not None:
            self.flush(buffer)  # what came before the slide stays where it was placed
            early = expected - at_s
            self.counters.slides += 1
            self._anchor_s -= early
            self._next -= round(early * RATE)
        self._consumed += len(samples)
        if self._resampler is None:
            self._put(buffer, samples)
        else:
            self._pending.append(samples)

    def flush(self, buffer: MixBuffer) -> None:
        """Resample and place what ``push`` held: a run of continuous chunks, in one call to the
        resampler (each call costs about as much as resampling a whole 20 ms chunk)."""
        if self._pending and self._resampler is not None:
            self._put(buffer, self._resampler.process(np.concatenate(self._pending)))
        self._pending.clear()

    def settle(self, buffer: MixBuffer, upto: int) -> None:
        """Place what is held if any of it belongs before ``upto`` (the writer is about to reach it)
        or it is ``HOLD_S`` long."""
        if self._pending and (self._next is None or self._next < upto
                              or sum(len(p) for p in self._pending) >= HOLD_S * self._rate):
            self.flush(buffer)

    def shift(self, buffer: MixBuffer, by_s: float) -> None:
        """Stamps move by ``by_s`` from here on (a new compensation): the stream moves with them."""
        self.flush(buffer)
        if self._next is not None:
            self._anchor_s += by_s
            self._next += round(by_s * RATE)

    def cut(self, buffer: MixBuffer, at_s: float) -> None:
        """Nothing placed from ``at_s`` on was heard; the next chunk starts a new segment."""
        self.flush(buffer)
        self._drop_resampler()
        self._next = None
        buffer.erase(self.channel, round(at_s * RATE))

    def close(self, buffer: MixBuffer) -> None:
        self._finish_segment(buffer)

    def _finish_segment(self, buffer: MixBuffer) -> None:
        self.flush(buffer)
        if self._resampler is not None:
            self._put(buffer, self._resampler.flush())
        self._drop_resampler()

    def _drop_resampler(self) -> None:
        if self._resampler is not None:
            self._resampler.close()
            self._resampler = None

    def _put(self, buffer: MixBuffer, out: np.ndarray) -> None:
        if len(out) and self._next is not None:
            buffer.place(self.channel, self._next, out.astype(np.float32, copy=False))
            self._next += len(out)
