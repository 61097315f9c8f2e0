"""The aiohttp application: signaling (JSON offer/answer and WHIP), health, sessions, metrics, web/.

The HTTP contract is written down in signaling/openapi.yaml; tests check this server against it.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web

from lychee_rtc import __version__
from lychee_rtc.calls.call import Call, ServerFull
from lychee_rtc.calls.metrics import CallMetrics
from lychee_rtc.calls.registry import CallRegistry
from lychee_rtc.config import Settings
from lychee_rtc.engine.factory import build_backend
from lychee_rtc.engine.scheduler import Engine
from lychee_rtc.rtc.call import RtcCall
from lychee_rtc.rtc.negotiator import ResumeRefused, RtcNegotiator
from lychee_rtc.rtc.sdp import SdpError
from lychee_rtc.rtc.trickle import add_remote_candidates
from lychee_rtc.media.recording.store import RecordingStore
from lychee_rtc.server import auth, http, recordings
from lychee_rtc.server.auth import Policy
from lychee_rtc.server.duplex.route import DuplexSockets
from lychee_rtc.server.logs import install_http_log_filter
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


def _server_key_guard(request: web.Request) -> web.Response | None:
    key = request.app[SETTINGS_KEY].server.auth_token
    if auth.policy_of(request) is Policy.SERVER_KEY and not auth.has_server_key(request, key):
        return http.unauthorized()
    return None


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


@auth.policy(Policy.SESSION)  # a new session needs the server key, a resume the session's token
async def offer(request: web.Request) -> web.Response:
    body = await http.read_json_object(request, request.app[SETTINGS_KEY].server.max_sdp_bytes)
    if not isinstance(body.get("sdp"), str):
        return http.error_response(400, "invalid_request", "field 'sdp' (string) is required")
    if body.get("type") != "offer":
        return http.error_response(400, "invalid_request", "field 'type' must be \"offer\"")
    unknown = set(body) - {"sdp", "type", "session", "resume"}
    if unknown:
        return http.error_response(400, "invalid_request", f"unknown field(s): {', '.join(sorted(unknown))}")
    if "resume" in body:
        return await _resume(request, body)
    if not auth.has_server_key(request, request.app[SETTINGS_KEY].server.auth_token):
        return http.unauthorized("missing or wrong bearer token")
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
                                                 processing=processing)
    except ServerFull as exc:
        return http.server_full(exc)
    except ProcessingUnavailable as exc:
        return http.error_response(400, "audio_processing_unavailable", f"session/audio_processing: {exc}")
    except SdpError as exc:
        return http.sdp_refused(exc)
    return http.json_response({"sdp": call.answer_sdp, "type": "answer",
                               "session_id": call.session.id, "session_token": call.token})


async def _resume(request: web.Request, body: dict[str, Any]) -> web.Response:
    """Re-attach an existing session to this offer's new peer connection (see RtcNegotiator.resume)."""
    resume = body["resume"]
    errors = list(validator("resume").iter_errors(resume))
    if errors:
        where = "/".join(str(p) for p in errors[0].path)
        return http.error_response(400, "invalid_resume",
                                   f"resume{'/' + where if where else ''}: {errors[0].message}")
    if "session" in body:
        return http.error_response(400, "invalid_request",
                                   "a resumed session keeps its options: send no 'session' object")
    try:
        call = await request.app[RTC_KEY].resume(resume["session_id"], resume["session_token"], body["sdp"],
                                                 resume.get("last_seq", 0))
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


def _session_call(request: web.Request) -> Call | web.Response:
    """The session named in the path, if the request holds its token (or the server key)."""
    session_id = request.match_info["session_id"]
    call = request.app[REGISTRY_KEY].calls.get(session_id)
    if call is None:
        return http.error_response(404, "session_not_found", f"no session {session_id!r}")
    if not auth.may_use_session(request, call.token, request.app[SETTINGS_KEY].server.auth_token):
        return http.unauthorized("this session needs its session_token (or the server key) as bearer token")
    return call


def _whip_call(request: web.Request) -> RtcCall | web.Response:
    """The WHIP resource URL is the session's capability: holding it is the authorisation."""
    call = request.app[RTC_KEY].whip_call(request.match_info["resource_id"])
    if call is None:
        return http.error_response(404, "session_not_found", "no such WHIP resource")
    return call


@auth.policy(Policy.SESSION)
async def whip_patch(request: web.Request) -> web.Response:
    call = _whip_call(request)
    if isinstance(call, web.Response):
        return call
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


@auth.policy(Policy.SESSION)
async def whip_delete(request: web.Request) -> web.Response:
    call = _whip_call(request)
    if isinstance(call, web.Response):
        return call
    await request.app[REGISTRY_KEY].close(call.session.id, "deleted")
    return web.Response(status=200)


@auth.policy(Policy.SESSION)
async def delete_session(request: web.Request) -> web.Response:
    call = _session_call(request)
    if isinstance(call, web.Response):
        return call
    await request.app[REGISTRY_KEY].close(call.session.id, "deleted")
    return web.Response(status=200)


async def list_sessions(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    return http.json_response({
        "capacity": registry.capacity,
        "free": registry.free,
        "sessions": [call.snapshot() for call in registry.calls.values()],
    })


@auth.policy(Policy.SESSION)
async def get_session(request: web.Request) -> web.Response:
    call = _session_call(request)
    if isinstance(call, web.Response):
        return call
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


async def index(request: web.Request) -> web.StreamResponse:
    page = request.app[SETTINGS_KEY].web_root / "index.html"
    if not page.is_file():
        return http.error_response(404, "not_found", "web client not installed")
    return web.FileResponse(page)


async def latency_page(request: web.Request) -> web.StreamResponse:
    """The latency tester (web/latency.html): mouth-to-ear and response latency, measured in the browser."""
    page = request.app[SETTINGS_KEY].web_root / "latency.html"
    if not page.is_file():
        return http.error_response(404, "not_found", "web client not installed")
    return web.FileResponse(page)


# --- application -----------------------------------------------------------------------------------


def create_app(settings: Settings, engine: Engine | None = None) -> web.Application:
    install_http_log_filter()
    edge = http.edge_middleware(lambda request: request.app[SETTINGS_KEY].server.cors_origins, _server_key_guard)
    app = web.Application(middlewares=[edge, page_headers], client_max_size=settings.server.max_sdp_bytes)
    if engine is None:
        engine = Engine(build_backend(settings), settings.session.max_pending_windows)
    call_metrics = CallMetrics()
    app[SETTINGS_KEY] = settings
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = call_metrics
    store = RecordingStore(settings.recording)
    registry = app[REGISTRY_KEY] = CallRegistry(settings, engine, call_metrics, store)
    profile = RealtimeProfile.build(settings, engine.capabilities)
    # What a WebRTC data channel speaks, by its label: the transport is handed this, not the dialects.
    dialects: DialectMap = {EVENTS_LABEL: NativeDialect, OAI_EVENTS_LABEL: realtime_dialect(profile)}
    rtc = app[RTC_KEY] = RtcNegotiator(settings, registry, dialects)

    app.router.add_post("/v1/rtc/offer", offer)
    app.router.add_get("/v1/sessions", list_sessions)
    app.router.add_get("/v1/sessions/{session_id}", get_session)
    app.router.add_delete("/v1/sessions/{session_id}", delete_session)
    app.router.add_post("/whip", whip_post)
    app.router.add_patch("/whip/{resource_id}", whip_patch)
    app.router.add_delete("/whip/{resource_id}", whip_delete)
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
        add_telephony_routes(app, settings, registry, sip_calls.events if sip_calls is not None else None)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if settings.metrics.enabled:
        app.router.add_get("/metrics", metrics)
    app.router.add_get("/", index)
    app.router.add_get("/latency", latency_page)
    if settings.web_root.is_dir():
        app.router.add_static("/static/", settings.web_root, show_index=False)

    async def on_startup(app: web.Application) -> None:
        await app[ENGINE_KEY].start()
        if GATEWAY_KEY in app:
            await app[GATEWAY_KEY].start()

    async def on_shutdown(app: web.Application) -> None:
        if GATEWAY_KEY in app:
            await app[GATEWAY_KEY].stop()
        await app[REGISTRY_KEY].close_all("server_shutdown")
        await app[ENGINE_KEY].stop()

    app.on_startup.append(on_startup)
    app.on_shutdown.append(on_shutdown)
    recordings.install(app, store, registry, settings)
    return app
