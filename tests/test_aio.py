"""wait_event and Signal: timed waits on an event that never lose a cancellation."""

from __future__ import annotations

import asyncio
import gc

import pytest

from lychee_rtc.aio import Signal, spawn_kept, wait_event


async def test_wait_event_reports_set_or_timeout():
    event = asyncio.Event()
    assert await wait_event(event, 0.01) is False
    asyncio.get_running_loop().call_soon(event.set)
    assert await wait_event(event, 60) is True
    assert await wait_event(event, 0) is True  # already set


async def test_a_cancel_in_the_same_iteration_as_the_event_ends_the_waiting_loop():
    # The window clock's shape: wait for a wake-up or a deadline, forever. The wake-up and the
    # session's close land in the same loop iteration; asyncio.wait_for before Python 3.12 then
    # returns normally and the loop never ends.
    event = asyncio.Event()
    waiting = asyncio.Event()
    rounds = 0

    async def clock_loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            event.clear()
            waiting.set()
            await wait_event(event, 60)

    task = asyncio.create_task(clock_loop())
    await waiting.wait()
    event.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 60)
    assert rounds == 1


async def test_a_signal_wakes_its_waiter_or_times_out():
    signal = Signal()
    assert await signal.wait(0.01) is False
    asyncio.get_running_loop().call_soon(signal.set)
    assert await signal.wait(60) is True
    assert await signal.wait(0) is True  # already set
    signal.clear()
    assert await wait_event(signal, 0.01) is False  # wait_event takes a Signal too
    assert signal._waiters == []  # a timed-out wait leaves nothing behind


async def test_a_cancel_in_the_same_iteration_as_a_signal_is_not_lost():
    signal = Signal()
    waiting = asyncio.Event()
    rounds = 0

    async def clock_loop() -> None:
        nonlocal rounds
        while True:
            rounds += 1
            signal.clear()
            waiting.set()
            await signal.wait(60)

    task = asyncio.create_task(clock_loop())
    await waiting.wait()
    signal.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 60)
    assert rounds == 1
    assert signal._waiters == []


async def test_a_kept_task_is_held_until_it_ends_and_its_failure_is_reported_once_not_left_unretrieved():
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        keep: set[asyncio.Task] = set()
        release = asyncio.Event()

        async def fails(error: Exception) -> None:
            await release.wait()
            raise error

        async def ends_well() -> str:
            await release.wait()
            return "done"

        failing = spawn_kept(fails(ValueError("a bug")), keep, "closing the test socket")
        lost = spawn_kept(fails(ConnectionResetError("peer went away")), keep, "a reply", expected=(ConnectionError,))
        fine = spawn_kept(ends_well(), keep, "a task that ends well")
        cancelled = spawn_kept(asyncio.sleep(3600), keep, "a task that is cancelled")
        assert keep == {failing, lost, fine, cancelled}
        del failing, lost, fine  # only the set holds them now
        gc.collect()
        assert len(keep) == 4
        cancelled.cancel()
        release.set()
        await asyncio.wait(list(keep), timeout=5)
        assert keep == set()
        del cancelled
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
    # The unexpected failure is reported once, as it happened (not as "never retrieved" when collected);
    # the expected one, the cancellation and the task that ended well are not.
    assert [(c["message"], repr(c["exception"])) for c in reported] == [
        ("closing the test socket failed", "ValueError('a bug')")]
