"""The duplex dialect's sockets: opening a session, or resuming one on a new socket.

With ``autostart`` (the default) a session starts with the socket, admitted before the upgrade like
the GA dialect's. With ``autostart=0`` or ``resume=1`` (what vLLM-Omni's ``DuplexClient`` always sends)
the first message decides: ``session.update`` opens a session with that configuration (a full
server answers ``resource_exhausted`` and closes 1013), ``session.resume`` re-attaches an existing one.

A resume names the session and its current resume token (constant-time compare; rotated on every
resume) and the last event the client has. If the session's old socket is still attached it gets
``session.replaced`` and is closed; the new one gets ``session.resumed`` and then every journaled
event after the client's last, in order. A journal that cannot give them (overflowed, or the
client's cursor behind what it acknowledged) ends the session with ``session.resync_required``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from dataclasses import replace
from typing import Any

from aiohttp import WSMsgType, web

from lychee_rtc.calls.call import ServerFull
from lychee_rtc.calls.registry import CallRegistry
from lychee_rtc.config import Settings
from lychee_rtc.engine.base import SessionOptions
from lychee_rtc.jsonio import JsonError, strict_json_dumps, strict_json_loads
from lychee_rtc.server.duplex.dialect import DuplexTranslator
from lychee_rtc.server.duplex.session_config import read_duplex_config
from lychee_rtc.server.openai.client_secrets import ClientSecret
from lychee_rtc.server.openai.dialect import SocketSide
from lychee_rtc.server.openai.session_config import RealtimeProfile, read_session_config, session_options
from lychee_rtc.server.realtime_socket import (SocketCalls, SocketQuery, connection_of, credentials_session,
                                               new_socket, read_socket, refusal, server_full)
from lychee_rtc.session.journal import JournalGap, JournalOverflow
from lychee_rtc.session.protocol import ProtocolError
from lychee_rtc.ws.call import CLOSE_NORMAL, CLOSE_POLICY, CLOSE_TRY_AGAIN_LATER, SocketCall, SocketLink
from lychee_rtc.ws.formats import SocketAudioFormat

log = logging.getLogger(__name__)

ENDED_REMEMBERED = 256  # ids of ended sessions, so a late resume hears "expired", not "unknown"


class DuplexSockets:
    def __init__(self, settings: Settings, registry: CallRegistry, profile: RealtimeProfile,
                 sockets: SocketCalls) -> None:
        self.settings = settings
        self.registry = registry
        self.profile = profile
        self.sockets = sockets
        self.translators: dict[str, DuplexTranslator] = {}  # session id -> the dialect of a duplex call
        self._ended: deque[str] = deque(maxlen=ENDED_REMEMBERED)
        registry.on_removed.append(self._forget)

    def _forget(self, call: Any) -> None:
        if self.translators.pop(call.session.id, None) is not None:
            self._ended.append(call.session.id)

    async def handle(self, request: web.Request, query: SocketQuery, secret: ClientSecret | None) -> web.StreamResponse:
        try:
            base = read_session_config(credentials_session(secret), self.profile)
        except ProtocolError as exc:
            return refusal(exc)
        ws = new_socket(self.settings)
        if query.autostart:
            return await self._open(request, ws, session_options(base), None, None, prepared=False)
        await ws.prepare(request)
        first = await self._first_message(ws)
        if first is None:
            return ws
        if first.get("type") == "session.resume":
            return await self._resume(request, ws, first)
        if first.get("type") != "session.update":
            await self._refuse(ws, "bad_event", "the first message must be session.update or session.resume",
                               first.get("event_id"))
            return ws
        caps = self.registry.engine.capabilities
        try:
            config = read_duplex_config(first.get("session"), self.profile, 16000, caps.output_rate,
                                        first.get("event_id"))
        except ProtocolError as exc:
            await self._refuse(ws, exc.code, exc.message, exc.event_id)
            return ws
        options = replace(session_options(base), **config.changes)
        return await self._open(request, ws, options, config.input_format, config.output_format, prepared=True)

    async def _first_message(self, ws: web.WebSocketResponse) -> dict[str, Any] | None:
        timeout = self.settings.websocket.first_message_timeout_s
        try:
            msg = await ws.receive(timeout=timeout)
        except asyncio.TimeoutError:
            await self._refuse(ws, "config_timeout", f"no session.update or session.resume within {timeout:g} s", None)
            return None
        if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
            return None  # gone (or a frame over the limit: closed 1009)
        try:
            data = strict_json_loads(msg.data)
        except (JsonError, UnicodeDecodeError):
            data = None
        if not isinstance(data, dict):
            await self._refuse(ws, "invalid_json", "the first message is not a JSON object", None)
            return None
        return data

    async def _refuse(self, ws: web.WebSocketResponse, code: str, message: str, event_id: Any,
                      close: int = CLOSE_POLICY) -> None:
        """A handshake-stage error (no session yet, so no sequence number), then the socket closes."""
        error = {"type": "rate_limit_error" if code == "resource_exhausted" else "invalid_request_error",
                 "code": code, "message": message, "param": None,
                 "event_id": event_id if isinstance(event_id, str) else None}
        try:
            await ws.send_str(strict_json_dumps({"type": "error", "event_id": "event_handshake", "error": error}))
            await ws.close(code=close, message=code.encode()[:120])
        except (ConnectionError, RuntimeError):
            pass

    # --- a new session -----------------------------------------------------------------------------------

    async def _open(self, request: web.Request, ws: web.WebSocketResponse, options: SessionOptions,
                    in_format: SocketAudioFormat | None, out_format: SocketAudioFormat | None,
                    prepared: bool) -> web.StreamResponse:
        caps = self.registry.engine.capabilities
        wired: dict[str, Any] = {}

        async def prepare(call: SocketCall) -> None:
            if not prepared:
                await ws.prepare(request)
            side = SocketSide(call.uplink, in_format or SocketAudioFormat("pcm16", 16000),
                              out_format or SocketAudioFormat("pcm16", caps.output_rate))
            translator = DuplexTranslator(call.session, call.channel, self.profile, side,
                                          self.settings.websocket.journal_bytes, self.registry.capacity)
            translator.max_message_bytes = self.settings.websocket.max_frame_bytes
            call.sender.deliver = translator.audio_delta
            call.on_cut = translator.forget_taken_back
            call.resumable = self.settings.session.resume_window_s > 0
            wired["translator"], wired["link"] = translator, call.attach(ws, connection_of(request, self.settings))

        try:
            call = await self.sockets.open(options, "duplex", prepare)
        except ServerFull as exc:
            if not prepared:
                return server_full(exc)
            await self._refuse(ws, "resource_exhausted", f"duplex_session_capacity_exhausted: limit="
                               f"{self.registry.capacity}", None, CLOSE_TRY_AGAIN_LATER)
            return ws
        translator, link = wired["translator"], wired["link"]
        self.translators[call.session.id] = translator
        translator.attach()  # session.created (with the resume token), then session.updated
        await self._serve(ws, link, call, translator, seen=prepared)
        return ws

    async def _serve(self, ws: web.WebSocketResponse, link: SocketLink, call: SocketCall,
                     translator: DuplexTranslator, seen: bool) -> None:
        reason = "server_shutdown"
        try:
            reason = await read_socket(ws, link, call, translator.handle_message, self.settings, seen=seen)
        finally:
            await asyncio.shield(self.sockets.end(call, link, reason))

    # --- resuming -----------------------------------------------------------------------------------------

    async def _resume(self, request: web.Request, ws: web.WebSocketResponse, msg: dict[str, Any]) -> web.StreamResponse:
        event_id = msg.get("event_id")
        sid, token, last = msg.get("session_id"), msg.get("resume_token"), msg.get("last_received_server_event_seq", 0)
        if not isinstance(sid, str) or isinstance(last, bool) or not isinstance(last, int) or last < 0:
            await self._refuse(ws, "invalid_session_resume", "session.resume needs session_id (string) and "
                               "last_received_server_event_seq (integer >= 0)", event_id)
            return ws
        translator = self.translators.get(sid)
        call = self.registry.calls.get(sid)
        if translator is None or not isinstance(call, SocketCall) or call.session.closed:
            code = "session_resume_expired" if sid in self._ended else "unknown_session"
            await self._refuse(ws, code, f"no session {sid!r} to resume", event_id)
            return ws
        if not translator.token_matches(token):
            await self._refuse(ws, "invalid_resume_token", "wrong resume_token for this session", event_id)
            return ws
        try:
            replay = translator.journal.since(last, translator.next_seq + 1)
        except (JournalGap, JournalOverflow) as exc:
            reason = "journal_overflow" if isinstance(exc, JournalOverflow) else "journal_gap"
            await self._send(ws, {"type": "session.resync_required", "event_id": "event_resync", "reason": reason,
                                  "session_id": sid})
            await ws.close(code=CLOSE_NORMAL, message=reason.encode())
            await self.registry.close(sid, "resync_required")
            return ws
        old = call.link
        if old is not None:  # the old socket still stands: it is told, and closed
            translator.send_unnumbered("session.replaced", session_id=sid)
            old.close(CLOSE_NORMAL, "replaced by a resumed socket")
        link = call.attach(ws, connection_of(request, self.settings))
        token = translator.new_resume_token()
        translator.send_unnumbered("session.resumed", session=translator.session_object(), resume_token=token,
                                   attachment_generation=translator.generation, replayed=len(replay),
                                   last_server_event_seq=translator.next_seq)
        for text in replay:
            call.channel.send_tagged(text)
        self.registry.metrics.sessions_resumed.inc()
        log.info("session %s resumed on a new socket (%d events replayed)", sid, len(replay))
        await self._serve(ws, link, call, translator, seen=True)
        return ws

    @staticmethod
    async def _send(ws: web.WebSocketResponse, event: dict[str, Any]) -> None:
        try:
            await ws.send_str(strict_json_dumps(event))
        except (ConnectionError, RuntimeError):
            pass
