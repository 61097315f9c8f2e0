"""Frames waiting for one WebSocket, written in order by a single task.

The session and the pacer are synchronous and must not wait on the network, so they queue here.
The queue is bounded (a peer that stops reading is a dead call, not a reason to grow memory), and
audio frames carry their epoch so a cut can take back whatever of the old epoch has not been
written yet.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import Callable, Protocol

log = logging.getLogger(__name__)


class Socket(Protocol):
    """What the writer needs of a WebSocket (aiohttp's ``WebSocketResponse`` is one)."""

    async def send_str(self, data: str) -> None: ...

    async def send_bytes(self, data: bytes) -> None: ...

    async def close(self, *, code: int, message: bytes) -> bool: ...


class Outbox:
    def __init__(self, limit: int, max_bytes: int | None = None) -> None:
        self.limit = limit
        self.max_bytes = max_bytes  # None: bounded by the count alone
        self.bytes = 0  # queued, not yet written
        self.overflowed = 0  # frames refused because the peer was not reading
        self.purged = 0  # frames of a cut epoch taken back before they were written
        self.written = 0
        self._items: deque[tuple[int | None, str | bytes, int | None]] = deque()
        self._ready = asyncio.Event()
        self.space = asyncio.Event()  # set after every write: a producer waiting for the queue to drain
        self._close: tuple[int, str] | None = None
        self.done = asyncio.Event()

    @property
    def closing(self) -> bool:
        return self._close is not None

    def put(self, message: str | bytes, epoch: int | None = None, tag: int | None = None) -> bool:
        """Queue ``message``; ``epoch`` lets a cut take it back (``purge``), which reports its ``tag``."""
        if self._close is not None:
            return False
        if len(self._items) >= self.limit or (self.max_bytes is not None and self.bytes + len(message) > self.max_bytes):
            self.overflowed += 1
            return False
        self._items.append((epoch, message, tag))
        self.bytes += len(message)
        self._ready.set()
        return True

    def purge(self, stale: Callable[[int], bool]) -> list[int | None]:
        """Drop queued frames whose epoch is ``stale`` (frames without an epoch stay); their tags."""
        keep = deque(item for item in self._items if item[0] is None or not stale(item[0]))
        dropped = [tag for epoch, _, tag in self._items if epoch is not None and stale(epoch)]
        self._items = keep
        self.bytes = sum(len(m) for _, m, _ in keep)
        self.purged += len(dropped)
        return dropped

    def close(self, code: int, reason: str) -> None:
        """Write what is queued, then close the socket with ``code``."""
        if self._close is None:
            self._close = (code, reason)
            self._ready.set()

    async def run(self, socket: Socket) -> None:
        """The writer task: until closed; the socket is closed when it ends."""
        try:
            while True:
                while not self._items:
                    if self._close is not None:
                        return
                    self._ready.clear()
                    await self._ready.wait()
                _, message, _ = self._items.popleft()
                self.bytes -= len(message)
                if isinstance(message, bytes):
                    await socket.send_bytes(message)
                else:
                    await socket.send_str(message)
                self.written += 1
                self.space.set()
        except (ConnectionError, RuntimeError) as exc:  # the peer went away mid-write
            log.debug("websocket write failed: %s", exc)
        finally:
            code, reason = self._close or (1011, "writer stopped")
            self._close = self._close or (code, reason)
            self._items.clear()
            self.bytes = 0
            self.space.set()
            try:
                await socket.close(code=code, message=reason.encode()[:120])
            except Exception:  # already closed by the peer
                pass
            self.done.set()
