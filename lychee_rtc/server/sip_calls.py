"""Phone calls through the SIP gateway, driven over HTTP: placing calls, their resource and event stream.

``POST /v1/telephony/calls`` places a call (``to``: a ``sip:``/``tel:`` URI; ``from``: the caller id
a trunk should show; ``session``: what an offer takes; ``ring_timeout_s``). Capacity is taken
before dialling: a full server answers 503 and nothing is dialled. The 201 carries the call's
``session_token``, which opens it from then on (so does the server key): ``GET`` shows the
attempt's progress, ``DELETE`` cancels it while it rings or hangs up the answered call. Its event
stream (``GET .../events``) carries ``call.status`` progress and then, answered, the session's
events. A SIP call nobody placed over HTTP (an inbound call) opens with the server key only.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from lychee_rtc.calls.call import ServerFull
from lychee_rtc.calls.registry import CallRegistry
from lychee_rtc.calls.tokens import Opener
from lychee_rtc.config import Settings
from lychee_rtc.gateway.dial_out import sip_uri
from lychee_rtc.gateway.dialer import GatewayUnavailable
from lychee_rtc.gateway.hold import set_hold
from lychee_rtc.gateway.janus_sip import JanusSipGateway
from lychee_rtc.gateway.errors import CallActionRefused
from lychee_rtc.rtc.sdp import SdpError
from lychee_rtc.server import http
from lychee_rtc.server.auth import Access
from lychee_rtc.server.event_socket import EventSocket
from lychee_rtc.server.lifecycle import lifecycle_of
from lychee_rtc.server.route_table import TARGET_KEY, Body, Route, Target, table_of
from lychee_rtc.server.session_body import session_options
from lychee_rtc.session.native import NativeDialect
from lychee_rtc.session.protocol import MAX_MESSAGE_BYTES
from lychee_rtc.strict_text import UnsafeText

log = logging.getLogger(__name__)

CALLS_PATH = "/v1/telephony/calls"
MAX_BODY_BYTES = 64 * 1024
MAX_RING_TIMEOUT_S = 300.0


async def read_object(request: web.Request, allowed: set[str]) -> dict[str, Any]:
    """The body as a JSON object with no fields but ``allowed`` (an empty body is ``{}``)."""
    body = await http.read_json_object(request, MAX_BODY_BYTES, empty={})
    unknown = set(body) - allowed
    if unknown:
        raise http.BodyError(400, "invalid_request", f"unknown field(s): {', '.join(sorted(unknown))}")
    return body


def target_uri(body: dict[str, Any], field: str, code: str = "invalid_target", required: bool = True) -> str | None:
    """A URI of the body that goes into a SIP message: whole, printable, bounded (``sip_uri``)."""
    if field not in body and not required:
        return None
    try:
        return sip_uri(body.get(field), f"field {field!r}")
    except UnsafeText as exc:
        raise http.BodyError(400, code, f"{exc}: a sip: URI with a user part or a tel: number") from None


def ring_timeout(body: dict[str, Any], default: float) -> float:
    timeout = body.get("ring_timeout_s", default)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 1 <= timeout <= MAX_RING_TIMEOUT_S:
        raise http.BodyError(400, "invalid_request", f"ring_timeout_s must be 1 to {MAX_RING_TIMEOUT_S:.0f}")
    return float(timeout)


class SipCalls:
    def __init__(self, settings: Settings, registry: CallRegistry, gateway: JanusSipGateway) -> None:
        self.settings = settings
        self.registry = registry
        self.gateway = gateway
        self._streams: set[str] = set()  # sessions with an event stream attached

    # --- placing calls ---------------------------------------------------------------------------------

    async def create(self, request: web.Request) -> web.Response:
        try:
            body = await read_object(request, {"to", "from", "session", "ring_timeout_s"})
            to = target_uri(body, "to")
            caller = target_uri(body, "from", "invalid_caller_id", required=False)
            timeout = ring_timeout(body, self.gateway.settings.ring_timeout_s)
            options, _ = session_options(body.get("session"), self.registry.engine.capabilities.voices)
        except http.BodyError as exc:
            return exc.response()
        try:
            attempt = await self.gateway.dialer.dial(to, caller, options, timeout)
        except ServerFull as exc:
            return http.server_full(exc)
        except GatewayUnavailable as exc:
            return http.error_response(503, "gateway_unavailable", str(exc),
                                       headers={"Retry-After": str(self.settings.session.retry_after_s)})
        except CallActionRefused as exc:
            return http.error_response(exc.status, exc.code, exc.message)
        except SdpError as exc:
            return http.error_response(500, "offer_failed", str(exc), error_type="server_error")
        return http.json_response({**attempt.resource(), "session_token": attempt.token}, status=201,
                                  headers={"Location": f"{CALLS_PATH}/{attempt.id}"})

    # --- who may reach a call (checked by the HTTP edge before the handler) ---------------------------

    async def locate_placed(self, request: web.Request) -> Target | web.Response:
        """A placed call by its id (or its answered session's): its token opens it."""
        attempt = self.gateway.dialer.find(request.match_info["call"])
        if attempt is None:
            return http.error_response(404, "call_not_found", f"no placed call {request.match_info['call']!r}")
        return Target(Opener(secrets=(attempt.token,)), attempt)

    async def locate_call(self, request: web.Request) -> Target | web.Response:
        """A placed call, or any live session by its id (an inbound SIP call's opens with the server
        key only); the value is the session id (None before a placed call has one)."""
        key = request.match_info["call"]
        attempt = self.gateway.dialer.find(key)
        if attempt is not None:
            return Target(Opener(secrets=(attempt.token,)), attempt.session.id if attempt.session is not None else None)
        call = self.registry.calls.get(key)
        if call is not None:
            return Target(call.opener(), key)
        return http.error_response(404, "call_not_found", f"no call {key!r}")

    async def locate_events(self, request: web.Request) -> Target | web.Response:
        """A SIP call whose events may be streamed: a placed call from dialling on, an answered inbound one."""
        key = request.match_info["call"]
        attempt = self.gateway.dialer.find(key)
        if attempt is not None and attempt.session is not None and not attempt.final:
            return Target(Opener(secrets=(attempt.token,)), (attempt.session, attempt.on_end))
        call = self.registry.calls.get(key)
        if call is not None and self.gateway.carries(key):
            return Target(call.opener(), (call.session, call.on_closed))
        return http.error_response(404, "call_not_found", f"no phone call {key!r}")

    async def get(self, request: web.Request) -> web.Response:
        return http.json_response(request[TARGET_KEY].resource())

    async def delete(self, request: web.Request) -> web.Response:
        attempt = request[TARGET_KEY]
        if not await self.gateway.dialer.give_up(attempt, "cancelled"):
            if attempt.session is not None and attempt.answered_at is not None:
                await self.registry.close(attempt.session.id, "deleted")  # hangs the call up
        return http.json_response(attempt.resource())

    # --- transfer ------------------------------------------------------------------------------------

    async def transfer(self, request: web.Request) -> web.Response:
        """Transfer (REFER) a SIP call: blind to ``target_uri``, or attended to the target of its
        ``consult`` call (REFER with Replaces). ``{call}``: a placed call's id or a SIP call's session id."""
        key = request.match_info["call"]
        try:
            body = await read_object(request, {"target_uri", "consult"})
            target_uri(body, "target_uri", required="consult" not in body)
            if "consult" in body and not isinstance(body["consult"], str):
                raise http.BodyError(400, "invalid_request", "field 'consult' must be the id of the call to the target")
        except http.BodyError as exc:
            return exc.response()
        session_id = request[TARGET_KEY]
        if session_id is None:
            return http.error_response(404, "call_not_found", f"no call {key!r}")
        try:
            if "consult" in body:
                consult = self.gateway.consults.consult_of(session_id, body["consult"])
                transfer = await self.gateway.transfers.start(
                    session_id, body.get("target_uri") or consult.to, replaces=consult.sip_call_id,
                    consult_session=consult.session.id)
            else:
                transfer = await self.gateway.transfers.start(session_id, body["target_uri"])
        except CallActionRefused as exc:
            return http.error_response(exc.status, exc.code, exc.message)
        return http.json_response(transfer.state(), status=202)

    async def consult(self, request: web.Request) -> web.Response:
        """Attended transfer, first step: hold the caller and call the target (a placed call, 201)."""
        key = request.match_info["call"]
        try:
            body = await read_object(request, {"target_uri", "session", "ring_timeout_s"})
            target_uri(body, "target_uri")
            timeout = ring_timeout(body, self.gateway.settings.ring_timeout_s)
            options, _ = session_options(body.get("session"), self.registry.engine.capabilities.voices)
        except http.BodyError as exc:
            return exc.response()
        session_id = request[TARGET_KEY]
        if session_id is None:
            return http.error_response(404, "call_not_found", f"no call {key!r}")
        try:
            attempt = await self.gateway.consults.start(session_id, body["target_uri"], options, timeout)
        except CallActionRefused as exc:
            return http.error_response(exc.status, exc.code, exc.message)
        except ServerFull as exc:
            return http.server_full(exc)
        except GatewayUnavailable as exc:
            return http.error_response(503, "gateway_unavailable", str(exc))
        return http.json_response({**attempt.resource(), "session_token": attempt.token}, status=201,
                                  headers={"Location": f"{CALLS_PATH}/{attempt.id}"})

    # --- hold ----------------------------------------------------------------------------------------

    async def hold(self, request: web.Request) -> web.Response:
        """Hold (``.../hold``, body ``{"direction": "inactive" | "sendonly"}``) or resume (``.../unhold``)."""
        held = request.path.endswith("/hold")
        try:
            body = await read_object(request, {"direction"} if held else set())
        except http.BodyError as exc:
            return exc.response()
        key = request.match_info["call"]
        session_id = request[TARGET_KEY]
        if session_id is None:
            return http.error_response(404, "call_not_found", f"no call {key!r}")
        try:
            changed = await set_hold(self.gateway, session_id, held, body.get("direction"))
        except CallActionRefused as exc:
            return http.error_response(exc.status, exc.code, exc.message)
        return http.json_response({"session_id": session_id, "held": held, "changed": changed})

    # --- the event stream ------------------------------------------------------------------------------

    async def events(self, request: web.Request) -> web.StreamResponse:
        """A SIP call's events: a placed call's (from dialling on) or an answered inbound call's."""
        key = request.match_info["call"]
        session, watchers = request[TARGET_KEY]
        if session.closed:
            return http.error_response(404, "call_not_found", f"no phone call {key!r}")
        if session.id in self._streams:
            return http.error_response(409, "event_stream_taken", "this call already has an event stream attached")
        ws = await lifecycle_of(request).websocket(request, max_msg_size=MAX_MESSAGE_BYTES)
        socket = EventSocket(ws, f"events-writer-{session.id}")
        self._streams.add(session.id)
        watchers.append(lambda *_: socket.close("call ended"))
        try:
            await socket.serve(NativeDialect(session, socket.channel))
        finally:
            self._streams.discard(session.id)
        return ws


PLACED_OPENED_BY = "its session token (from the 201 that placed it)"
CALL_OPENED_BY = "a placed call's session token, a session's own secret (an inbound SIP call: the server key only)"


def add_routes(app: web.Application, settings: Settings, registry: CallRegistry, gateway: JanusSipGateway,
               with_events: bool) -> SipCalls:
    """``with_events``: add the event-stream route here (else the carriers' route falls back to ours)."""
    calls = SipCalls(settings, registry, gateway)
    table = table_of(app)
    body = Body(("application/json",), MAX_BODY_BYTES)
    table.add(app, Route("POST", CALLS_PATH, calls.create, Access.CREATE, body))
    table.add(app, Route("GET", CALLS_PATH + "/{call}", calls.get, Access.SESSION, locate=calls.locate_placed,
                         opened_by=PLACED_OPENED_BY))
    table.add(app, Route("DELETE", CALLS_PATH + "/{call}", calls.delete, Access.SESSION, locate=calls.locate_placed,
                         opened_by=PLACED_OPENED_BY))
    for verb, handler in (("transfer", calls.transfer), ("consult", calls.consult), ("hold", calls.hold),
                          ("unhold", calls.hold)):
        table.add(app, Route("POST", f"{CALLS_PATH}/{{call}}/{verb}", handler, Access.SESSION, body,
                             locate=calls.locate_call, opened_by=CALL_OPENED_BY))
    if with_events:
        table.add(app, Route("GET", CALLS_PATH + "/{call}/events", calls.events, Access.SESSION,
                             locate=calls.locate_events, opened_by=CALL_OPENED_BY, websocket=True))
    return calls
