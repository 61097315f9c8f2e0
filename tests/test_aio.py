"""wait_event: a timed wait on an event that never loses a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from lychee_rtc.aio import wait_event


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
