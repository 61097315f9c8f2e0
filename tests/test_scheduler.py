"""The scheduler: bounded per-slot queues, batching, capacity, and clean slot reuse."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from conftest import synthesize, wait_until
from lychee_rtc.config import EchoSettings
from lychee_rtc.engine.base import CapacityError, SessionOptions
from lychee_rtc.engine.echo import EchoBackend
from lychee_rtc.engine.scheduler import Engine


class SlowEcho(EchoBackend):
    """The real echo backend with a step that takes longer than real time allows."""

    step_s = 0.2

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.batches: list[int] = []

    def step(self, windows):
        time.sleep(self.step_s)
        self.batches.append(len(windows))
        return super().step(windows)


def windows_of(audio: np.ndarray, n: int = 6400) -> list[np.ndarray]:
    return [audio[i:i + n] for i in range(0, len(audio) - n + 1, n)]


async def drain(slot, timeout=5.0, timings=None):
    """Events until the end sentinel, ``timings`` window timings, or ``timeout`` of quiet."""
    events = []
    try:
        while timings is None or sum(e.kind == "window_timing" for e in events) < timings:
            event = await asyncio.wait_for(slot.events.get(), timeout)
            if event is None:
                break
            events.append(event)
    except asyncio.TimeoutError:
        pass
    return events


async def test_overload_drops_oldest_windows_and_batches_slots():
    backend = SlowEcho(EchoSettings(), max_sessions=2)
    engine = Engine(backend, max_pending_windows=2)
    await engine.start()
    try:
        a = await engine.open(SessionOptions())
        b = await engine.open(SessionOptions())
        with pytest.raises(CapacityError):
            await engine.open(SessionOptions())
        silence = np.zeros(6400, np.float32)
        for seq in range(10):
            a.push(silence, seq, 0)
            b.push(silence, seq, 0)
        await wait_until(lambda: backend.batches, what="a step")
        for slot in (a, b):
            assert slot.counters.windows_in == 10
            assert slot.counters.windows_dropped >= 6
            assert slot.counters.windows_stepped + slot.counters.windows_dropped <= 10
        assert max(backend.batches) == 2  # both slots in one step
    finally:
        await engine.stop()


async def test_closed_slot_is_reset_before_reuse():
    speech = synthesize("Hello, this sentence is never finished", rate=16000)
    engine = Engine(EchoBackend(EchoSettings(min_silence_ms=300), max_sessions=1), max_pending_windows=50)
    await engine.start()
    try:
        first = await engine.open(SessionOptions())
        chunks = windows_of(speech)
        for seq, w in enumerate(chunks):
            first.push(w, seq, 0)
        events = await drain(first, timeout=60.0, timings=len(chunks))
        assert any(e.kind == "speech_started" for e in events)
        await first.close()
        assert await drain(first, timeout=1.0) == []  # the closed owner gets the end sentinel only
        second = await engine.open(SessionOptions())
        assert second.index == first.index
        silence = np.zeros(6400, np.float32)
        for seq in range(4):
            second.push(silence, seq, 0)
        events = await drain(second, timeout=60.0, timings=4)
        # The previous owner's half-utterance must not be answered to the new owner.
        assert not any(e.kind in ("response_started", "audio_chunk", "speech_stopped") for e in events)
        assert [e.kind for e in events] == ["window_timing"] * 4, events
    finally:
        await engine.stop()
