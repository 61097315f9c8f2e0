"""asyncio helpers shared by the media, session and telephony layers."""

from __future__ import annotations

import asyncio
import logging
from typing import Iterable

log = logging.getLogger(__name__)


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set, at most ``timeout`` seconds; True if it was set.

    Not ``asyncio.wait_for(event.wait(), timeout)``: before Python 3.12, ``wait_for`` returns
    normally when its task is cancelled in the same loop iteration as the event fires, so the
    cancellation is lost. A loop that waits on an event forever then never ends, and keeps
    everything it references alive (a whole call, in the session's window clock).
    """
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
