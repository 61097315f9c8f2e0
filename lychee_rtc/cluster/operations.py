"""The cluster entry's own routes: health, readiness, metrics and the workers' operations (list,
drain, a worker's metrics); and what every handler of the entry shares (the fleet, its refusals,
its bounded body read)."""

from __future__ import annotations

from aiohttp import web

from lychee_rtc import __version__
from lychee_rtc.cluster.fleet import Fleet
from lychee_rtc.cluster.proxy import WorkerFailed, WorkerUnreachable, forward
from lychee_rtc.cluster.registry import WorkerView
from lychee_rtc.config import Settings
from lychee_rtc.jsonio import JsonError, strict_json_loads
from lychee_rtc.server import http
from lychee_rtc.server.app import SETTINGS_KEY
from lychee_rtc.server.openai import routes as realtime

FLEET_KEY = web.AppKey("fleet", Fleet)


def unavailable(fleet: Fleet, code: str, message: str) -> web.Response:
    return http.unavailable(code, message, fleet.settings.session.retry_after_s)


def body_limit(settings: Settings) -> int:
    # A realtime call's multipart body holds a session part besides the SDP; the worker bounds each.
    return settings.server.max_sdp_bytes + realtime.MAX_SESSION_PART_BYTES + 4096


async def read_body(request: web.Request) -> bytes:
    """The request body as the client sent it, bounded: one too large is refused by the HTTP edge's
    ``BodyError`` answer, and a client that hangs up mid-body is one log line."""
    return await http.read_body(request, body_limit(request.app[SETTINGS_KEY]))


# --- health and operations -------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    return http.json_response({"status": "ok", "version": __version__})


async def readyz(request: web.Request) -> web.Response:
    fleet = request.app[FLEET_KEY]
    registry = fleet.registry
    engines = sorted({v.status["engine"] for v in registry.workers.values() if v.status})
    body = {"engine": ",".join(engines) or fleet.settings.engine.name, "capacity": registry.capacity,
            "free": registry.free, "active": registry.active,
            "workers": {state: n for state in ("ready", "starting", "draining", "down", "dead", "stopped")
                        if (n := registry.count(state))}}
    if registry.count("ready") == 0:
        return http.json_response({"status": "starting", **body}, status=503)
    if registry.free <= 0:
        return http.json_response({"status": "full", **body}, status=503,
                                 headers={"Retry-After": str(fleet.settings.session.retry_after_s)})
    return http.json_response({"status": "ready", **body})


async def metrics(request: web.Request) -> web.Response:
    m = request.app[FLEET_KEY].metrics
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


async def list_workers(request: web.Request) -> web.Response:
    fleet = request.app[FLEET_KEY]
    return http.json_response({"workers": [v.describe() for v in fleet.registry.workers.values()],
                               "waiting": fleet.waiting})


def _worker_or_404(request: web.Request) -> WorkerView | web.Response:
    worker = request.match_info["worker_id"]
    view = request.app[FLEET_KEY].registry.workers.get(worker)
    if view is None:
        return http.error_response(404, "worker_not_found", f"no worker {worker!r}")
    return view


async def drain_worker(request: web.Request) -> web.Response:
    view = _worker_or_404(request)
    if isinstance(view, web.Response):
        return view
    fleet = request.app[FLEET_KEY]
    raw = await read_body(request)
    try:
        options = strict_json_loads(raw) if raw.strip() else {}
    except JsonError as exc:
        return http.error_response(400, "invalid_json", f"request body is not valid JSON: {exc}")
    if not isinstance(options, dict) or set(options) - {"deadline_s", "restart"}:
        return http.error_response(400, "invalid_request", "body: an object with deadline_s (seconds) and restart (boolean)")
    deadline = options.get("deadline_s", fleet.settings.cluster.drain_timeout_s)
    restart = options.get("restart", True)
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not deadline > 0:
        return http.error_response(400, "invalid_request", "deadline_s must be a number of seconds above 0")
    if not isinstance(restart, bool):
        return http.error_response(400, "invalid_request", "restart must be true or false")
    if view.state not in ("ready", "draining"):
        return http.error_response(409, "worker_not_ready", f"worker {view.worker_id} is {view.state}")
    try:
        await fleet.drain(view, float(deadline), restart)
    except Exception as exc:  # the worker died under the request: the poller will say so
        return unavailable(fleet, "worker_unavailable", f"worker {view.worker_id}: {type(exc).__name__}: {exc}")
    return http.json_response(view.describe(), status=202)


async def worker_metrics(request: web.Request) -> web.Response:
    view = _worker_or_404(request)
    if isinstance(view, web.Response):
        return view
    fleet = request.app[FLEET_KEY]
    if view.url is None or view.state in ("dead", "stopped"):
        return unavailable(fleet, "worker_unavailable", f"worker {view.worker_id} is {view.state}")
    try:
        return await forward(fleet.http, view.url, request, b"", fleet.timeout(), path_qs="/metrics")
    except (WorkerUnreachable, WorkerFailed) as exc:
        return unavailable(fleet, "worker_unavailable", str(exc))


