"""What the HTTP edge waits on from clients, bounded in time and stopped at shutdown.

A handler may wait on its client in two ways: reading a request body, and serving a WebSocket.
Both go through here, so that neither can hold the server:

* a body is read within ``server.body_timeout_s`` (a client that sends half a body gets 408), and
  every read still waiting when shutdown begins ends at once (``reading``);
* a WebSocket is made here (``websocket``, or made by its handler and ``adopt``-ed), with a bounded
  close handshake and a heartbeat (``websocket.heartbeat_s``: a peer that answers no ping is
  dropped); at
  shutdown each gets until the deadline to close normally (its call's last events, a close frame),
  then its connection is aborted, so a peer that stopped reading (a half-open socket) cannot hold
  the process either.

A new route that reads a body or opens a WebSocket uses these and gets both bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

from aiohttp import WSCloseCode, web

from ..aio import spawn_kept

log = logging.getLogger(__name__)

# A close handshake (our close frame, the peer's answer) gets this long; a peer that never answers
# is not waited for longer.
WS_CLOSE_TIMEOUT_S = 2.0
DEFAULT_HEARTBEAT_S = 20.0  # websocket.heartbeat_s
CLOSE_GOING_AWAY = WSCloseCode.GOING_AWAY  # 1001: the server is shutting down
# After the app's own shutdown, aiohttp waits this long for handlers still running, then cancels
# them and waits as long again (web.run_app's shutdown_timeout); the grace keeps room for both.
HANDLER_DRAIN_S = 0.5


def shutdown_deadline(now: float, grace_s: float) -> float:
    """When the app's own shutdown must be over (loop time), for the process to exit within ``grace_s``."""
    return now + max(grace_s / 2, grace_s - 2 * HANDLER_DRAIN_S)


class ShuttingDown(Exception):
    """The server began to shut down while this request waited on its client."""


class Lifecycle:
    def __init__(self, body_timeout_s: float, heartbeat_s: float = DEFAULT_HEARTBEAT_S) -> None:
        self.body_timeout_s = body_timeout_s
        self.heartbeat_s = heartbeat_s
        self.stopping = False
        self._reads: set[asyncio.Timeout] = set()
        self._sockets: dict[web.WebSocketResponse, web.Request] = {}
        self._late_closes: set[asyncio.Task] = set()  # sockets adopted after shutdown began

    # --- request bodies ----------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def reading(self) -> AsyncIterator[None]:
        """Bound a body read: ``asyncio.TimeoutError`` after ``body_timeout_s``, ``ShuttingDown``
        as soon as shutdown begins."""
        if self.stopping:
            raise ShuttingDown()
        try:
            async with asyncio.timeout(self.body_timeout_s) as deadline:
                self._reads.add(deadline)
                try:
                    yield
                finally:
                    self._reads.discard(deadline)
        except TimeoutError:
            if self.stopping:
                raise ShuttingDown() from None
            raise

    # --- WebSockets --------------------------------------------------------------------------------

    async def websocket(self, request: web.Request, **options) -> web.WebSocketResponse:
        """A prepared WebSocket for ``request``, closed (or aborted) by ``stop``; refused with
        ``ShuttingDown`` once shutdown has begun."""
        if self.stopping:
            raise ShuttingDown()
        options.setdefault("timeout", WS_CLOSE_TIMEOUT_S)
        options.setdefault("heartbeat", self.heartbeat_s)
        options.setdefault("autoping", True)
        ws = web.WebSocketResponse(**options)
        await ws.prepare(request)
        return self.adopt(request, ws)

    def adopt(self, request: web.Request, ws: web.WebSocketResponse) -> web.WebSocketResponse:
        """Track a WebSocket a handler made (and prepared) itself, as ``websocket`` does its own."""
        if self.stopping and not ws.closed:  # made while shutdown began: closed with the rest
            spawn_kept(ws.close(code=CLOSE_GOING_AWAY, message=b"server shutdown"), self._late_closes,
                       "closing a WebSocket adopted during shutdown")
        self._sockets[ws] = request
        if request.task is not None:  # forgotten when its handler ends
            request.task.add_done_callback(lambda _task: self._sockets.pop(ws, None))
        return ws

    @property
    def open_sockets(self) -> int:
        return sum(1 for ws in self._sockets if not ws.closed)

    # --- shutdown ----------------------------------------------------------------------------------

    def begin_stop(self) -> None:
        """Shutdown begins: no new body read or socket, and every waiting read ends now."""
        self.stopping = True
        now = asyncio.get_running_loop().time()
        for deadline in list(self._reads):
            deadline.reschedule(now)

    async def stop(self, deadline: float) -> None:
        """Close every WebSocket still open (1001) and give each until ``deadline`` (loop time) to
        finish its close; a connection still open then (a peer that stopped reading or answering) is
        aborted. Call it once the calls are closed: a call's sockets close with its own last events
        and reason first."""
        self.begin_stop()
        loop = asyncio.get_running_loop()
        open_ = [(ws, request) for ws, request in self._sockets.items() if not _transport_closed(request)]
        closing = [asyncio.ensure_future(ws.close(code=CLOSE_GOING_AWAY, message=b"server shutdown"))
                   for ws, _ in open_ if not ws.closed]
        closing += self._late_closes
        while loop.time() < deadline and not all(_transport_closed(r) for _, r in open_):
            await asyncio.sleep(0.05)
        for ws, request in open_:
            if not _transport_closed(request):
                log.info("a WebSocket of %s did not close by the shutdown deadline: aborted", request.path)
                request.transport.abort()
        for future in closing:
            if not future.done():
                future.cancel()
        for result in await asyncio.gather(*closing, return_exceptions=True):
            if isinstance(result, Exception):
                log.debug("closing a WebSocket at shutdown: %r", result)


def _transport_closed(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


LIFECYCLE_KEY = web.AppKey("lifecycle", Lifecycle)
DEFAULT_BODY_TIMEOUT_S = 10.0


def lifecycle_of(request: web.Request) -> Lifecycle:
    """The app's lifecycle (``install``); an app without one (a bare app in a test) gets the default."""
    found = request.app.get(LIFECYCLE_KEY)
    return found if found is not None else _UNMANAGED


_UNMANAGED = Lifecycle(DEFAULT_BODY_TIMEOUT_S)  # bounds reads of apps that never shut down through one
