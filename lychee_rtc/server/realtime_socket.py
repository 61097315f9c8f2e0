"""``GET /v1/realtime`` (upgrade) and ``/v1/duplex``: a speech-to-speech session on one WebSocket.

The OpenAI Realtime transport as the ``openai`` SDK, the OpenAI Agents SDK, Pipecat and LiveKit
Agents open it (``?model=`` optional and free: the engine this server runs is the model), and
vLLM-Omni's duplex dialect of it (``?duplex=1``, or the path ``/v1/duplex``). The sideband form
(``?call_id=``) is ``routes.sideband``. A socket is a call like any other: admitted by the call
registry (an engine slot), one duplex session, its recording, metrics and ``/v1/sessions`` entry; the
transport is ``lychee_rtc/ws``.

Order of work on an upgrade request: the bearer is checked (the server key, an ``ek_`` key, or
anything when no server key is configured) and the query read, before a slot is reserved or the
socket opened; a full server answers 503 with ``Retry-After`` before the upgrade. The reader then
hands each frame to the dialect, waiting while the call's input queue is full (the client's sends
wait: TCP flow control), and closes the socket (1008) when no message comes within
``websocket.first_message_timeout_s`` of the upgrade or ``idle_timeout_s`` of the last one; a frame
above ``websocket.max_frame_bytes`` closes it with 1009. A socket that goes away ends its call at
once, unless its dialect can resume (vLLM-Omni's), which holds it for ``session.resume_window_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import WSMsgType, web

from lychee_rtc.calls.call import ServerFull
from lychee_rtc.calls.registry import CallRegistry
from lychee_rtc.config import Settings
from lychee_rtc.engine.base import SessionOptions
from lychee_rtc.server import http
from lychee_rtc.server.openai.client_secrets import ClientSecret
from lychee_rtc.session.protocol import ProtocolError
from lychee_rtc.ws.call import CLOSE_POLICY, SocketCall, SocketLimits, SocketLink

log = logging.getLogger(__name__)

REALTIME_PATH = "/v1/realtime"
DUPLEX_PATH = "/v1/duplex"
TRUE, FALSE = ("1", "true", "on", "yes"), ("0", "false", "off", "no")
MAX_MODEL_CHARS = 256


@dataclass(frozen=True)
class SocketQuery:
    model: str | None
    duplex: bool
    autostart: bool  # vLLM-Omni: a session starts with the socket (else the first message opens it)


def _flag(request: web.Request, name: str, default: bool) -> bool:
    value = request.query.get(name)
    if value is None:
        return default
    if value.lower() in TRUE:
        return True
    if value.lower() in FALSE:
        return False
    raise http.BodyError(400, "invalid_value", f"query parameter {name} must be one of {', '.join(TRUE + FALSE)}")


def read_query(request: web.Request) -> SocketQuery:
    """The socket's query parameters (a 400 ``BodyError`` for a bad one); unknown ones are ignored,
    as clients add their own (``extra_query``)."""
    model = request.query.get("model")
    if model is not None and (not 0 < len(model) <= MAX_MODEL_CHARS or not model.isprintable()):
        raise http.BodyError(400, "invalid_value", f"query parameter model must be 1 to {MAX_MODEL_CHARS} printable "
                             "characters")
    duplex = request.path == DUPLEX_PATH or _flag(request, "duplex", False)
    autostart = _flag(request, "autostart", True) and not _flag(request, "resume", False)
    return SocketQuery(model, duplex, autostart)


def limits_of(settings: Settings) -> SocketLimits:
    ws = settings.websocket
    return SocketLimits(ws.queue_events, ws.queue_bytes, ws.audio_ahead_bytes, ws.max_pending_input_s)


def new_socket(settings: Settings) -> web.WebSocketResponse:
    """The server side of a realtime socket: bounded frames (larger ones close it with 1009), pings."""
    ws = settings.websocket
    return web.WebSocketResponse(max_msg_size=ws.max_frame_bytes, heartbeat=ws.heartbeat_s, autoping=True)


def connection_of(request: web.Request, settings: Settings) -> asyncio.BaseTransport | None:
    """The socket's connection, what it holds unsent bounded (``websocket.send_buffer_bytes``, in the
    kernel and in the event loop's transport alike): beyond it the writer waits, and the send queue,
    which is counted and bounded, holds the rest."""
    transport = request.transport
    limit = settings.websocket.send_buffer_bytes
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, limit)
    if isinstance(transport, asyncio.WriteTransport):
        transport.set_write_buffer_limits(high=limit)
    return transport


class SocketCalls:
    """Admitting a socket's call: a slot, a session clocked by its own samples, a ``SocketCall``."""

    def __init__(self, settings: Settings, registry: CallRegistry) -> None:
        self.settings = settings
        self.registry = registry

    def build(self, slot: Any, options: SessionOptions, dialect: str,
              processing: dict[str, bool] | None = None) -> SocketCall:
        caps = self.registry.engine.capabilities
        return SocketCall.create(
            lambda sink: self.registry.new_session(slot, sink, options, ingress="websocket", stream_input=True,
                                                   processing=processing),
            caps.output_rate, self.settings.session.playout_max_s, limits_of(self.settings), dialect)

    async def open(self, options: SessionOptions, dialect: str, prepare: Callable[[SocketCall], Awaitable[None]],
                   processing: dict[str, bool] | None = None, record: bool = False) -> SocketCall:
        """A registered, started call (``ServerFull`` when there is no slot). ``prepare(call)`` opens
        the socket and wires the dialect before the session's first event; if it fails (the client
        went away), the slot goes back."""
        async with self.registry.admission(options) as slot:
            call = self.build(slot, options, dialect, processing)
            await prepare(call)
            self.registry.register(call, record=record)
            call.start()
            return call

    async def end(self, call: SocketCall, link: SocketLink, reason: str) -> None:
        """The socket of ``link`` is gone: the call waits for a resume where its dialect can, else ends."""
        if not call.detach(link, reason) and not call.session.closed and call.link is None:
            await self.registry.close(call.session.id, reason)
        await link.closed()


async def read_socket(ws: web.WebSocketResponse, link: SocketLink, call: SocketCall,
                      handle: Callable[[str | bytes], None], settings: Settings, seen: bool = False) -> str:
    """Hand the client's frames to ``handle`` until the socket ends; why it ended.

    ``seen``: a message was already read (a first one read before the call existed)."""
    reason = await _read(ws, link, call, handle, settings, seen)
    return link.ended_by or reason


async def _read(ws: web.WebSocketResponse, link: SocketLink, call: SocketCall,
                handle: Callable[[str | bytes], None], settings: Settings, seen: bool) -> str:
    timers = settings.websocket
    while True:
        await call.uplink.wait_room()  # the client's appends wait for the engine: stop reading
        timeout = timers.idle_timeout_s if seen else timers.first_message_timeout_s
        try:
            msg = await ws.receive(timeout=timeout)
        except asyncio.TimeoutError:
            reason = "idle_timeout" if seen else "no_client_message"
            link.close(CLOSE_POLICY, f"no message for {timeout:g} s")
            return reason
        if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
            seen = True
            handle(msg.data)
            await asyncio.sleep(0)  # a client's burst of frames must not hold the event loop
        elif msg.type == WSMsgType.ERROR:
            code = ws.close_code or 1006
            log.info("session %s: socket error (%s), closed %d", call.session.id, msg.data, code)
            return "frame_too_large" if code == 1009 else "socket_error"
        elif msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED):
            return "client_closed"
        if link is not call.link:  # replaced by a resumed socket: this one is done
            return "replaced"


def refusal(exc: ProtocolError | http.BodyError, status: int = 400) -> web.Response:
    """A handshake refused with an OpenAI-style error body."""
    if isinstance(exc, http.BodyError):
        return exc.response(param=None)
    return http.error_response(status, exc.code, exc.message, param=None)


def server_full(exc: ServerFull) -> web.Response:
    return http.server_full(exc, param=None)


def credentials_session(secret: ClientSecret | None) -> dict[str, Any]:
    return dict(secret.session) if secret is not None else {}
