"""The session's uplink: samples and gaps in, whole windows out to the engine, on the window clock.

The transport pushes decoded audio and the gaps it lost as they come; ``WindowClock``
(``session/clock.py``) cuts them into windows, and this side hands each complete window on and keeps
a timer on the next deadline, so a window the network did not deliver in time is completed with
silence without waiting for the next packet (docs/architecture.md, "Where a 400 ms window goes").
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from lychee_rtc.aio import Signal
from lychee_rtc.session.clock import Window, WindowClock


class WindowInput:
    def __init__(self, clock: WindowClock, forward: Callable[[Window], None], now: Callable[[], float]) -> None:
        self.clock = clock
        self.last_audio_at: float | None = None
        self._forward = forward
        self._now = now
        self._resync = False
        self._wake = Signal()
        # The deadline ``run`` sleeps until: audio that leaves it where it is needs no wake-up (with
        # 400 ms windows, 19 of every 20 packets).
        self._sleeping_until: float | None = None

    def audio(self, samples: np.ndarray, now: float | None = None) -> None:
        now = self._arrived(now)
        self._hand_on(self.clock.write(samples, now))

    def revise(self, samples: np.ndarray) -> None:
        """Replace the end of what was written, where the engine has not had it yet (``WindowClock.revise``)."""
        self.clock.revise(samples)

    def gap(self, n: int, now: float | None = None, fill: np.ndarray | None = None) -> None:
        now = self._arrived(now)
        self._hand_on(self.clock.gap(n, now, fill))

    def resync(self) -> None:
        """A new transport feeds the uplink from now on: re-anchor the clock at its first audio."""
        self._resync = True

    def hold(self) -> None:
        """The call is on hold: what arrives is dropped and no window falls due."""
        self.clock.hold(self._now())

    def release(self) -> None:
        now = self._now()
        self.clock.release(now)
        # A held phone may have sent nothing: the media timeout runs from the end of the hold, or
        # the watchdog would take the silence on hold for a dead path before the audio resumes.
        self.last_audio_at = now
        self._wake.set()

    def poll(self, now: float | None = None) -> None:
        """Complete the windows whose deadline has passed."""
        self._hand_on(self.clock.poll(self._now() if now is None else now))

    async def run(self) -> None:
        """Sleep until the next window's deadline (or until audio moves it), then poll."""
        while True:
            deadline = self._sleeping_until = self.clock.deadline()
            if deadline is None:
                await self._wake.wait()
                self._wake.clear()
                continue
            delay = deadline - self._now()
            if delay > 0:
                self._wake.clear()
                if await self._wake.wait(delay):
                    continue  # windows moved on; recompute the deadline
            self.poll()

    def _arrived(self, now: float | None) -> float:
        now = self._now() if now is None else now
        if self._resync:
            self._resync = False
            self._hand_on(self.clock.resync(now))
        self.last_audio_at = now
        return now

    def _hand_on(self, windows: Iterable[Window]) -> None:
        for window in windows:
            self._forward(window)
        if self.clock.deadline() != self._sleeping_until:
            self._wake.set()
