"""The entry's WebSocket routes: relayed to a worker, frames both ways (``proxy.relay_websocket``).

* A carrier's media stream and a realtime socket (``GET /v1/realtime`` without ``call_id``,
  ``/v1/duplex``) start a call: to the least-loaded worker with room. Their audio is in the socket
  itself, so it passes through the entry. A realtime socket's worker admits it at the handshake and
  refuses it with 503 when full, so the next worker is tried; a carrier's worker admits the call at
  its start frame, after the handshake.
* vLLM-Omni's duplex client opens with ``autostart=0`` and lets its first message decide: the entry
  reads it, and sends a ``session.resume`` to the worker its session lives on (the session id names
  it), anything else to the least-loaded worker, with that first message.
* A sideband (``?call_id=``) and a phone call's event stream go to the worker named in the id.

The bearer is checked here as a worker checks it (the server key, or an ``ek_`` key, which every
process with the server key verifies) before any worker is asked.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import WSMsgType, web

from lychee_rtc.cluster.fleet import NoPlacement
from lychee_rtc.cluster.ids import worker_of
from lychee_rtc.cluster.proxy import WorkerFailed, WorkerUnreachable, open_websocket, relay_websocket
from lychee_rtc.cluster.registry import WorkerView
from lychee_rtc.cluster.routing import (FLEET_KEY, holder, no_placement, not_found, server_key_refusal, target_of,
                                        unavailable)
from lychee_rtc.jsonio import JsonError, strict_json_dumps, strict_json_loads
from lychee_rtc.server import auth, http
from lychee_rtc.server.app import SETTINGS_KEY
from lychee_rtc.server.openai import routes as realtime
from lychee_rtc.server.openai.client_secrets import ClientSecrets, InvalidClientSecret, is_client_secret
from lychee_rtc.server.realtime_socket import read_query

CLOSE_POLICY = 1008


async def _place(request: web.Request, full_at_handshake: bool, max_msg_size: int | None = None,
                 first: str | None = None, downstream: web.WebSocketResponse | None = None) -> web.StreamResponse:
    """A new call's socket: to the least-loaded worker with room, then relayed; ``first``: a message
    already read from the client, sent to the worker before the relay starts."""
    fleet = request.app[FLEET_KEY]
    size = max_msg_size or fleet.settings.websocket.max_frame_bytes

    async def connect(view: WorkerView) -> aiohttp.ClientWebSocketResponse | web.Response:
        return await open_websocket(fleet.http, view.url, request, fleet.settings.cluster.forward_timeout_s, size)

    def full(answer: Any) -> bool:  # a worker refuses a realtime socket's handshake when it has no slot
        return full_at_handshake and isinstance(answer, web.Response) and answer.status == 503

    placed = await fleet.on_a_worker(connect, full, lambda upstream: not isinstance(upstream, web.Response),
                                     settle_later=True)
    if isinstance(placed, NoPlacement) or isinstance(placed.answer, web.Response):
        refusal = no_placement(fleet, placed) if isinstance(placed, NoPlacement) else placed.answer
        return await _refuse_open(downstream, refusal) if downstream is not None else refusal
    if full_at_handshake:  # admitted with the handshake: the worker holds it now
        placed.placement.taken()
    try:
        if first is not None:
            await placed.answer.send_str(first)
        return await relay_websocket(request, placed.answer, on_first_reply=placed.placement.taken,
                                     downstream=downstream, max_msg_size=size)
    finally:
        placed.placement.released()  # never answered: not admitted, or gone already (no-op once taken)


async def _refuse_open(ws: web.WebSocketResponse, refusal: web.Response) -> web.WebSocketResponse:
    """A refusal for a client whose socket is open already: as an error event, then a close."""
    try:
        body = strict_json_loads(refusal.body) if isinstance(refusal.body, bytes) else {}
        error = body.get("error", {})
        await ws.send_str(strict_json_dumps({"type": "error", "event_id": "event_entry", "error": {
            "type": error.get("type", "server_error"), "code": error.get("code", "unavailable"),
            "message": error.get("message", "no worker can take the session"), "param": None, "event_id": None}}))
        await ws.close(code=1013 if refusal.status == 503 else CLOSE_POLICY)
    except (ConnectionError, RuntimeError, JsonError):
        pass
    return ws


async def place_websocket(request: web.Request) -> web.StreamResponse:
    """A carrier's media stream starts a call: to the least-loaded worker, relayed both ways.

    The worker admits the call only when the carrier's start frame arrives, after the handshake, and
    sends nothing before: the call counts as in flight until the worker's first frame (then, as any
    placement, until a fresh report) or until the relay ends. A refusal of the handshake is passed
    on rather than read as "full" (the body does not survive the client library: it is restated).
    """
    from lychee_rtc.cluster.proxy import MAX_WS_MESSAGE_BYTES

    return await _place(request, full_at_handshake=False, max_msg_size=MAX_WS_MESSAGE_BYTES)


def _socket_refusal(request: web.Request) -> web.Response | None:
    """A realtime socket's bearer, checked as a worker checks it."""
    key = request.app[SETTINGS_KEY].server.auth_token
    token = auth.bearer(request)
    if key is None:
        return None  # nothing to check here (a key minted without a server key opens only its own process)
    if token is not None and is_client_secret(token):
        try:
            ClientSecrets(key).verify(token)
        except InvalidClientSecret as exc:
            return realtime.error(401, "invalid_client_secret", str(exc), headers={"WWW-Authenticate": "Bearer"})
        return None
    if not auth.has_server_key(request, key):
        return realtime.error(401, "unauthorized", "missing or wrong bearer token: the server key or an ek_ "
                              "client secret is required", headers={"WWW-Authenticate": "Bearer"})
    return None


@auth.policy(auth.Policy.CLIENT_SECRET)
async def realtime_socket(request: web.Request) -> web.StreamResponse:
    """``GET /v1/realtime`` and ``/v1/duplex``: a sideband (``call_id``), or a session on the socket."""
    if "call_id" in request.query and request.path == "/v1/realtime":
        return await sideband(request)
    if (denied := _socket_refusal(request)) is not None:
        return denied
    try:
        query = read_query(request)
    except http.BodyError as exc:
        return exc.response(param=None)
    if not query.duplex or query.autostart:
        return await _place(request, full_at_handshake=True)
    return await _first_message_decides(request)


async def _first_message_decides(request: web.Request) -> web.StreamResponse:
    settings = request.app[SETTINGS_KEY]
    ws = web.WebSocketResponse(max_msg_size=settings.websocket.max_frame_bytes, autoping=True)
    await ws.prepare(request)
    try:
        msg = await ws.receive(timeout=settings.websocket.first_message_timeout_s)
    except asyncio.TimeoutError:
        await ws.close(code=CLOSE_POLICY, message=b"config_timeout")
        return ws
    if msg.type not in (WSMsgType.TEXT, WSMsgType.BINARY):
        return ws
    text = msg.data if isinstance(msg.data, str) else msg.data.decode("utf-8", "replace")
    try:
        first = strict_json_loads(text)
    except JsonError:
        first = None
    if isinstance(first, dict) and first.get("type") == "session.resume":
        return await _resume_where_it_lives(request, ws, text, first.get("session_id"))
    return await _place(request, full_at_handshake=False, first=text, downstream=ws)


async def _resume_where_it_lives(request: web.Request, ws: web.WebSocketResponse, first: str,
                                 session_id: Any) -> web.StreamResponse:
    fleet = request.app[FLEET_KEY]
    view = fleet.registry.workers.get(worker_of(session_id) or "") if isinstance(session_id, str) else None
    if view is None or view.url is None or view.state in ("dead", "stopped"):
        return await _refuse_open(ws, http.error_response(404, "unknown_session", f"no session {session_id!r} "
                                                          "to resume"))
    try:
        upstream = await open_websocket(fleet.http, view.url, request, fleet.settings.cluster.forward_timeout_s,
                                        fleet.settings.websocket.max_frame_bytes)
    except (WorkerUnreachable, WorkerFailed) as exc:
        return await _refuse_open(ws, unavailable(fleet, "worker_unavailable", f"worker {view.worker_id}: {exc}"))
    if isinstance(upstream, web.Response):
        return await _refuse_open(ws, upstream)
    await upstream.send_str(first)
    return await relay_websocket(request, upstream, downstream=ws,
                                 max_msg_size=fleet.settings.websocket.max_frame_bytes)


async def sideband(request: web.Request) -> web.StreamResponse:
    """The sideband WebSocket of a realtime call: relayed to the worker named in ``call_id``."""
    if (denied := server_key_refusal(request)) is not None:
        return denied
    if not request.query.get("call_id"):
        return realtime.error(400, "missing_call_id", "the query parameter call_id is required", param="call_id")
    return await routed_websocket(request)


async def routed_websocket(request: web.Request) -> web.StreamResponse:
    """A WebSocket about one session (a phone call's event stream, a realtime call's sideband): to
    the worker in the session id."""
    fleet = request.app[FLEET_KEY]
    view = holder(request)
    if isinstance(view, web.Response):
        return view
    try:
        upstream = await open_websocket(fleet.http, view.url, request, fleet.settings.cluster.forward_timeout_s)
    except WorkerUnreachable as exc:
        fleet.registry.mark_down(view, str(exc))
        return unavailable(fleet, "worker_unavailable", f"worker {view.worker_id} cannot be reached; retry later")
    except WorkerFailed as exc:
        return http.error_response(502, "worker_failed", f"worker {view.worker_id}: {exc}")
    if isinstance(upstream, web.Response):
        if upstream.status == 404:  # the session ended: say so as a single server does
            return not_found(*target_of(request))
        return upstream
    return await relay_websocket(request, upstream)
