"""One realtime WebSocket call: a duplex session fed and heard through JSON events on a socket.

The call owns the session's uplink (``SocketUplink``) and its sink (``SocketSender``); the socket
itself is attached as a ``SocketLink`` (a bounded queue written in order by one task) and may be
replaced: a dialect that can resume (vLLM-Omni's) re-attaches a new socket to the same session, and
while none is attached the session goes on (the model keeps listening, its answer keeps coming) for
``session.resume_window_s``. Without resume, losing the socket ends the call at once.

What a client may make the server hold is bounded: the socket's queue (``queue_events`` events,
``queue_bytes`` bytes; a client that stops reading until it fills is closed with 1008), the audio
moved into it ahead of the client (``audio_ahead_bytes``), and the input waiting for the engine
(``SocketUplink``). The socket's own timers (a first message, idleness) are the reader's, in the
server; the registry's watchdog keeps the call's maximum duration and the resume window.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from lychee_rtc.media.playout import PlayoutCounters
from lychee_rtc.session.event_stream import EventChannel
from lychee_rtc.session.session import DuplexSession
from lychee_rtc.telephony.outbox import Outbox, Socket
from lychee_rtc.ws.sender import SocketSender
from lychee_rtc.ws.uplink import SocketUplink

log = logging.getLogger(__name__)

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_TRY_AGAIN_LATER = 1013
# Why a call ended -> the close code its socket gets.
CLOSE_CODES = {"server_shutdown": CLOSE_GOING_AWAY, "client_not_reading": CLOSE_POLICY, "idle_timeout": CLOSE_POLICY,
               "max_duration": CLOSE_POLICY}
WRITER_CLOSE_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class SocketLimits:
    queue_events: int = 4096
    queue_bytes: int = 8 << 20
    audio_ahead_bytes: int = 512 << 10
    max_pending_input_s: float = 256.0


@dataclass
class SocketCallCounters:
    sockets: int = 0
    not_reading: int = 0  # sockets closed because their client stopped reading
    events_dropped: int = 0  # written while no socket was attached, or refused by a closing one


class SocketLink:
    """One attached socket: its queue, and the task that writes it in order."""

    def __init__(self, ws: Socket, limits: SocketLimits, name: str, transport: asyncio.BaseTransport | None = None) -> None:
        self.ws = ws
        self.transport = transport
        self.ended_by: str | None = None  # why the server ended it, when it did (the call's close reason)
        self.outbox = Outbox(limits.queue_events, limits.queue_bytes)
        self.writer = asyncio.create_task(self.outbox.run(ws), name=name)

    def close(self, code: int, reason: str) -> None:
        """Write what is queued, then close the socket."""
        self.outbox.close(code, reason)

    def abort(self, code: int, reason: str) -> None:
        """Close now, whatever is queued: the peer is not reading, so nothing more can be written
        (not even the close frame, which is tried once); the connection is dropped."""
        self.ended_by = self.ended_by or reason.replace(" ", "_")
        self.outbox.close(code, reason)
        self.writer.cancel()
        if self.transport is not None:
            self.transport.abort()

    async def closed(self, timeout: float = WRITER_CLOSE_TIMEOUT_S) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self.outbox.done.wait()), timeout)
        except asyncio.TimeoutError:
            self.writer.cancel()


class SocketChannel(EventChannel):
    """The dialect's way out: into the attached socket's queue, tagged so a cut can take audio back."""

    def __init__(self, call: "SocketCall") -> None:
        super().__init__(self._send_untagged, lambda: call.link.outbox.bytes if call.link else 0)
        self.call = call

    @property
    def attached(self) -> bool:
        return self.call.link is not None

    def _send_untagged(self, text: str) -> None:
        if not self.send_tagged(text):
            raise ConnectionError("the socket did not take the event")

    def send_tagged(self, text: str, epoch: int | None = None, tag: int | None = None) -> bool:
        link = self.call.link
        if link is None:
            self.call.counters.events_dropped += 1
            return False
        if link.outbox.put(text, epoch, tag):
            return True
        if not link.outbox.closing:  # full: the client has stopped reading
            self.call.not_reading(link)
        self.call.counters.events_dropped += 1
        return False

    def purge(self, new_epoch: int) -> list[int | None]:
        """Take back queued audio of epochs before ``new_epoch``; the tags of what was taken."""
        link = self.call.link
        return link.outbox.purge(lambda epoch: epoch < new_epoch) if link is not None else []


class SocketCall:
    """A ``calls.Call`` whose transport is a WebSocket carrying audio in events."""

    def __init__(self, session: DuplexSession, sender: SocketSender, limits: SocketLimits, dialect: str) -> None:
        self.session = session
        self.sender = sender
        self.uplink = SocketUplink(session, limits.max_pending_input_s)
        self.limits = limits
        self.dialect = dialect  # "openai" or "duplex": shown in the call's snapshot
        self.tasks: list[asyncio.Task] = []
        self.watchdog: asyncio.Task | None = None
        self.token: str | None = None  # no session token: the server key opens its resources
        self.folded: dict[str, int] = {}
        self.on_closed: list[Callable[[str], Awaitable[None] | None]] = []
        self.suspended_at: float | None = None
        self.suspend_reason: str | None = None
        self.resuming = False
        self.resumable = False  # set by a dialect that can re-attach a socket
        self.opened_at = time.monotonic()
        self.link: SocketLink | None = None
        self.counters = SocketCallCounters()
        self.channel = SocketChannel(self)
        self.on_cut: Callable[[list[int | None]], None] | None = None  # the dialect forgets what a cut took back
        self._own_tasks: list[asyncio.Task] = []
        sender.has_room = self._audio_room
        sender.on_cut = self._cut

    @classmethod
    def create(cls, session_factory: Callable[[SocketSender], DuplexSession], rate: int, max_buffer_s: float,
               limits: SocketLimits, dialect: str) -> "SocketCall":
        """``session_factory(sink)`` makes the session that will play into the call's sender."""
        sender = SocketSender(rate, max_buffer_s)
        session = session_factory(sender)
        sender.listener = session
        return cls(session, sender, limits, dialect)

    def start(self) -> None:
        """Start feeding the uplink and sending the answer (after the registry registered the call)."""
        self._own_tasks = [
            asyncio.create_task(self.uplink.run(), name=f"socket-uplink-{self.session.id}"),
            asyncio.create_task(self.sender.run(), name=f"socket-sender-{self.session.id}"),
        ]

    # --- the socket ------------------------------------------------------------------------------------

    def attach(self, ws: Socket, transport: asyncio.BaseTransport | None = None) -> SocketLink:
        """Write to ``ws`` from now on (a resume replaces the socket that was attached); ``transport``:
        its connection, dropped if the client stops reading."""
        link = SocketLink(ws, self.limits, f"socket-writer-{self.session.id}", transport)
        link.outbox.space.clear()
        self._watch_space(link)
        self.link = link
        self.suspended_at = self.suspend_reason = None
        self.counters.sockets += 1
        self.sender.room.set()  # audio held while no socket was attached may go now
        return link

    def detach(self, link: SocketLink, reason: str) -> bool:
        """``link``'s socket is gone; True if the session now waits for a resume (else it should end)."""
        if self.link is not link:
            return False  # already replaced
        self.link = None
        if not self.resumable or self.session.closed:
            return False
        self.suspended_at, self.suspend_reason = time.monotonic(), reason
        log.info("session %s: socket lost (%s); it may resume", self.session.id, reason)
        return True

    def not_reading(self, link: SocketLink) -> None:
        """The client stopped reading until its queue filled: its socket is closed (1008)."""
        self.counters.not_reading += 1
        log.warning("session %s: the client is not reading its socket (%d events, %d bytes queued); dropping it",
                    self.session.id, len(link.outbox._items), link.outbox.bytes)
        link.abort(CLOSE_POLICY, "client not reading")

    def _audio_room(self) -> bool:
        link = self.link
        if link is None:  # detached: audio waits in the playout buffer (bounded) for a resume
            return False
        return link.outbox.bytes < self.limits.audio_ahead_bytes

    def _watch_space(self, link: SocketLink) -> None:
        """Wake the sender when ``link``'s queue drains (the writer sets ``space`` after each write)."""
        async def relay() -> None:
            while not link.outbox.done.is_set():
                await link.outbox.space.wait()
                link.outbox.space.clear()
                self.sender.room.set()
        task = asyncio.create_task(relay(), name=f"socket-space-{self.session.id}")
        link.writer.add_done_callback(lambda _: task.cancel())

    def _cut(self, new_epoch: int) -> None:
        taken = self.channel.purge(new_epoch)
        if taken and self.on_cut is not None:
            self.on_cut(taken)

    # --- the registry's Call protocol ----------------------------------------------------------------

    @property
    def connected_at(self) -> float:
        # A socket watches its own liveness (its reader's timers, WebSocket pings), so the
        # watchdog's media timeout never applies: the call counts as connected until it ends.
        return time.monotonic()

    def connect_started_at(self) -> float:
        return self.opened_at

    async def drop_path(self) -> None:
        pass  # a socket is let go by its reader (detach), not by the watchdog

    def playout_counters(self) -> PlayoutCounters:
        return self.sender.playout_counters()

    async def close_transport(self) -> None:
        reason = self.session.close_reason or "closed"
        self.uplink.close()
        self.sender.stop()
        for task in self._own_tasks:
            task.cancel()
        link, self.link = self.link, None
        if link is not None:
            link.close(CLOSE_CODES.get(reason, CLOSE_NORMAL), reason)
            await link.closed()
        if self._own_tasks:
            await asyncio.gather(*self._own_tasks, return_exceptions=True)

    def snapshot(self) -> dict[str, Any]:
        snap = self.session.snapshot()
        snap["transport"] = "websocket"
        snap["connection_state"] = "suspended" if self.suspended_at is not None else (
            "open" if self.link is not None else "closed")
        snap["codec"] = "events"
        snap["websocket"] = {"dialect": self.dialect, "queued_input_s": round(self.uplink.queued_s, 3),
                             "queued_events": len(self.link.outbox._items) if self.link else 0}
        u, c = self.uplink.counters, self.sender.counters
        snap["counters"].update({
            "socket_appends": u.appends,
            "socket_appended_ms": round(1000.0 * u.appended_samples / self.uplink.rate, 1),
            "socket_cleared_ms": round(1000.0 * u.cleared_samples / self.uplink.rate, 1),
            "socket_waits_for_engine": u.waits_for_engine,
            "socket_audio_chunks": c.chunks,
            "socket_sent_ms": round(1000.0 * c.sent_samples / self.sender.rate, 1),
            "socket_stale_chunks": c.stale_chunks,
            "socket_events_dropped": self.counters.events_dropped,
            "socket_not_reading": self.counters.not_reading,
            "sockets": self.counters.sockets,
            "playout_overflow_samples": self.sender.playout_counters().overflow_samples,
        })
        return snap
