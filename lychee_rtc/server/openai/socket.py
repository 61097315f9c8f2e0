"""The OpenAI Realtime WebSocket (``GET /v1/realtime`` without ``call_id``): the GA dialect on a socket.

What the ``openai`` SDK, the Agents SDK, Pipecat and LiveKit need is the GA translator's
(``dialect.py``) with audio in events: ``session.created`` first, then every client event in order
(they may come before it), audio as ``input_audio_buffer.append`` in and
``response.output_audio.delta`` out, in ``audio/pcm`` (24 kHz), ``audio/pcmu`` or ``audio/pcma``.
An ``ek_`` key's session configuration is the session's first one, as for a call.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from lychee_rtc.calls.call import ServerFull
from lychee_rtc.config import Settings
from lychee_rtc.server.openai.client_secrets import ClientSecret
from lychee_rtc.server.openai.dialect import RealtimeTranslator, SocketSide
from lychee_rtc.server.openai.session_config import (RealtimeProfile, read_session_config, requested_formats,
                                                     requested_processing, session_options)
from lychee_rtc.server.realtime_socket import (SocketCalls, SocketQuery, connection_of, credentials_session,
                                               new_socket, read_socket, refusal, server_full)
from lychee_rtc.session.processing import ProcessingUnavailable
from lychee_rtc.session.protocol import ProtocolError
from lychee_rtc.ws.call import SocketCall, SocketLink
from lychee_rtc.ws.formats import PCM16_24K


async def serve_openai_socket(request: web.Request, settings: Settings, profile: RealtimeProfile,
                              sockets: SocketCalls, query: SocketQuery,
                              secret: ClientSecret | None) -> web.StreamResponse:
    config = credentials_session(secret)
    try:
        request_cfg = read_session_config(config, profile, formats_apply=True)
        in_format, out_format = requested_formats(config)
    except ProtocolError as exc:
        return refusal(exc)
    record = bool(request_cfg.changes.get("recording", False))
    if record and not settings.recording.client_control:
        return refusal(ProtocolError("recording_not_allowed", "this server decides what is recorded: "
                                     "recording.client_control is off"))
    ws = new_socket(settings)
    wired: dict[str, RealtimeTranslator | SocketLink] = {}

    async def prepare(call: SocketCall) -> None:
        await ws.prepare(request)
        side = SocketSide(call.uplink, in_format or PCM16_24K, out_format or PCM16_24K)
        translator = RealtimeTranslator(call.session, call.channel, profile, socket=side)
        translator.max_message_bytes = settings.websocket.max_frame_bytes
        call.sender.deliver = translator.audio_delta
        wired["translator"], wired["link"] = translator, call.attach(ws, connection_of(request, settings))

    try:
        call = await sockets.open(session_options(request_cfg), "openai", prepare,
                                          processing=requested_processing(request_cfg), record=record)
    except ServerFull as exc:
        return server_full(exc)
    except ProcessingUnavailable as exc:
        return refusal(ProtocolError("audio_processing_unavailable", str(exc)))
    translator, link = wired["translator"], wired["link"]
    assert isinstance(translator, RealtimeTranslator) and isinstance(link, SocketLink)
    translator.attach()  # session.created: the first event on the socket
    reason = "server_shutdown"
    try:
        reason = await read_socket(ws, link, call, translator.handle_message, settings)
    finally:
        translator.detach()
        await asyncio.shield(sockets.end(call, link, reason))
    return ws
