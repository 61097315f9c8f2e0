"""Carrier media streams and their companion event streams, on aiohttp WebSockets.

``GET /v1/telephony/ws`` (or ``/v1/telephony/ws/{provider}``) is what a carrier dials. Its
credentials are checked on the upgrade request (a caller with none is refused with 401 before the
socket opens); Plivo, which can only send a token inside its start frame, is checked on that frame,
before any audio is taken. The provider is told from the first frames unless the path names it.
Then the call is admitted like any WebRTC offer (same capacity, engine, session and events).

``GET /v1/telephony/calls/{call}/events`` is the application's side of a phone call: the session's
``events`` vocabulary over a WebSocket, to watch the call and steer it (``response.cancel``,
``turn.listen``, ``session.close``, ...). A carrier's call holds no secret of a client's, so it
opens with the server key only, in every mode: a carrier's call id is a name, not a credential.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from aiohttp import WSMsgType, web

from lychee_rtc.calls.call import ServerFull
from lychee_rtc.calls.registry import CallRegistry
from lychee_rtc.config import Settings
from lychee_rtc.engine.base import SessionOptions
from lychee_rtc.server import http
from lychee_rtc.server.auth import Access
from lychee_rtc.server.event_socket import EventSocket
from lychee_rtc.server.lifecycle import lifecycle_of
from lychee_rtc.server.route_table import TARGET_KEY, Route, Target, table_of
from lychee_rtc.session.native import NativeDialect
from lychee_rtc.session.protocol import MAX_MESSAGE_BYTES
from lychee_rtc.telephony.auth import Admission, check_request, plivo_token_ok
from lychee_rtc.telephony.call import CarrierCall
from lychee_rtc.telephony.carriers import DIALECTS, HANDSHAKE_EVENTS, Dialect, detect
from lychee_rtc.telephony.carriers.base import MAX_FRAME_BYTES, json_object
from lychee_rtc.telephony.frames import (
    CLOSE_POLICY,
    CLOSE_PROTOCOL_ERROR,
    CLOSE_TRY_AGAIN_LATER,
    FrameError,
    StreamStarted,
    Unhandled,
)

log = logging.getLogger(__name__)

MEDIA_PATH = "/v1/telephony/ws"
EVENTS_PATH = "/v1/telephony/calls/{call}/events"
MAX_HANDSHAKE_FRAMES = 4  # frames a carrier may send before its start frame


def _request_urls(request: web.Request, settings: Settings) -> list[str]:
    """The URL the carrier was given, as it signs it."""
    public = settings.telephony.public_url
    if public:
        return [public + request.path_qs]
    forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    secure = request.secure or forwarded in ("https", "wss")
    host = request.headers.get("X-Forwarded-Host") or request.host
    return [f"{'wss' if secure else 'ws'}://{host}{request.path_qs}"]


@dataclass(frozen=True)
class _CarrierEvents:
    """What the event-stream route found: a carrier's call (else the SIP gateway's locator's value)."""

    call: CarrierCall


class TelephonyEndpoint:
    def __init__(self, settings: Settings, registry: CallRegistry, others: Any = None) -> None:
        self.settings = settings
        self.registry = registry
        self.others = others  # the SIP gateway's calls (server.sip_calls.SipCalls): their event streams too
        self._calls: dict[str, CarrierCall] = {}  # session id -> the phone calls among the registry's
        registry.on_removed.append(lambda call: self._calls.pop(call.session.id, None))

    # --- the carrier's socket --------------------------------------------------------------------

    async def media(self, request: web.Request) -> web.StreamResponse:
        telephony = self.settings.telephony
        provider = request.match_info.get("provider")
        if provider is not None and provider not in DIALECTS:
            return http.error_response(404, "unknown_provider", f"no carrier {provider!r}; one of {sorted(DIALECTS)}")
        admission = check_request(request.headers, _request_urls(request, self.settings), telephony, provider)
        if admission.refusal is not None:
            log.info("telephony connection refused: %s", admission.refusal)
            return http.error_response(401, "unauthorized", admission.refusal)
        # Carriers keep their stream alive their own way (media and marks): no pings of ours.
        ws = await lifecycle_of(request).websocket(request, max_msg_size=MAX_FRAME_BYTES, heartbeat=None)
        try:
            opened = await asyncio.wait_for(self._start(ws, provider, admission), telephony.start_timeout_s)
        except asyncio.TimeoutError:
            await ws.close(code=CLOSE_POLICY, message=b"no start frame in time")
            return ws
        except FrameError as exc:
            log.info("telephony connection closed before its start: %s", exc)
            await ws.close(code=exc.close_code, message=str(exc).encode()[:120])
            return ws
        if opened is None:  # the carrier went away before starting
            return ws
        dialect, started = opened
        try:
            call = await self._admit(dialect, started)
        except ServerFull:
            await ws.close(code=CLOSE_TRY_AGAIN_LATER, message=b"server at capacity")
            return ws
        call.start(ws)
        log.info("session %s: %s call %s started (%s)", call.session.id, dialect.name, started.call_id,
                 started.audio.label)
        ended: str | None = None
        try:
            async for msg in ws:
                if msg.type in (WSMsgType.TEXT, WSMsgType.BINARY):
                    ended = call.handle(msg.data)
                    if ended is not None:
                        break
                elif msg.type == WSMsgType.ERROR:
                    break
        finally:
            if not call.session.closed:
                await call.session.close(ended or "carrier_closed")
            await call.outbox.done.wait()
        return ws

    async def _start(self, ws: web.WebSocketResponse, provider: str | None,
                     admission: Admission) -> tuple[Dialect, StreamStarted] | None:
        """Read the handshake frames up to the start frame; nothing after it is read here."""
        dialect: Dialect | None = DIALECTS[provider]() if provider else None
        for _ in range(MAX_HANDSHAKE_FRAMES):
            msg = await ws.receive()
            if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
                return None
            if msg.type == WSMsgType.BINARY:
                raise FrameError("binary frame before the stream's start frame", CLOSE_PROTOCOL_ERROR)
            if msg.type != WSMsgType.TEXT:
                continue
            if dialect is None:
                first = json_object(msg.data)
                found = detect(first)
                if found is None:
                    if first.get("event") in HANDSHAKE_EVENTS:
                        continue
                    raise FrameError(f"cannot tell the carrier from frame with event {first.get('event')!r}; "
                                     f"expected a start frame of one of {sorted(DIALECTS)}", CLOSE_PROTOCOL_ERROR)
                dialect = found()
            event = dialect.parse(msg.data)
            if isinstance(event, Unhandled):
                continue
            if not isinstance(event, StreamStarted):
                raise FrameError(f"{dialect.name} sent {type(event).__name__} before its start frame",
                                 CLOSE_PROTOCOL_ERROR)
            if dialect.name not in admission.carriers and not (
                    dialect.name == "plivo" and admission.plivo_pending
                    and plivo_token_ok(event.parameters, self.settings.telephony)):
                raise FrameError(f"{dialect.name} stream not authenticated", CLOSE_POLICY)
            return dialect, event
        raise FrameError(f"no start frame within the first {MAX_HANDSHAKE_FRAMES} frames", CLOSE_PROTOCOL_ERROR)

    async def _admit(self, dialect: Dialect, started: StreamStarted) -> CarrierCall:
        caps = self.registry.engine.capabilities
        options = SessionOptions()
        async with self.registry.admission(options) as slot:
            call = CarrierCall.create(lambda sink: self.registry.new_session(slot, sink, options, ingress="carrier"), dialect, started,
                                      self.settings.telephony, caps.output_rate, self.settings.session.playout_max_s,
                                      live=caps.live_passthrough)
            self._calls[call.session.id] = call
            self.registry.register(call)
            return call

    # --- the application's event stream ----------------------------------------------------------

    async def locate_events(self, request: web.Request) -> Target | web.Response:
        """A carrier's call by its session id or the carrier's call or stream id (the server key opens
        it); else a SIP gateway call, when there is a gateway."""
        key = request.match_info["call"]
        call = next((c for c in self._calls.values() if c.matches(key)), None)
        if call is not None:
            return Target(call.opener(), _CarrierEvents(call))
        if self.others is not None:
            return await self.others.locate_events(request)
        return http.error_response(404, "call_not_found", f"no phone call {key!r}")

    async def events(self, request: web.Request) -> web.StreamResponse:
        target = request[TARGET_KEY]
        if not isinstance(target, _CarrierEvents):  # a SIP gateway call, as its own route serves it
            return await self.others.events(request)
        call = target.call
        if call.companion is not None:
            return http.error_response(409, "event_stream_taken", "this call already has an event stream attached")
        ws = await lifecycle_of(request).websocket(request, max_msg_size=MAX_MESSAGE_BYTES)
        socket = EventSocket(ws, f"events-writer-{call.session.id}")
        call.companion = socket.outbox  # closed by the call when it ends
        try:
            await socket.serve(NativeDialect(call.session, socket.channel))
        finally:
            if call.companion is socket.outbox:
                call.companion = None
        return ws


EVENTS_OPENED_BY = "a placed call's session token (a carrier's or an inbound SIP call: the server key only)"


def add_routes(app: web.Application, settings: Settings, registry: CallRegistry, others: Any = None) -> None:
    """``others``: the SIP gateway's calls (``SipCalls``), whose event streams this route serves too."""
    endpoint = TelephonyEndpoint(settings, registry, others)
    table = table_of(app)
    table.add(app, Route("GET", MEDIA_PATH, endpoint.media, Access.CARRIER, websocket=True))
    table.add(app, Route("GET", MEDIA_PATH + "/{provider}", endpoint.media, Access.CARRIER, websocket=True))
    table.add(app, Route("GET", EVENTS_PATH, endpoint.events, Access.SESSION, locate=endpoint.locate_events,
                         opened_by=EVENTS_OPENED_BY, websocket=True))
