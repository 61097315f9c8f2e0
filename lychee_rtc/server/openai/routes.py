"""HTTP and WebSocket entry points of the OpenAI Realtime WebRTC surface.

* ``POST /v1/realtime/calls``: an offer as raw SDP or multipart (``sdp`` + ``session``); 201 with the
  answer SDP and ``Location: /v1/realtime/calls/{call_id}``. Authorised by the server key or an
  ephemeral ``ek_`` key, whose session configuration the call starts from.
* ``POST /v1/realtime/calls/{call_id}/hangup``: end the call (server key); a SIP call still ringing
  for a decision is declined.
* ``POST /v1/realtime/calls/{call_id}/accept`` / ``reject`` / ``refer``: OpenAI's SIP call control
  for calls the SIP gateway announced by its ``realtime.call.incoming`` webhook (server key).
* ``POST /v1/realtime/client_secrets``: mint an ``ek_`` key (server key only); keys are signed
  tokens, so any process with the same server key verifies them (see ``client_secrets``).
* ``GET /v1/realtime?call_id=…``: the sideband WebSocket, a server-side controller of a call
  speaking the GA dialect (server key only).
* ``GET /v1/realtime`` without ``call_id`` (and ``/v1/duplex``): a whole session on one WebSocket,
  audio in events (``socket.py``, ``server/realtime_socket.py``); the server key or an ``ek_`` key.

The call id is the session id, so the call is also visible under ``/v1/sessions``.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from lychee_rtc.calls.call import ServerFull
from lychee_rtc.calls.registry import CallRegistry
from lychee_rtc.config import Settings
from lychee_rtc.gateway.call_control import DEFAULT_REJECT, DecisionRefused
from lychee_rtc.gateway.dial_out import valid_target
from lychee_rtc.gateway.errors import CallActionRefused
from lychee_rtc.jsonio import JsonError, strict_json_loads
from lychee_rtc.rtc.negotiator import RtcNegotiator
from lychee_rtc.rtc.sdp import SdpError
from lychee_rtc.server import auth, http
from lychee_rtc.server.event_socket import EventSocket
from lychee_rtc.server.openai.client_secrets import (
    DEFAULT_TTL_S,
    ClientSecret,
    ClientSecrets,
    InvalidClientSecret,
    SessionTooLarge,
    is_client_secret,
)
from lychee_rtc.server.openai.dialect import RealtimeTranslator
from lychee_rtc.server.openai.session_config import (
    RealtimeProfile,
    merge_configs,
    noise_reduction_of,
    read_session_config,
    render_session,
    requested_processing,
    session_options,
)
from lychee_rtc.server.openai.socket import serve_openai_socket
from lychee_rtc.server.realtime_socket import DUPLEX_PATH, REALTIME_PATH, SocketCalls, read_query
from lychee_rtc.session.processing import ProcessingUnavailable
from lychee_rtc.session.protocol import MAX_MESSAGE_BYTES, ProtocolError

CALLS_PATH = "/v1/realtime/calls"
MAX_SESSION_PART_BYTES = 64 * 1024
MAX_PARTS = 4
MAX_SIDEBANDS_PER_CALL = 4


@dataclass
class RealtimeSurface:
    settings: Settings
    registry: CallRegistry
    rtc: RtcNegotiator
    profile: RealtimeProfile
    secrets: ClientSecrets
    sockets: SocketCalls
    sidebands: dict[str, int] = field(default_factory=dict)  # call id -> open sideband sockets
    gateway: Any = None  # the SIP gateway (JanusSipGateway), when one is configured: SIP call control
    duplex: Any = None  # vLLM-Omni's dialect of the socket (server.duplex.route.DuplexSockets)


REALTIME_KEY = web.AppKey("realtime", RealtimeSurface)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def error(status: int, code: str, message: str, error_type: str | None = None,
          param: str | None = None, headers: dict[str, str] | None = None) -> web.Response:
    """OpenAI's error body: the shared one with ``param`` always present."""
    return http.error_response(status, code, message, error_type, headers, param=param)


def keyless_is_local(settings: Settings) -> bool:
    """No server key, and nobody but this machine can connect: local development."""
    return settings.server.auth_token is None and is_loopback(settings.server.host)


def needs_server_key(settings: Settings) -> web.Response | None:
    """Keys and server-side control are refused on an open server that others can reach."""
    if settings.server.auth_token is None and not keyless_is_local(settings):
        return error(403, "server_key_required", "set server.auth_token to use this endpoint: without a server "
                     "key it is only available when the server listens on loopback", "invalid_request_error")
    return None


# --- calls -------------------------------------------------------------------------------------------


async def _read_offer(request: web.Request, max_sdp: int) -> tuple[str, dict[str, Any] | None]:
    """The offer SDP and the optional ``session`` part."""
    if request.content_length is not None and request.content_length > max_sdp + MAX_SESSION_PART_BYTES:
        raise http.BodyError(413, "invalid_body", f"body of {request.content_length} bytes is too large")
    if request.content_type == "application/sdp":
        return await http.read_text(request, max_sdp, "the SDP offer"), None
    if request.content_type != "multipart/form-data":
        raise http.BodyError(415, "unsupported_media_type",
                             "send the offer as application/sdp or multipart/form-data with parts 'sdp' and 'session'")
    reader = await request.multipart()
    sdp: str | None = None
    session: dict[str, Any] | None = None
    for _ in range(MAX_PARTS):
        part = await reader.next()
        if part is None:
            break
        if part.name == "sdp":
            sdp = http.as_text(await http.read_limited(part.read_chunk, max_sdp, "part 'sdp'"), "part 'sdp'")
        elif part.name == "session":
            raw = http.as_text(await http.read_limited(part.read_chunk, MAX_SESSION_PART_BYTES, "part 'session'"),
                               "part 'session'")
            try:
                session = strict_json_loads(raw)
            except JsonError as exc:
                raise http.BodyError(400, "invalid_session", f"part 'session' is not valid JSON: {exc}") from None
            if not isinstance(session, dict):
                raise http.BodyError(400, "invalid_session", "part 'session' must be a JSON object")
        else:
            raise http.BodyError(400, "invalid_body", f"unknown part {part.name!r}: expected 'sdp' and 'session'")
    else:
        raise http.BodyError(400, "invalid_body", f"more than {MAX_PARTS} parts")
    if sdp is None:
        raise http.BodyError(400, "invalid_body", "part 'sdp' is required")
    return sdp, session


def credentials(request: web.Request, surface: RealtimeSurface) -> ClientSecret | None | web.Response:
    """Who opens a session: the server key (None), an ``ek_`` key (its record), or a 401 answer.
    Without a server key configured any bearer, or none, is the server key's."""
    token = auth.bearer(request)
    if token is not None and is_client_secret(token):
        try:
            return surface.secrets.verify(token)
        except InvalidClientSecret as exc:
            return error(401, "invalid_client_secret", str(exc), headers={"WWW-Authenticate": "Bearer"})
    if not auth.has_server_key(request, surface.settings.server.auth_token):
        return error(401, "unauthorized", "missing or wrong bearer token: the server key or an ek_ client secret "
                     "is required", headers={"WWW-Authenticate": "Bearer"})
    return None


@auth.policy(auth.Policy.CLIENT_SECRET)
async def create_call(request: web.Request) -> web.Response:
    surface = request.app[REALTIME_KEY]
    secret = credentials(request, surface)
    if isinstance(secret, web.Response):
        return secret
    try:
        sdp, session_part = await _read_offer(request, surface.settings.server.max_sdp_bytes)
    except http.BodyError as exc:
        return exc.response(param=None)
    config = merge_configs(secret.session if secret else {}, session_part or {})
    try:
        request_cfg = read_session_config(config, surface.profile)
    except ProtocolError as exc:
        return error(400, exc.code, exc.message, param="session")
    record = bool(request_cfg.changes.get("recording", False))
    if record and not surface.settings.recording.client_control:
        return error(400, "recording_not_allowed", "this server decides what is recorded: recording.client_control "
                     "is off", param="session.lychee_rtc.recording")
    try:
        call = await surface.rtc.create(sdp, session_options(request_cfg), record=record,
                                        processing=requested_processing(request_cfg))
    except ServerFull as exc:
        return http.server_full(exc, param=None)
    except ProcessingUnavailable as exc:
        return error(400, "audio_processing_unavailable", str(exc), param="session.audio.input.noise_reduction")
    except SdpError as exc:
        return http.sdp_refused(exc, param="sdp")
    return web.Response(status=201, text=call.answer_sdp, content_type="application/sdp",
                        headers={"Location": f"{CALLS_PATH}/{call.session.id}"})


async def hangup(request: web.Request) -> web.Response:
    surface = request.app[REALTIME_KEY]
    call_id = request.match_info["call_id"]
    control = surface.gateway.control if surface.gateway is not None else None
    if control is not None and call_id in control.pending:  # still ringing: decline it
        try:
            await control.reject(call_id, DEFAULT_REJECT)
        except DecisionRefused as exc:
            return error(exc.status, exc.code, exc.message, param="call_id")
        return web.Response(status=200)
    if not await surface.registry.close(call_id, "hangup"):
        return error(404, "call_not_found", f"no call {call_id!r}", param="call_id")
    return web.Response(status=200)


# --- SIP call control (calls announced by the realtime.call.incoming webhook) -------------------------


async def _json_body(request: web.Request) -> dict[str, Any]:
    return await http.read_json_object(request, MAX_SESSION_PART_BYTES, "the request body", empty={})


def _call_control(surface: RealtimeSurface, call_id: str) -> Any:
    control = surface.gateway.control if surface.gateway is not None else None
    if control is None:
        raise DecisionRefused(404, "call_not_found", f"no incoming SIP call {call_id!r}: this server announces "
                              "none (gateway.janus.webhook_url is not set)")
    return control


async def accept(request: web.Request) -> web.Response:
    """Answer a ringing SIP call with a session configuration (the body: ``type: "realtime"``, ...)."""
    surface = request.app[REALTIME_KEY]
    call_id = request.match_info["call_id"]
    try:
        config = await _json_body(request)
        options = session_options(read_session_config(config, surface.profile))
        await _call_control(surface, call_id).accept(call_id, options)
    except http.BodyError as exc:
        return exc.response(param=None)
    except ProtocolError as exc:
        return error(400, exc.code, exc.message, param="session")
    except DecisionRefused as exc:
        return error(exc.status, exc.code, exc.message, param="call_id")
    return web.Response(status=200)


async def reject(request: web.Request) -> web.Response:
    """Decline a ringing SIP call with ``status_code`` (default 603)."""
    surface = request.app[REALTIME_KEY]
    call_id = request.match_info["call_id"]
    try:
        body = await _json_body(request)
        code = body.get("status_code", DEFAULT_REJECT)
        if isinstance(code, bool) or not isinstance(code, int) or not 400 <= code <= 699:
            raise http.BodyError(400, "invalid_value", "status_code must be a SIP final status from 400 to 699")
        await _call_control(surface, call_id).reject(call_id, code)
    except http.BodyError as exc:
        return exc.response(param="status_code" if exc.code == "invalid_value" else None)
    except DecisionRefused as exc:
        return error(exc.status, exc.code, exc.message, param="call_id")
    return web.Response(status=200)


async def refer(request: web.Request) -> web.Response:
    """Blind-transfer an answered SIP call to ``target_uri`` (a SIP REFER to the caller)."""
    surface = request.app[REALTIME_KEY]
    call_id = request.match_info["call_id"]
    try:
        body = await _json_body(request)
    except http.BodyError as exc:
        return exc.response(param=None)
    target = body.get("target_uri")
    if not valid_target(target):
        return error(400, "invalid_value", "target_uri must be a sip: URI with a user part or a tel: number",
                     param="target_uri")
    if surface.gateway is not None and surface.gateway.control is not None and call_id in surface.gateway.control.pending:
        return error(409, "call_not_answered", f"call {call_id!r} is ringing: accept it before referring it",
                     param="call_id")
    if call_id not in surface.registry.calls:
        return error(404, "call_not_found", f"no call {call_id!r}", param="call_id")
    if surface.gateway is None:
        return error(409, "not_a_sip_call", f"call {call_id!r} is not a SIP call", param="call_id")
    try:
        await surface.gateway.transfers.start(call_id, target)
    except CallActionRefused as exc:
        return error(exc.status, "not_a_sip_call" if exc.code == "not_a_phone_call" else exc.code, exc.message,
                     param="call_id")
    return web.Response(status=200)


# --- client secrets ---------------------------------------------------------------------------------


async def create_client_secret(request: web.Request) -> web.Response:
    surface = request.app[REALTIME_KEY]
    if (refused := needs_server_key(surface.settings)) is not None:
        return refused
    try:
        body = await _json_body(request)
    except http.BodyError as exc:
        return exc.response(param=None)
    unknown = set(body) - {"session", "expires_after"}
    if unknown:
        return error(400, "unknown_parameter", f"unknown parameter(s): {', '.join(sorted(unknown))}",
                     param=sorted(unknown)[0])
    ttl = DEFAULT_TTL_S
    expires = body.get("expires_after")
    if expires is not None:
        if not isinstance(expires, dict) or set(expires) - {"anchor", "seconds"} \
                or expires.get("anchor", "created_at") != "created_at":
            return error(400, "invalid_value", "expires_after must be {\"anchor\": \"created_at\", \"seconds\": N}",
                         param="expires_after")
        seconds = expires.get("seconds", DEFAULT_TTL_S)
        if not isinstance(seconds, int) or isinstance(seconds, bool):
            return error(400, "invalid_value", "expires_after.seconds must be an integer", param="expires_after.seconds")
        ttl = seconds
    session = body.get("session", {})
    try:
        request_cfg = read_session_config(session, surface.profile)
    except ProtocolError as exc:
        return error(400, exc.code, exc.message, param="session")
    try:
        secret = surface.secrets.mint(session, ttl)
    except SessionTooLarge as exc:
        return error(400, "session_too_large", str(exc), param="session")
    except ValueError as exc:
        return error(400, "invalid_value", str(exc), param="expires_after.seconds")
    options = session_options(request_cfg)
    effective = render_session(surface.profile, session_id=None, instructions=options.instructions,
                               voice=options.voice, expires_at=None,
                               noise_reduction=noise_reduction_of(requested_processing(request_cfg)))
    return http.json_response({"value": secret.value, "expires_at": int(secret.expires_at), "session": effective})


# --- sockets ----------------------------------------------------------------------------------------


@auth.policy(auth.Policy.CLIENT_SECRET)
async def realtime_socket(request: web.Request) -> web.StreamResponse:
    """``GET /v1/realtime``: the sideband of a call (``call_id``), or a session on this socket."""
    if "call_id" in request.query and request.path == REALTIME_PATH:
        if not auth.has_server_key(request, request.app[REALTIME_KEY].settings.server.auth_token):
            return http.unauthorized()  # a call's sideband is the server's, never a client key's
        return await sideband(request)
    surface = request.app[REALTIME_KEY]
    secret = credentials(request, surface)
    if isinstance(secret, web.Response):
        return secret
    try:
        query = read_query(request)
    except http.BodyError as exc:
        return exc.response(param=None)
    if query.duplex:
        if surface.duplex is None:
            return error(404, "not_found", "this server does not speak the duplex dialect")
        return await surface.duplex.handle(request, query, secret)
    return await serve_openai_socket(request, surface.settings, surface.profile, surface.sockets, query, secret)


async def sideband(request: web.Request) -> web.StreamResponse:
    surface = request.app[REALTIME_KEY]
    if (refused := needs_server_key(surface.settings)) is not None:
        return refused
    call_id = request.query.get("call_id")
    if not call_id:
        return error(400, "missing_call_id", "the query parameter call_id is required", param="call_id")
    call = surface.registry.calls.get(call_id)
    if call is None:
        return error(404, "call_not_found", f"no call {call_id!r}", param="call_id")
    if surface.sidebands.get(call_id, 0) >= MAX_SIDEBANDS_PER_CALL:
        return error(409, "too_many_sidebands", f"call {call_id!r} already has {MAX_SIDEBANDS_PER_CALL} sideband "
                     "connections")
    ws = web.WebSocketResponse(max_msg_size=MAX_MESSAGE_BYTES, heartbeat=20.0)
    await ws.prepare(request)
    surface.sidebands[call_id] = surface.sidebands.get(call_id, 0) + 1
    socket = EventSocket(ws, f"sideband-{call_id}")
    translator = RealtimeTranslator(call.session, socket.channel, surface.profile,
                                    on_closed=lambda: socket.close("call ended"))
    try:
        await socket.serve(translator)
    finally:
        left = surface.sidebands.get(call_id, 1) - 1
        if left > 0:
            surface.sidebands[call_id] = left
        else:
            surface.sidebands.pop(call_id, None)
    return ws


def install(app: web.Application, settings: Settings, registry: CallRegistry, rtc: RtcNegotiator,
            profile: RealtimeProfile) -> RealtimeSurface:
    surface = app[REALTIME_KEY] = RealtimeSurface(settings, registry, rtc, profile,
                                                  ClientSecrets(settings.server.auth_token),
                                                  SocketCalls(settings, registry))
    app.router.add_post(CALLS_PATH, create_call)
    app.router.add_post(CALLS_PATH + "/{call_id}/hangup", hangup)
    app.router.add_post(CALLS_PATH + "/{call_id}/accept", accept)
    app.router.add_post(CALLS_PATH + "/{call_id}/reject", reject)
    app.router.add_post(CALLS_PATH + "/{call_id}/refer", refer)
    app.router.add_post("/v1/realtime/client_secrets", create_client_secret)
    app.router.add_get(REALTIME_PATH, realtime_socket)
    app.router.add_get(DUPLEX_PATH, realtime_socket)
    return surface
