"""The session's window clock (docs/architecture.md, "Where a 400 ms window goes").

Uplink audio is cut into exact windows of ``window_samples``. The clock is driven by two inputs:
``write`` (decoded samples, appended at the uplink's stream position) and ``gap`` (samples the
uplink lost, known from RTP timestamps). A window that is not full by its deadline,
``t0 + (k + 1) * window + grace``, is completed with silence and counted as an underrun; samples
that arrive afterwards for that closed window are dropped and counted as late. The model is thus
clocked by wall time and never stalled by the network, while everything is counted in samples.

The anchor ``t0`` follows the uplink: when samples turn up late (a longer network path, a sender
clock slower than ours), the deadlines move later until those samples would have had the full
grace, so one late stretch costs its own samples and nothing after it; when windows keep completing
far ahead of their deadlines, the anchor moves earlier again, so a stall is detected within the
grace period.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class Window:
    seq: int
    samples: np.ndarray  # float32, exactly window_samples long
    silence_filled: int  # samples of this window that were filled because the uplink was late


@dataclass
class ClockCounters:
    windows: int = 0
    underruns: int = 0  # windows closed by their deadline rather than by samples
    silence_samples: int = 0  # samples filled at deadlines
    gap_samples: int = 0  # samples the uplink reported lost (filled with silence in place)
    late_samples: int = 0  # samples that arrived after their window had closed
    anchor_shift_s: float = 0.0  # net movement of the deadlines to follow the uplink


class WindowClock:
    def __init__(self, window_samples: int, sample_rate: int, grace_s: float) -> None:
        if window_samples <= 0 or sample_rate <= 0:
            raise ValueError("window_samples and sample_rate must be positive")
        self.window_samples = window_samples
        self.sample_rate = sample_rate
        self.grace_s = grace_s
        self.counters = ClockCounters()
        self._t0: float | None = None
        self._seq = 0  # index of the open window
        self._buf = np.zeros(window_samples, dtype=np.float32)
        self._filled = 0  # samples of the open window written so far (from the front)
        self._received = 0  # uplink stream position of the next sample to arrive
        self._now = 0.0
        # Early-completion tracking: the smallest deadline slack over the last few seconds.
        self._slack_windows = max(4, int(round(2.0 / self.window_s)))
        self._min_slack: float | None = None
        self._slack_count = 0
        self._held_at: float | None = None  # the call is on hold: no windows, no deadlines

    @property
    def held(self) -> bool:
        return self._held_at is not None

    def hold(self, now: float) -> None:
        """Stop the clock (a call on hold): nothing arrives that counts, nothing is due."""
        if self._held_at is None:
            self._held_at = now

    def release(self, now: float) -> None:
        """Start again where the clock stopped: the held time is neither late audio nor underruns."""
        if self._held_at is None:
            return
        if self._t0 is not None:
            self._t0 += now - self._held_at
        self._received = self._seq * self.window_samples + self._filled
        self._held_at = None

    @property
    def position(self) -> int:
        """Uplink samples taken so far: every closed window and the open one's."""
        return self._seq * self.window_samples + self._filled

    @property
    def open_samples(self) -> int:
        """Samples of the open window written so far."""
        return self._filled

    @property
    def started(self) -> bool:
        return self._t0 is not None

    @property
    def window_s(self) -> float:
        return self.window_samples / self.sample_rate

    def start(self, now: float) -> None:
        if self._t0 is None:
            self._t0 = now

    def time_of(self, sample: int) -> float | None:
        """When uplink sample ``sample`` was due to arrive, on the same clock as the deadlines."""
        if self._t0 is None:
            return None
        return self._t0 + sample / self.sample_rate

    def deadline(self, seq: int | None = None) -> float | None:
        if self._t0 is None or self._held_at is not None:
            return None
        k = self._seq if seq is None else seq
        return self._t0 + (k + 1) * self.window_s + self.grace_s

    def write(self, samples: np.ndarray, now: float) -> list[Window]:
        """Append uplink samples; returns the windows this completes (none while held)."""
        if self._held_at is not None:
            return []
        self.start(now)
        out = self.poll(now)
        self._now = now
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        start = self._received
        self._received += len(samples)
        cursor = self._seq * self.window_samples + self._filled
        if start < cursor:  # the head belongs to windows already closed by their deadline
            late = min(cursor - start, len(samples))
            self.counters.late_samples += late
            # Move the deadlines so that the last of these samples would have arrived with the full
            # grace to spare: the windows after it then wait for their audio again.
            last_window = (start + late - 1) // self.window_samples
            self._shift(max(0.0, now + self.grace_s - self.deadline(last_window)))
            samples = samples[late:]
            start += late
        return out + self._fill(samples)

    def resync(self, now: float) -> list[Window]:
        """A new uplink stream (a resumed call): it continues where the clock is now, not where the old
        stream stopped, so the time the path was down is not read as late audio."""
        out = self.poll(now)
        self._received = self._seq * self.window_samples + self._filled
        return out

    def gap(self, n: int, now: float, fill: np.ndarray | None = None) -> list[Window]:
        """The uplink lost ``n`` samples (RTP timestamps jumped): keep their place, as ``fill`` or silence."""
        if n <= 0 or self._held_at is not None:
            return []
        self.start(now)
        out = self.poll(now)
        self._now = now
        start = self._received
        self._received += n
        cursor = self._seq * self.window_samples + self._filled
        lost_end = start + n
        if lost_end <= cursor:
            return out
        count = lost_end - max(start, cursor)
        self.counters.gap_samples += count
        if fill is None:
            return out + self._fill_silence(count)
        fill = np.asarray(fill, dtype=np.float32)[n - count:]
        return out + self._fill(np.pad(fill, (0, max(0, count - len(fill))))[:count])

    def poll(self, now: float) -> list[Window]:
        """Close every window whose deadline has passed, filling what is missing with silence."""
        out: list[Window] = []
        if self._t0 is None or self._held_at is not None:
            return out
        while now >= self.deadline():
            missing = self.window_samples - self._filled
            self._buf[self._filled:] = 0.0
            self.counters.underruns += 1
            self.counters.silence_samples += missing
            out.append(self._close(silence=missing))
        return out

    def _fill_silence(self, n: int) -> list[Window]:
        return self._fill(np.zeros(n, dtype=np.float32))

    def _fill(self, samples: np.ndarray) -> list[Window]:
        out = []
        while len(samples):
            take = min(self.window_samples - self._filled, len(samples))
            self._buf[self._filled:self._filled + take] = samples[:take]
            self._filled += take
            samples = samples[take:]
            if self._filled == self.window_samples:
                out.append(self._close(silence=0))
        return out

    def _shift(self, seconds: float) -> None:
        assert self._t0 is not None
        self._t0 += seconds
        self.counters.anchor_shift_s += seconds

    def _track_slack(self) -> None:
        """A window completed by samples: if windows keep beating their deadlines, pull them in."""
        slack = self.deadline() - self._now
        self._min_slack = slack if self._min_slack is None else min(self._min_slack, slack)
        self._slack_count += 1
        if self._slack_count >= self._slack_windows:
            if self._min_slack > 2 * self.grace_s + 0.005:
                self._shift(-(self._min_slack - self.grace_s))
            self._min_slack, self._slack_count = None, 0

    def _close(self, silence: int) -> Window:
        if silence == 0:
            self._track_slack()
        window = Window(self._seq, self._buf.copy(), silence)
        self._seq += 1
        self._filled = 0
        self.counters.windows += 1
        return window


class StreamClock(WindowClock):
    """The clock of an uplink without timestamps (a WebSocket's appended audio).

    The input's own samples cut the windows, as fast as they arrive: a client sending a file faster
    than real time is heard at the engine's pace. Wall time only stands in when the input stops: a
    window is completed with silence when the rest of its samples are more than the grace late
    (counted from the last sample, as if the client had gone on in real time), and windows of
    silence then follow in real time, so the model keeps listening and its answer keeps flowing.
    Nothing is filled while ``busy()`` (the engine still has this session's windows, or the
    transport still holds input for it): then the input is not missing, only waiting. Samples that
    come after a window was filled go on in the next one; without timestamps nothing is late.
    """

    def __init__(self, window_samples: int, sample_rate: int, grace_s: float,
                 busy: Callable[[], bool] = lambda: False) -> None:
        super().__init__(window_samples, sample_rate, grace_s)
        self._busy = busy
        self._due: float | None = None

    def start(self, now: float) -> None:
        if self._t0 is None:
            self._t0 = now
            self._due = now + self.window_s + self.grace_s

    def time_of(self, sample: int) -> float | None:
        return None  # no sample is due at a wall time here

    def deadline(self, seq: int | None = None) -> float | None:
        if self._due is None or self._held_at is not None:
            return None
        return self._due + (0 if seq is None else (seq - self._seq) * self.window_s)

    def release(self, now: float) -> None:
        held = self._held_at is not None
        super().release(now)
        if held and self._due is not None:
            self._expect_rest(now)

    def write(self, samples: np.ndarray, now: float) -> list[Window]:
        if self._held_at is not None:
            return []
        self.start(now)
        out = self.poll(now)
        self._now = now
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        self._received = self._seq * self.window_samples + self._filled + len(samples)
        out += self._fill(samples)
        self._expect_rest(now)
        return out

    def gap(self, n: int, now: float, fill: np.ndarray | None = None) -> list[Window]:
        if n <= 0 or self._held_at is not None:
            return []
        self.counters.gap_samples += n
        samples = np.zeros(n, np.float32)
        if fill is not None:
            samples[:min(n, len(fill))] = np.asarray(fill, np.float32)[:n]
        return self.write(samples, now)

    def resync(self, now: float) -> list[Window]:
        return self.poll(now)

    def poll(self, now: float) -> list[Window]:
        out: list[Window] = []
        while self._due is not None and self._held_at is None and now >= self._due:
            if self._busy():
                self._expect_rest(now)  # the input is there, waiting for the engine: not missing
                break
            missing = self.window_samples - self._filled
            self._buf[self._filled:] = 0.0
            self.counters.underruns += 1
            self.counters.silence_samples += missing
            out.append(self._close(silence=missing))
            self._due += self.window_s  # silence goes on in real time
        return out

    def _expect_rest(self, now: float) -> None:
        """The open window is due when its missing samples would have come in real time, plus grace."""
        self._due = now + (self.window_samples - self._filled) / self.sample_rate + self.grace_s

    def _track_slack(self) -> None:
        pass  # there is no anchor to follow
