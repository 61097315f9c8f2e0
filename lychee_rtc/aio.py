"""asyncio helpers shared by the media, session and telephony layers."""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Coroutine, Iterable

log = logging.getLogger(__name__)


class Signal:
    """A flag that wakes its waiters when set, like ``asyncio.Event``, with a cheap timed wait.

    The per-packet loops of a call (the window clock, the outbound pacer) wait for "audio arrived, or
    this deadline" some fifty times a second. ``wait_event`` on an ``asyncio.Event`` needs a task per
    wait to stay cancellation-safe; a ``Signal`` needs one future and one timer.
    """

    def __init__(self) -> None:
        self._flag = False
        self._waiters: list[asyncio.Future] = []

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        self._flag = True
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(True)

    def clear(self) -> None:
        self._flag = False

    async def wait(self, timeout: float | None = None) -> bool:
        """Until set (True) or ``timeout`` seconds have passed (False).

        A cancellation is never lost: the waiter is a plain future, so a cancel that lands in the same
        loop iteration as ``set`` still raises ``CancelledError`` here."""
        if self._flag:
            return True
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(timeout, _expire, waiter) if timeout is not None else None
        try:
            return await waiter
        finally:
            if timer is not None:
                timer.cancel()
            try:
                self._waiters.remove(waiter)  # still there unless set() woke it
            except ValueError:
                pass


def _expire(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(False)


async def wait_event(event: asyncio.Event | Signal, timeout: float | None) -> bool:
    """Wait until ``event`` is set, at most ``timeout`` seconds; True if it was set.

    Not ``asyncio.wait_for(event.wait(), timeout)``: before Python 3.12, ``wait_for`` returns
    normally when its task is cancelled in the same loop iteration as the event fires, so the
    cancellation is lost. A loop that waits on an event forever then never ends, and keeps
    everything it references alive (a whole call, in the session's window clock).
    """
    if isinstance(event, Signal):
        return await event.wait(timeout)
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)
        return bool(done)
    finally:
        waiter.cancel()


async def cancel_and_wait(tasks: Iterable[asyncio.Task | None], timeout: float) -> bool:
    """Cancel ``tasks`` (None and the current task skipped) and wait up to ``timeout`` s for them to
    end; True when all did. What they raised while ending is retrieved here (logged at DEBUG), so
    no cancelled task is left pending or with an exception nobody read."""
    current = asyncio.current_task()
    pending = [t for t in dict.fromkeys(tasks) if t is not None and t is not current and not t.done()]
    for task in pending:
        task.cancel()
    if pending:
        await asyncio.wait(pending, timeout=timeout)
    for task in pending:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.debug("task %s ended with %r while being cancelled", task.get_name(), task.exception())
    return all(t.done() for t in pending)


def spawn_kept(coro: Coroutine[Any, Any, Any], keep: set[asyncio.Task], what: str,
               expected: tuple[type[BaseException], ...] = ()) -> asyncio.Task:
    """Run ``coro`` as a task held in ``keep`` until it ends, and retrieve its outcome: a failure in
    ``expected`` (a peer gone meanwhile) is dropped (DEBUG), any other is reported to the loop's
    exception handler as an unretrieved one would be, and a cancellation is ignored.

    For work started from a callback that nobody awaits (a close triggered by a protocol event, a
    reply sent from a timer): the loop holds tasks only weakly, so a bare ``ensure_future`` may be
    collected mid-flight, and one that fails is reported only when collected, if at all. The owner
    of ``keep`` may await what is still in it when it stops."""
    task = asyncio.ensure_future(coro)
    keep.add(task)
    task.add_done_callback(functools.partial(_forget, keep, what, expected))
    return task


def _forget(keep: set[asyncio.Task], what: str, expected: tuple[type[BaseException], ...], task: asyncio.Task) -> None:
    keep.discard(task)
    if task.cancelled() or (error := task.exception()) is None:
        return
    if isinstance(error, expected):
        log.debug("%s failed as it may: %r", what, error)
    else:
        task.get_loop().call_exception_handler({"message": f"{what} failed", "exception": error, "future": task})
