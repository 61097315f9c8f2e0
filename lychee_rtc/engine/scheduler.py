"""The scheduler: one loop per engine, one batched step per period over every slot with a due window.

The event loop only moves windows, controls and events around; ``StepBackend`` methods run on a
single worker thread, so they never block media and never run concurrently with each other.
Per-slot input queues are bounded: when the engine falls behind real time the oldest windows are
dropped and counted, so latency cannot grow without bound.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np

from lychee_rtc.engine.base import (
    CapacityError,
    Control,
    ControlKind,
    EngineCapabilities,
    EngineError,
    EngineEvent,
    SessionOptions,
    SlotWindow,
    StepBackend,
    WindowTiming,
)

log = logging.getLogger(__name__)

# Events queued for a session that is not reading them (it is closing, or stuck) are bounded too.
MAX_QUEUED_EVENTS = 4096
# Controls waiting for the next step, per slot; past this they are compacted (see compact_controls).
MAX_PENDING_CONTROLS = 32


def _control_group(control: Control) -> str:
    # Holding and releasing are one state: only the last word on it matters.
    if control.kind in (ControlKind.FORCE_LISTEN, ControlKind.RELEASE_LISTEN):
        return "listen"
    return control.kind.value


def compact_controls(controls: list[Control]) -> list[Control]:
    """The last control of each kind, in the order of those last ones.

    A later CANCEL carries the newer epoch, a later UPDATE the whole newer options, a later
    hold/release the current holding state, and a second COMMIT adds nothing: so the result
    leaves the backend where the full list would, with at most one control per kind.
    """
    last = {_control_group(c): i for i, c in enumerate(controls)}
    return [c for i, c in enumerate(controls) if last[_control_group(c)] == i]


@dataclass
class SlotCounters:
    windows_in: int = 0
    windows_stepped: int = 0
    windows_dropped: int = 0  # overload: the engine was behind and the oldest window was dropped
    events_dropped: int = 0


@dataclass
class _Pending:
    window: np.ndarray
    seq: int
    epoch: int
    pushed_at: float


class EngineSlot:
    """A session's handle on one engine slot."""

    def __init__(self, engine: "Engine", index: int, max_pending: int) -> None:
        self.index = index
        self.counters = SlotCounters()
        self.events: asyncio.Queue[EngineEvent | None] = asyncio.Queue()
        self._engine = engine
        self._windows: deque[_Pending] = deque()
        self._controls: list[Control] = []
        self._max_pending = max_pending
        # Set whenever the engine takes a window from this slot: a transport that feeds windows only
        # while the slot has room (a socket's audio sent faster than real time) waits on it.
        self._room = asyncio.Event()
        self.closed = False

    @property
    def capabilities(self) -> EngineCapabilities:
        return self._engine.capabilities

    @property
    def pending(self) -> int:
        """Windows pushed and not yet taken by a step."""
        return len(self._windows)

    @property
    def max_pending(self) -> int:
        return self._max_pending

    def has_room(self) -> bool:
        """Whether one more window can be pushed without the oldest being dropped."""
        return self.closed or len(self._windows) < self._max_pending

    async def wait_room(self) -> None:
        """Until ``has_room`` (or the slot closed)."""
        while not self.has_room():
            self._room.clear()
            await self._room.wait()

    def push(self, window: np.ndarray, seq: int, epoch: int) -> None:
        if self.closed:
            return
        expected = self.capabilities.window_samples
        if window.shape != (expected,):
            raise ValueError(f"window must have shape ({expected},), got {window.shape}")
        self.counters.windows_in += 1
        self._windows.append(_Pending(window.astype(np.float32, copy=False), seq, epoch, time.monotonic()))
        while len(self._windows) > self._max_pending:
            self._windows.popleft()
            self.counters.windows_dropped += 1
        self._engine.wake()

    def control(self, control: Control) -> None:
        if self.closed:
            return
        self._controls.append(control)
        if len(self._controls) > MAX_PENDING_CONTROLS:
            self._controls = compact_controls(self._controls)
        self._engine.wake()

    def _requeue(self, controls: tuple[Control, ...] | list[Control]) -> None:
        """Put controls of a failed step back in front of newer ones, compacted so a backend that keeps
        failing cannot make the list grow with the client's message rate."""
        self._controls = compact_controls([*controls, *self._controls])

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._windows.clear()
        self._controls.clear()
        self._room.set()
        await self._engine.release(self)

    # --- called by the engine loop ---------------------------------------------------------------

    def _deliver(self, events: list[EngineEvent]) -> None:
        if self.closed:
            return
        for event in events:
            if self.events.qsize() >= MAX_QUEUED_EVENTS:
                self.counters.events_dropped += 1
                continue
            self.events.put_nowait(event)


class Engine:
    def __init__(self, backend: StepBackend, max_pending_windows: int = 3,
                 on_timing: Callable[[WindowTiming], None] | None = None) -> None:
        self.backend = backend
        self.capabilities = backend.capabilities
        self.max_pending_windows = max_pending_windows
        self.on_timing = on_timing
        self._slots: list[EngineSlot | None] = [None] * self.capabilities.max_sessions
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = 0

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="engine-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for slot in list(self._slots):
            if slot is not None:
                await slot.close()
        self._executor.shutdown(wait=True, cancel_futures=True)

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    @property
    def free_slots(self) -> int:
        return sum(1 for s in self._slots if s is None)

    async def open(self, options: SessionOptions) -> EngineSlot:
        for index, owner in enumerate(self._slots):
            if owner is None:
                slot = EngineSlot(self, index, self.max_pending_windows)
                self._slots[index] = slot
                try:
                    await self._run(self.backend.open_slot, index, options)
                except BaseException:
                    self._slots[index] = None
                    raise
                return slot
        raise CapacityError(f"all {len(self._slots)} engine slots are in use")

    async def release(self, slot: EngineSlot) -> None:
        if self._slots[slot.index] is not slot:
            return
        # The slot is reset on the worker thread, after any step that is still using it, and only
        # then offered to a new owner.
        try:
            await self._run(self.backend.close_slot, slot.index)
        finally:
            self._slots[slot.index] = None
            slot.events.put_nowait(None)

    def wake(self) -> None:
        self._wake.set()

    # --- the loop --------------------------------------------------------------------------------

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _work(self, controls: list[tuple[int, list[Control]]], windows: list[SlotWindow]):
        """Runs on the worker thread: controls for idle slots, then one step for the due windows."""
        control_events = [self.backend.apply_controls(index, c) for index, c in controls]
        results = self.backend.step(windows) if windows else []
        return control_events, results

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._step_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a backend bug must not kill every session's scheduler
                log.exception("engine step failed")
                for slot in self._slots:
                    if slot is not None:
                        slot._deliver([EngineError(epoch=-1, code="engine_step_failed",
                                                   message="the engine failed on this step; see server log")])

    async def _step_once(self) -> None:
        batch: list[tuple[EngineSlot, SlotWindow, float]] = []
        controls_only: list[tuple[EngineSlot, list[Control]]] = []
        for slot in self._slots:
            if slot is None or slot.closed:
                continue
            controls, slot._controls = slot._controls, []
            if slot._windows:
                p = slot._windows.popleft()
                slot._room.set()
                batch.append((slot, SlotWindow(slot.index, p.window, p.seq, p.epoch, tuple(controls)), p.pushed_at))
            elif controls:
                controls_only.append((slot, controls))
        if not batch and not controls_only:
            return
        started = time.monotonic()
        try:
            # One worker job for the whole period, so no close_slot/open_slot can slip in between the
            # batch being chosen and being stepped (a closed slot's window would reach its next owner).
            control_events, results = await self._run(
                self._work, [(s.index, c) for s, c in controls_only], [w for _, w, _ in batch])
        except Exception:
            # The windows are lost, but controls (a CANCEL above all) must still reach the backend,
            # or its epoch would stay behind the session's for good.
            for slot, controls in controls_only:
                slot._requeue(controls)
            for slot, window, _ in batch:
                slot._requeue(window.controls)
            raise
        for (slot, _), events in zip(controls_only, control_events):
            slot._deliver(events)
        if not batch:
            return
        step_ms = (time.monotonic() - started) * 1000.0
        self.steps += 1
        for (slot, window, pushed_at), events in zip(batch, results):
            slot.counters.windows_stepped += 1
            # A backend may report its vocoder share with a WindowTiming of its own; fold it in.
            vocoder_ms = sum(e.vocoder_ms for e in events if isinstance(e, WindowTiming))
            events = [e for e in events if not isinstance(e, WindowTiming)]
            timing = WindowTiming(
                window_seq=window.window_seq,
                queue_wait_ms=(started - pushed_at) * 1000.0,
                step_ms=step_ms,
                vocoder_ms=vocoder_ms,
                batch_size=len(batch),
            )
            if self.on_timing is not None:
                self.on_timing(timing)
            slot._deliver([*events, timing])
        # Windows that arrived during the step are due now.
        if any(s is not None and (s._windows or s._controls) for s in self._slots):
            self._wake.set()

