"""The cluster entry: the public signaling address in front of the workers.

* ``POST /v1/rtc/offer``, ``POST /whip`` and ``POST /v1/realtime/calls`` go to the least-loaded
  worker with a free slot; its answer comes back unchanged (status, headers, body). A worker that
  turns out full or unreachable is skipped for the next one; when none has room the entry answers
  503 with ``Retry-After``.
* Follow-ups (``/whip/{id}``, ``/v1/sessions/{id}``, ``/v1/realtime/calls/{id}/hangup``, the
  sideband WebSocket ``/v1/realtime?call_id=``, a session's recording) go to the worker named in
  the session id (a call id is a session id); a recording passes on as it arrives.
* ``POST /v1/realtime/client_secrets`` goes to any ready worker: keys are signed with the server key
  that every worker shares, so any worker accepts a key that another minted.
* ``/readyz``, ``/metrics``, ``/v1/sessions`` and ``/v1/recordings`` describe the whole cluster; each worker keeps its
  own, on its own port (``/v1/cluster/workers/{id}/metrics`` reaches a worker's through the entry).
* ``POST /v1/cluster/workers/{id}/drain`` is the rolling restart: the worker takes no new calls,
  ends after its calls or a deadline, and Ray starts a new process in its place.
* WebSockets (a carrier's stream, a realtime socket, a sideband, a call's events) are relayed to a
  worker: ``sockets.py``. Which worker a request names, and the refusals, are ``routing.py``'s.

The entry holds no session state: any number of entries can front the same workers.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from lychee_rtc import __version__
from lychee_rtc.cluster.fleet import Fleet, NoPlacement
from lychee_rtc.cluster.proxy import WorkerFailed, WorkerUnreachable, forward, forward_download
from lychee_rtc.cluster.routing import (FLEET_KEY, admin_refusal, body_limit, from_holder, holder, no_placement,
                                        read_body, target_of, unavailable, worker_holding)
from lychee_rtc.cluster.sockets import place_websocket, realtime_socket, routed_websocket
from lychee_rtc.cluster.registry import WorkerView
from lychee_rtc.config import Settings
from lychee_rtc.jsonio import JsonError, strict_json_loads
from lychee_rtc.server import http
from lychee_rtc.server.app import SETTINGS_KEY, index, latency_page
from lychee_rtc.server.openai import routes as realtime



# --- new sessions ----------------------------------------------------------------------------------


def _is_full(response: web.Response) -> bool:
    if response.status != 503:
        return False
    try:
        return json.loads(response.body)["error"]["code"] == "server_full"
    except (ValueError, KeyError, TypeError):
        return False


async def place(request: web.Request) -> web.Response:
    """An offer: to the least-loaded worker with room; the next one if it turns out full or gone."""
    fleet = request.app[FLEET_KEY]
    body = await read_body(request)
    if (resumed := _resumed_session(request, body)) is not None:
        # A resume re-attaches a session where it lives (its engine slot, its context): not placed.
        return await _forward_to_holder(request, body, (resumed, "session"))

    async def offer(view: WorkerView) -> web.Response:
        started = time.monotonic()
        response = await forward(fleet.http, view.url, request, body, fleet.timeout())
        fleet.metrics.forward_seconds.labels("offer").observe(time.monotonic() - started)
        return response

    placed = await fleet.on_a_worker(offer, _is_full, lambda response: response.status < 300)
    if isinstance(placed, NoPlacement):
        return no_placement(fleet, placed)
    return placed.answer


async def any_worker(request: web.Request) -> web.Response:
    """A request that takes no slot and needs no session (minting a client key): to a ready worker."""
    fleet = request.app[FLEET_KEY]
    body = await read_body(request)
    tried: set[str] = set()
    while (view := fleet.registry.choose_any(tried)) is not None:
        tried.add(view.worker_id)
        try:
            return await forward(fleet.http, view.url, request, body, fleet.timeout())
        except WorkerUnreachable as exc:
            fleet.registry.mark_down(view, str(exc))
        except WorkerFailed as exc:
            return http.error_response(502, "worker_failed", f"worker {view.worker_id}: {exc}")
    return unavailable(fleet, "no_worker_ready", "no worker is ready; retry later")


# --- follow-ups ------------------------------------------------------------------------------------


def _resumed_session(request: web.Request, body: bytes) -> str | None:
    """The session a JSON offer asks to resume (``resume.session_id``), if it names one."""
    if request.path != "/v1/rtc/offer":
        return None
    try:
        resume = json.loads(body).get("resume")
    except (ValueError, RecursionError, AttributeError):
        return None  # not for the entry to judge: the worker answers a malformed body precisely
    session_id = resume.get("session_id") if isinstance(resume, dict) else None
    return session_id if isinstance(session_id, str) else None


async def routed(request: web.Request) -> web.Response:
    """A request about one session: to the worker whose id the session id carries."""
    return await _forward_to_holder(request, await read_body(request), target_of(request))


async def _forward_to_holder(request: web.Request, body: bytes, target: tuple[str, str]) -> web.Response:
    fleet = request.app[FLEET_KEY]
    view = holder(request, target)
    if isinstance(view, web.Response):
        return view

    async def send() -> web.Response:
        started = time.monotonic()
        response = await forward(fleet.http, view.url, request, body, fleet.timeout())
        fleet.metrics.forward_seconds.labels("follow_up").observe(time.monotonic() - started)
        return response
    return await from_holder(fleet, view, target[0], send)


async def routed_server_key(request: web.Request) -> web.Response:
    """A hang-up: the server key is checked first, as a single server does, then it is routed."""
    if (denied := admin_refusal(request)) is not None:
        return denied
    return await routed(request)


async def _from_every_worker(request: web.Request, key: str) -> list[dict[str, Any]] | web.Response:
    """The request asked of every worker that takes requests, their ``key`` lists joined (workers
    that cannot be reached are left out); a worker's refusal (a missing or wrong key) as it came."""
    fleet = request.app[FLEET_KEY]
    views = [v for v in fleet.registry.workers.values() if v.state in ("ready", "draining") and v.url]
    results = await asyncio.gather(*(forward(fleet.http, v.url, request, b"", fleet.timeout())
                                     for v in views), return_exceptions=True)
    items: list[dict[str, Any]] = []
    for result in results:
        if isinstance(result, web.Response):
            if result.status != 200:
                return result
            items.extend(json.loads(result.body)[key])
    return items


async def list_sessions(request: web.Request) -> web.Response:
    """Every worker's sessions in one list."""
    sessions = await _from_every_worker(request, "sessions")
    if isinstance(sessions, web.Response):
        return sessions
    registry = request.app[FLEET_KEY].registry
    return http.json_response({"capacity": registry.capacity, "free": registry.free, "sessions": sessions})


async def list_recordings(request: web.Request) -> web.Response:
    """Every worker's recordings in one list, oldest first as one server lists them. A worker's
    recordings are on its own disk: those of a worker that is down are missing until it is back."""
    recordings = await _from_every_worker(request, "recordings")
    if isinstance(recordings, web.Response):
        return recordings
    recordings.sort(key=lambda meta: meta.get("started_at") or 0)
    return http.json_response({"recordings": recordings})


async def routed_recording(request: web.Request) -> web.StreamResponse:
    """A session's recording (docs/recording.md), from the worker in its session id: files pass on
    as they arrive (a long call's recording is larger than any answer the entry holds whole)."""
    fleet = request.app[FLEET_KEY]
    session_id = request.match_info["session_id"]
    view = worker_holding(request, session_id)
    if isinstance(view, str):
        return http.error_response(404, "recording_not_found", f"no recording of session {session_id!r}{view}")
    if request.method == "DELETE":
        return await from_holder(fleet, view, session_id,
                                  lambda: forward(fleet.http, view.url, request, b"", fleet.timeout()))
    return await from_holder(fleet, view, session_id,
                              lambda: forward_download(fleet.http, view.url, request, fleet.download_timeout()))


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
    if (denied := admin_refusal(request)) is not None:
        return denied
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
    if (denied := admin_refusal(request)) is not None:
        return denied
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


# --- application -----------------------------------------------------------------------------------


def create_entry_app(settings: Settings) -> web.Application:
    origins = settings.server.cors_origins  # forwarded answers keep the worker's CORS headers
    app = web.Application(middlewares=[http.edge_middleware(lambda request: origins)],
                          client_max_size=body_limit(settings))
    app[SETTINGS_KEY] = settings
    app[FLEET_KEY] = Fleet(settings)

    app.router.add_post("/v1/rtc/offer", place)
    app.router.add_post("/whip", place)
    app.router.add_patch("/whip/{session_id}", routed)
    app.router.add_delete("/whip/{session_id}", routed)
    app.router.add_get("/v1/sessions", list_sessions)
    app.router.add_get("/v1/sessions/{session_id}", routed)
    app.router.add_delete("/v1/sessions/{session_id}", routed)
    app.router.add_get("/v1/recordings", list_recordings)
    app.router.add_get("/v1/sessions/{session_id}/recording", routed_recording)
    app.router.add_get("/v1/sessions/{session_id}/recording/events", routed_recording)
    app.router.add_delete("/v1/sessions/{session_id}/recording", routed_recording)
    app.router.add_post(realtime.CALLS_PATH, place)
    app.router.add_post(realtime.CALLS_PATH + "/{call_id}/hangup", routed_server_key)
    app.router.add_post("/v1/realtime/client_secrets", any_worker)
    app.router.add_get("/v1/realtime", realtime_socket)
    app.router.add_get("/v1/duplex", realtime_socket)
    if settings.telephony.enabled:
        app.router.add_get("/v1/telephony/ws", place_websocket)
        app.router.add_get("/v1/telephony/ws/{provider}", place_websocket)
        app.router.add_get("/v1/telephony/calls/{session_id}/events", routed_websocket)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/cluster/workers", list_workers)
    app.router.add_post("/v1/cluster/workers/{worker_id}/drain", drain_worker)
    app.router.add_get("/v1/cluster/workers/{worker_id}/metrics", worker_metrics)
    app.router.add_get("/", index)
    app.router.add_get("/latency", latency_page)
    if settings.web_root.is_dir():
        app.router.add_static("/static/", settings.web_root, show_index=False)

    async def on_startup(app: web.Application) -> None:
        await app[FLEET_KEY].start()

    async def on_cleanup(app: web.Application) -> None:
        await app[FLEET_KEY].stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app

