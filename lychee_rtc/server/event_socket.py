"""An event WebSocket: one call's events in one dialect, and its client's messages back.

Both WebSocket event endpoints use this: the OpenAI sideband (``GET /v1/realtime?call_id=…``, GA
dialect) and a phone call's event stream (``GET /v1/telephony/calls/{call}/events``, the native
``events`` dialect). The session writes synchronously and must never wait on the network, so the
dialect's ``EventChannel`` puts each event on a bounded ``Outbox`` written in order by one task; an
event that finds the queue full is dropped and counted (by the outbox, and by the dialect as a
refused send). ``close`` writes what is queued, then closes the socket; the reader then ends, the
dialect is detached and the writer awaited.
"""

from __future__ import annotations

import asyncio

from aiohttp import WSMsgType, web

from lychee_rtc.session.dialect import EventDialect
from lychee_rtc.session.event_stream import EventChannel
from lychee_rtc.telephony.outbox import Outbox

EVENT_QUEUE = 1024  # events waiting for a slow reader; beyond it they are dropped
CLOSE_NORMAL = 1000


class QueueFull(Exception):
    """The reader is this far behind: the event is dropped."""


class EventSocket:
    def __init__(self, ws: web.WebSocketResponse, name: str, limit: int = EVENT_QUEUE) -> None:
        self.ws = ws
        self.name = name
        self.outbox = Outbox(limit)
        self.channel = EventChannel(self._put, lambda: self.outbox.bytes)

    def _put(self, text: str) -> None:
        if not self.outbox.put(text):
            raise QueueFull(self.name)

    def close(self, reason: str, code: int = CLOSE_NORMAL) -> None:
        """Write what is queued, then close the socket (the call ended)."""
        self.outbox.close(code, reason)

    async def serve(self, dialect: EventDialect) -> None:
        """Attach ``dialect`` and hand it the client's messages until the socket closes."""
        writer = asyncio.create_task(self.outbox.run(self.ws), name=self.name)
        dialect.attach()
        try:
            async for msg in self.ws:
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):  # binary: UTF-8 JSON, or an error
                    dialect.handle_message(msg.data)
                elif msg.type == WSMsgType.ERROR:
                    break
        finally:
            dialect.detach()
            self.outbox.close(CLOSE_NORMAL, "event stream closed")  # no-op if the call closed it first
            await writer
