"""The aiohttp application: signaling (JSON offer/answer and WHIP), health, sessions, metrics, web/.

The HTTP contract is written down in signaling/openapi.yaml; tests check this server against it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from lychee_rtc import __version__
from lychee_rtc.calls.call import Call, ServerFull
from lychee_rtc.calls.metrics import CallMetrics
from lychee_rtc.calls.registry import CallRegistry
from lychee_rtc.calls.tokens import Opener, is_session_token, secret_matches
from lychee_rtc.config import Settings
from lychee_rtc.engine.factory import build_backend
from lychee_rtc.engine.scheduler import Engine
from lychee_rtc.rtc.call import RtcCall
from lychee_rtc.rtc.negotiator import ResumeRefused, RtcNegotiator
from lychee_rtc.rtc.sdp import SdpError
from lychee_rtc.rtc.trickle import add_remote_candidates
from lychee_rtc.media.recording.store import RecordingStore
from lychee_rtc.server import auth, http, recordings, route_table
from lychee_rtc.server.auth import Access
from lychee_rtc.server.duplex.route import DuplexSockets
from lychee_rtc.server.lifecycle import LIFECYCLE_KEY, Lifecycle, shutdown_deadline
from lychee_rtc.server.logs import install_http_log_filter
from lychee_rtc.server.route_table import ADMITTED_KEY, TARGET_KEY, Body, Route, Target
from lychee_rtc.server.session_body import session_options
from lychee_rtc.server.openai import routes as realtime
from lychee_rtc.server.openai.dialect import OAI_EVENTS_LABEL, realtime_dialect
from lychee_rtc.server.openai.session_config import RealtimeProfile
from lychee_rtc.server.telephony import add_routes as add_telephony_routes
from lychee_rtc.session.dialect import DialectMap
from lychee_rtc.session.native import EVENTS_LABEL, NativeDialect
from lychee_rtc.session.processing import ProcessingUnavailable
from lychee_rtc.session.protocol import validator

log = logging.getLogger(__name__)

SETTINGS_KEY = web.AppKey("settings", Settings)
REGISTRY_KEY = web.AppKey("registry", CallRegistry)
RTC_KEY = web.AppKey("rtc", RtcNegotiator)
ENGINE_KEY = web.AppKey("engine", Engine)
METRICS_KEY = web.AppKey("metrics", CallMetrics)
GATEWAY_KEY = web.AppKey("gateway", object)  # the SIP gateway connector, when configured

# --- middleware ------------------------------------------------------------------------------------


@web.middleware
async def page_headers(request: web.Request, handler: http.Handler) -> web.StreamResponse:
    response = await handler(request)
    if request.path in ("/", "/latency") or request.path.startswith("/static/"):
        # The page is ES modules: revalidate so an upgrade never runs a stale mix of files.
        response.headers["Cache-Control"] = "no-cache"
        response.headers["Content-Security-Policy"] = (
            "default-src 'self'; connect-src *; media-src 'self' blob: mediastream:; img-src 'self' data:")
    return response


# --- helpers ---------------------------------------------------------------------------------------


def _ice_links(settings: Settings) -> list[str]:
    links = []
    for server in settings.rtc.ice_servers:
        for url in server.urls:
            link = f'<{url}>; rel="ice-server"'
            if server.username is not None:
                link += f'; username="{server.username}"; credential="{server.credential or ""}"'
                link += '; credential-type="password"'
            links.append(link)
    return links


def _whip_headers(call: RtcCall) -> dict[str, str]:
    return {"ETag": call.etag, "Accept-Patch": http.WHIP_PATCH_TYPE}


# --- handlers --------------------------------------------------------------------------------------


async def admit_resume(request: web.Request) -> RtcCall | None:
    """A session's own token as bearer admits a resume of that session (and nothing else). Without a
    server key anyone may post offers: nothing to admit, the resume checks its token itself."""
    token = auth.bearer(request)
    if request.app[SETTINGS_KEY].server.auth_token is None or not is_session_token(token):
        return None
    return request.app[RTC_KEY].call_by_token(token)


async def offer(request: web.Request) -> web.Response:
    body = await http.read_json_object(request, request.app[SETTINGS_KEY].server.max_sdp_bytes)
    if not isinstance(body.get("sdp"), str):
        return http.error_response(400, "invalid_request", "field 'sdp' (string) is required")
    if body.get("type") != "offer":
        return http.error_response(400, "invalid_request", "field 'type' must be \"offer\"")
    unknown = set(body) - {"sdp", "type", "session", "resume"}
    if unknown:
        return http.error_response(400, "invalid_request", f"unknown field(s): {', '.join(sorted(unknown))}")
    resuming: RtcCall | None = request.get(ADMITTED_KEY)  # the caller holds only this session's token
    if "resume" in body:
        return await _resume(request, body, resuming)
    if resuming is not None:
        return http.unauthorized("a session token only resumes its own session; a new one needs the server key")
    raw_session = body.get("session")
    try:
        options, metrics = session_options(raw_session, request.app[ENGINE_KEY].capabilities.voices)
    except http.BodyError as exc:
        return exc.response()
    record = bool((raw_session or {}).get("recording", False))
    if record and not request.app[SETTINGS_KEY].recording.client_control:
        return http.error_response(400, "recording_not_allowed",
                                   "session/recording: this server decides what is recorded (recording.client_control)")
    processing = (raw_session or {}).get("audio_processing")
    try:
        call = await request.app[RTC_KEY].create(body["sdp"], options, metrics=metrics, record=record,
                                                 processing=processing, resumable=True)
    except ServerFull as exc:
        return http.server_full(exc)
    except ProcessingUnavailable as exc:
        return http.error_response(400, "audio_processing_unavailable", f"session/audio_processing: {exc}")
    except SdpError as exc:
        return http.sdp_refused(exc)
    return http.json_response({"sdp": call.answer_sdp, "type": "answer",
                               "session_id": call.session.id, "session_token": call.token})


async def _resume(request: web.Request, body: dict[str, Any], admitted: RtcCall | None) -> web.Response:
    """Re-attach an existing session to this offer's new peer connection (see RtcNegotiator.resume).

    The session's token is the credential: as bearer (checked before the body was read), or in the
    body where no server key is configured (anyone may post offers then)."""
    resume = body["resume"]
    errors = list(validator("resume").iter_errors(resume))
    if errors:
        where = "/".join(str(p) for p in errors[0].path)
        return http.error_response(400, "invalid_resume",
                                   f"resume{'/' + where if where else ''}: {errors[0].message}")
    if "session" in body:
        return http.error_response(400, "invalid_request",
                                   "a resumed session keeps its options: send no 'session' object")
    token = resume.get("session_token") or auth.bearer(request)
    if admitted is not None and (admitted.session.id != resume["session_id"]
                                 or not secret_matches(token, admitted.token)):
        return http.unauthorized("a session token only resumes its own session")
    try:
        call = await request.app[RTC_KEY].resume(resume["session_id"], token, body["sdp"], resume.get("last_seq", 0))
    except ResumeRefused as exc:
        if exc.status == 401:
            return http.unauthorized(exc.message)
        return http.error_response(exc.status, exc.code, exc.message)
    except SdpError as exc:
        return http.sdp_refused(exc)
    return http.json_response({"sdp": call.answer_sdp, "type": "answer",
                               "session_id": call.session.id, "session_token": call.token})


async def whip_post(request: web.Request) -> web.Response:
    if request.content_type != "application/sdp":
        return http.error_response(415, "unsupported_media_type", "WHIP offers must be sent as application/sdp")
    try:
        sdp = await http.read_text(request, request.app[SETTINGS_KEY].server.max_sdp_bytes, "the SDP offer")
        call = await request.app[RTC_KEY].create(sdp, whip=True)
    except ServerFull as exc:
        return http.server_full(exc)
    except SdpError as exc:
        return http.sdp_refused(exc)
    location = f"/whip/{call.whip_resource}"
    headers = {"Location": location, **_whip_headers(call)}
    response = web.Response(status=201, text=call.answer_sdp, content_type="application/sdp",
                            headers=headers)
    for link in _ice_links(request.app[SETTINGS_KEY]):
        response.headers.add("Link", link)
    return response


async def locate_session(request: web.Request) -> Target | web.Response:
    """The session named in the path (any call of the registry) and what opens it."""
    session_id = request.match_info["session_id"]
    call = request.app[REGISTRY_KEY].calls.get(session_id)
    if call is None:
        return http.error_response(404, "session_not_found", f"no session {session_id!r}")
    return Target(call.opener(), call)


async def locate_whip(request: web.Request) -> Target | web.Response:
    """The WHIP resource URL is the session's capability: holding it is the authorisation."""
    call = request.app[RTC_KEY].whip_call(request.match_info["resource_id"])
    if call is None:
        return http.error_response(404, "session_not_found", "no such WHIP resource")
    return Target(Opener(), call)


async def whip_patch(request: web.Request) -> web.Response:
    call: RtcCall = request[TARGET_KEY]
    if request.content_type != http.WHIP_PATCH_TYPE:
        return http.error_response(415, "unsupported_media_type", f"PATCH bodies must be {http.WHIP_PATCH_TYPE}",
                                   headers={"Accept-Patch": http.WHIP_PATCH_TYPE})
    if_match = request.headers.get("If-Match")
    if if_match is not None and if_match not in ("*", call.etag):
        return http.error_response(412, "etag_mismatch", "If-Match does not match the session's ICE entity tag")
    try:
        fragment = await http.read_text(request, request.app[SETTINGS_KEY].server.max_sdp_bytes,
                                        "the SDP fragment")
        await add_remote_candidates(call.pc, fragment)
    except SdpError as exc:
        return http.sdp_refused(exc)
    return web.Response(status=204, headers=_whip_headers(call))


async def whip_delete(request: web.Request) -> web.Response:
    call: RtcCall = request[TARGET_KEY]
    await request.app[REGISTRY_KEY].close(call.session.id, "deleted")
    return web.Response(status=200)


async def delete_session(request: web.Request) -> web.Response:
    call: Call = request[TARGET_KEY]
    await request.app[REGISTRY_KEY].close(call.session.id, "deleted")
    return web.Response(status=200)


async def list_sessions(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    return http.json_response({
        "capacity": registry.capacity,
        "free": registry.free,
        "sessions": [call.snapshot() for call in registry.calls.values()],
    })


async def get_session(request: web.Request) -> web.Response:
    call: Call = request[TARGET_KEY]
    return http.json_response(call.snapshot())


async def healthz(request: web.Request) -> web.Response:
    return http.json_response({"status": "ok", "version": __version__})


async def readyz(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    engine = request.app[ENGINE_KEY]
    body = {"engine": engine.capabilities.name, "capacity": registry.capacity, "free": registry.free}
    if not engine.running:
        return http.json_response({"status": "starting", **body}, status=503)
    if registry.free <= 0:
        return http.json_response({"status": "full", **body}, status=503,
                                  headers={"Retry-After": str(request.app[SETTINGS_KEY].session.retry_after_s)})
    return http.json_response({"status": "ready", **body})


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS_KEY]
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


async def _page(request: web.Request, name: str) -> web.StreamResponse:
    page = request.app[SETTINGS_KEY].web_root / name
    if not page.is_file():
        return http.error_response(404, "not_found", "web client not installed")
    return await http.file_response(request, page)


async def index(request: web.Request) -> web.StreamResponse:
    return await _page(request, "index.html")


async def latency_page(request: web.Request) -> web.StreamResponse:
    """The latency tester (web/latency.html): mouth-to-ear and response latency, measured in the browser."""
    return await _page(request, "latency.html")


async def static_file(request: web.Request) -> web.StreamResponse:
    """A file of the web client (its scripts and styles), never anything outside its folder."""
    root = request.app[SETTINGS_KEY].web_root.resolve()
    path = (root / request.match_info["file"]).resolve()
    if root not in path.parents or not path.is_file():
        return http.error_response(404, "not_found", "no such file")
    return await http.file_response(request, path)


# --- application -----------------------------------------------------------------------------------


SESSION_OPENED_BY = "its session token (a WHIP session: its resource id; a realtime call: the ek_ key that opened it too)"


def _declare(app: web.Application, settings: Settings) -> None:
    """The server's own routes (the OpenAI, SIP, carrier and recording routes declare theirs)."""
    table = route_table.table_of(app)
    sdp = settings.server.max_sdp_bytes
    for route in (
        Route("POST", "/v1/rtc/offer", offer, Access.CREATE, Body(("application/json",), sdp),
              admit=admit_resume, admits="a session's own token (a resume of that session)"),
        Route("GET", "/v1/sessions", list_sessions, Access.ADMIN),
        Route("GET", "/v1/sessions/{session_id}", get_session, Access.SESSION, locate=locate_session,
              opened_by=SESSION_OPENED_BY),
        Route("DELETE", "/v1/sessions/{session_id}", delete_session, Access.SESSION, locate=locate_session,
              opened_by=SESSION_OPENED_BY),
        Route("POST", "/whip", whip_post, Access.CREATE, Body(("application/sdp",), sdp)),
        Route("PATCH", "/whip/{resource_id}", whip_patch, Access.SESSION, Body((http.WHIP_PATCH_TYPE,), sdp),
              locate=locate_whip, secret_in_path=True, opened_by="its resource URL (the path is the secret)"),
        Route("DELETE", "/whip/{resource_id}", whip_delete, Access.SESSION, locate=locate_whip,
              secret_in_path=True, opened_by="its resource URL (the path is the secret)"),
    ):
        table.add(app, route)


def _declare_open(app: web.Application, settings: Settings) -> None:
    table = route_table.table_of(app)
    table.add(app, Route("GET", "/healthz", healthz, Access.OPEN))
    table.add(app, Route("GET", "/readyz", readyz, Access.OPEN))
    if settings.metrics.enabled:
        table.add(app, Route("GET", "/metrics", metrics, Access.OPEN))
    table.add(app, Route("GET", "/", index, Access.OPEN))
    table.add(app, Route("GET", "/latency", latency_page, Access.OPEN))
    if settings.web_root.is_dir():
        table.add(app, Route("GET", "/static/{file:.+}", static_file, Access.OPEN))


def create_app(settings: Settings, engine: Engine | None = None) -> web.Application:
    install_http_log_filter()
    edge = route_table.edge(lambda request: request.app[SETTINGS_KEY])
    app = web.Application(middlewares=[edge, page_headers], client_max_size=settings.server.max_sdp_bytes)
    if engine is None:
        engine = Engine(build_backend(settings), settings.session.max_pending_windows)
    call_metrics = CallMetrics()
    app[SETTINGS_KEY] = settings
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = call_metrics
    lifecycle = app[LIFECYCLE_KEY] = Lifecycle(settings.server.body_timeout_s, settings.websocket.heartbeat_s)
    store = RecordingStore(settings.recording)
    registry = app[REGISTRY_KEY] = CallRegistry(settings, engine, call_metrics, store)
    profile = RealtimeProfile.build(settings, engine.capabilities)
    # What a WebRTC data channel speaks, by its label: the transport is handed this, not the dialects.
    dialects: DialectMap = {EVENTS_LABEL: NativeDialect, OAI_EVENTS_LABEL: realtime_dialect(profile)}
    rtc = app[RTC_KEY] = RtcNegotiator(settings, registry, dialects)

    _declare(app, settings)
    surface = realtime.install(app, settings, registry, rtc, profile)
    surface.duplex = DuplexSockets(settings, registry, profile, surface.sockets)
    sip_calls = None
    if settings.gateway.janus.enabled:
        from lychee_rtc.gateway.janus_sip import JanusSipGateway
        from lychee_rtc.server.sip_calls import add_routes as add_sip_call_routes

        gateway = app[GATEWAY_KEY] = JanusSipGateway(settings.gateway.janus, registry, rtc)
        app[realtime.REALTIME_KEY].gateway = gateway
        sip_calls = add_sip_call_routes(app, settings, registry, gateway, with_events=not settings.telephony.enabled)
    if settings.telephony.enabled:
        add_telephony_routes(app, settings, registry, sip_calls)
    _declare_open(app, settings)
    recordings.install(app, store, registry, settings)

    async def on_startup(app: web.Application) -> None:
        await app[ENGINE_KEY].start()
        if GATEWAY_KEY in app:
            await app[GATEWAY_KEY].start()

    async def on_shutdown(app: web.Application) -> None:
        """SIGTERM: everything within ``server.shutdown_grace_s``, on one deadline."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = shutdown_deadline(started, settings.server.shutdown_grace_s)
        lifecycle.begin_stop()  # body reads waiting on clients end now; no new body read or socket
        if GATEWAY_KEY in app:
            try:
                await asyncio.wait_for(app[GATEWAY_KEY].stop(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                log.warning("the SIP gateway did not stop within the shutdown grace")
        await registry.close_all("server_shutdown", deadline)
        await app[ENGINE_KEY].stop()
        await recordings.finish(store, max(0.0, deadline - loop.time()))
        await lifecycle.stop(deadline)  # sockets the calls did not close: 1001, then dropped at the deadline
        log.info("shut down in %.2f s (server.shutdown_grace_s %.1f s)", loop.time() - started,
                 settings.server.shutdown_grace_s)

    table = route_table.table_of(app)
    app.on_startup.append(table.check)  # a route without a declaration stops the start
    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    return app
