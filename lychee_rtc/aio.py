"""asyncio helpers shared by the media, session and telephony layers."""

from __future__ import annotations

import asyncio


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
