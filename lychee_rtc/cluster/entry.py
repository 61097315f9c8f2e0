"""The cluster entry: the public signaling address in front of the workers.

* ``POST /v1/rtc/offer``, ``POST /whip`` and ``POST /v1/realtime/calls`` go to the least-loaded
  worker with a free slot; its answer comes back unchanged (status, headers, body). A worker that
  turns out full or unreachable is skipped for the next one; when none has room the entry answers
  503 with ``Retry-After``.
* Follow-ups (``/whip/{id}``, ``/v1/sessions/{id}``, ``/v1/realtime/calls/{id}/hangup``, the
  sideband WebSocket ``/v1/realtime?call_id=``) go to the worker named in the session id (a call id
  is a session id).
* ``POST /v1/realtime/client_secrets`` goes to any ready worker: keys are signed with the server key
  that every worker shares, so any worker accepts a key that another minted.
* ``/readyz``, ``/metrics`` and ``/v1/sessions`` describe the whole cluster; each worker keeps its
  own, on its own port (``/v1/cluster/workers/{id}/metrics`` reaches a worker's through the entry).
* ``POST /v1/cluster/workers/{id}/drain`` is the rolling restart: the worker takes no new calls,
  ends after its calls or a deadline, and Ray starts a new process in its place.

The entry holds no session state: any number of entries can front the same workers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from lychee_rtc import __version__
from lychee_rtc.cluster import placement
from lychee_rtc.cluster.ids import worker_id, worker_of
from lychee_rtc.cluster.metrics import EntryMetrics
from lychee_rtc.cluster.proxy import WorkerFailed, WorkerUnreachable, forward, open_websocket, relay_websocket
from lychee_rtc.cluster.registry import Registry, WorkerView
from lychee_rtc.config import Settings
from lychee_rtc.server import auth
from lychee_rtc.server.app import SETTINGS_KEY, index
from lychee_rtc.server.http import CORS_EXPOSE, CORS_HEADERS, CORS_METHODS, WHIP_PATCH_TYPE
from lychee_rtc.server.openai import routes as realtime

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256  # open connections from the entry to all workers together
GROWTH_CHECK_S = 2.0  # how often workers: auto looks for nodes that joined


class Entry:
    """What the entry's handlers share: settings, the worker registry, the HTTP client to workers."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = EntryMetrics()
        cluster = settings.cluster
        self.registry = Registry(self.metrics, cluster.poll_interval_s, cluster.status_timeout_s)
        self.registry.restarting = placement.is_restarting
        self.registry.on_drained = self._retire
        self.registry.http_alive = self._http_alive
        self.http: aiohttp.ClientSession | None = None
        self.started_ray = False
        self._tasks: list[asyncio.Task] = []

    def timeout(self, total: float | None = None) -> aiohttp.ClientTimeout:
        cluster = self.settings.cluster
        return aiohttp.ClientTimeout(total=total or cluster.forward_timeout_s, sock_connect=cluster.connect_timeout_s)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.started_ray = await loop.run_in_executor(None, placement.connect, self.settings.cluster)
        self.http = aiohttp.ClientSession(auto_decompress=False,
                                          connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS))
        await self.place_workers()
        self._tasks = [asyncio.create_task(self.registry.run(), name="cluster-monitor")]
        if self.settings.cluster.workers == "auto":
            self._tasks.append(asyncio.create_task(self._follow_cluster(), name="cluster-growth"))

    async def place_workers(self) -> None:
        """Place the workers the cluster has room for and that are not placed yet."""
        loop = asyncio.get_running_loop()
        cluster = self.settings.cluster
        resources = await loop.run_in_executor(None, placement.cluster_resources)
        count = placement.worker_count(cluster, resources)
        if count == 0 and not self.registry.workers:
            log.warning("cluster entry: no room for a worker yet (%s); waiting for nodes",
                        placement.no_room_reason(cluster, resources))
        new = [worker_id(i) for i in range(count) if worker_id(i) not in self.registry.workers]
        if not new:
            return
        waiting = [w.worker_id for w in self.registry.workers.values() if w.state in ("starting", "down")]
        if waiting:
            # Room that appears while a worker is being placed or restarted is that worker's: a node
            # that rejoins before Ray has declared its old self dead is counted twice for a while.
            log.debug("cluster entry: room for %d more, kept for %s", len(new), ", ".join(waiting))
            return
        handles = await loop.run_in_executor(None, placement.spawn, self.settings, new)
        for worker, handle in handles.items():
            self.registry.add(worker, handle)
        log.info("cluster entry: placed workers %s (%d in all)", ", ".join(new), len(self.registry.workers))

    async def _follow_cluster(self) -> None:
        """With workers: auto, nodes that join later get their workers too."""
        while True:
            await asyncio.sleep(GROWTH_CHECK_S)
            try:
                await self.place_workers()
            except Exception:  # Ray briefly unreachable: the next check tries again
                log.warning("cluster entry: cannot read the cluster's resources", exc_info=True)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.http is not None:
            await self.http.close()
        if self.started_ray:  # a Ray of our own ends with us, and its workers with it
            await asyncio.get_running_loop().run_in_executor(None, placement.shutdown)

    async def _http_alive(self, url: str) -> str | None:
        try:
            async with self.http.get(url + "/healthz", timeout=self.timeout(self.settings.cluster.status_timeout_s)) as r:
                await r.read()
                return None if r.status == 200 else f"/healthz answered {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            return f"/healthz: {type(exc).__name__}: {exc}"

    async def drain(self, view: WorkerView, deadline_s: float, restart: bool) -> None:
        view.restart_after_drain = restart
        status = await asyncio.wait_for(_await_ref(view.handle.drain.remote(deadline_s)),
                                        self.settings.cluster.status_timeout_s * 5)
        view.status, view.state, view.reason, view.since = status, "draining", "drain requested", time.monotonic()

    async def _retire(self, view: WorkerView) -> None:
        """A drained worker: Ray replaces its process (rolling restart) or it stops for good."""
        restart = view.restart_after_drain and self.settings.cluster.max_restarts != 0
        view.retired_boot = view.status["boot"] if view.status else None
        await asyncio.get_running_loop().run_in_executor(None, placement.kill, view.handle, restart)
        view.state = "starting" if restart else "stopped"
        view.reason = "restarting after drain" if restart else "drained"
        view.since = time.monotonic()
        log.info("worker %s drained: %s", view.worker_id, view.reason)


ENTRY_KEY = web.AppKey("entry", Entry)


def _error(status: int, code: str, message: str, error_type: str = "invalid_request_error",
           headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"type": error_type, "code": code, "message": message}},
                             status=status, headers=headers)


def _unavailable(entry: Entry, code: str, message: str) -> web.Response:
    retry = str(entry.settings.session.retry_after_s)
    return _error(503, code, message, "server_error", {"Retry-After": retry})


# --- middleware ------------------------------------------------------------------------------------


@web.middleware
async def cors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """Preflights are answered here; forwarded answers keep the worker's CORS headers."""
    origins = request.app[SETTINGS_KEY].server.cors_origins
    origin = request.headers.get("Origin")
    allow = "*" if "*" in origins else (origin if origin in origins else None)
    if request.method == "OPTIONS":
        response: web.StreamResponse = web.Response(status=204)
        if request.path.startswith("/whip"):
            response.headers["Accept-Post"] = "application/sdp"
            response.headers["Accept-Patch"] = WHIP_PATCH_TYPE
        if allow is not None:
            response.headers["Access-Control-Allow-Methods"] = CORS_METHODS
            response.headers["Access-Control-Allow-Headers"] = CORS_HEADERS
            response.headers["Access-Control-Max-Age"] = "600"
    else:
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400 or exc.content_type == "application/json":
                raise
            response = _error(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason)
    if response.prepared:  # a relayed WebSocket: its handshake is long gone
        return response
    if allow is not None and "Access-Control-Allow-Origin" not in response.headers:
        response.headers["Access-Control-Allow-Origin"] = allow
        response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSE
        if allow != "*":
            response.headers["Vary"] = "Origin"
    return response


def _admin(request: web.Request) -> web.Response | None:
    """The server key, where one is configured (what a single server's middleware asks of its routes)."""
    if not auth.has_server_key(request, request.app[SETTINGS_KEY].server.auth_token):
        return _error(401, "unauthorized", "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"})
    return None


def _server_key_only(request: web.Request) -> web.Response | None:
    """A route a single server opens with the server key only (hangup, sideband): refused here as
    there, before the entry says anything about the call."""
    if (denied := _admin(request)) is not None:
        return denied
    return realtime.needs_server_key(request.app[SETTINGS_KEY])


# --- new sessions ----------------------------------------------------------------------------------


def _is_full(response: web.Response) -> bool:
    if response.status != 503:
        return False
    try:
        return json.loads(response.body)["error"]["code"] == "server_full"
    except (ValueError, KeyError, TypeError):
        return False


async def _on_a_worker(entry: "Entry", attempt: Callable[[WorkerView], Awaitable[Any]],
                       full: Callable[[Any], bool]) -> tuple[WorkerView | None, Any]:
    """Run ``attempt`` on the least-loaded worker with room, then the next, until one answers.

    A worker that cannot be reached is marked down, and one whose answer is ``full`` is marked full;
    either way the next is tried. Returns the worker and its answer, or (None, an error response)
    when the worker failed or no worker was left to try.
    """
    registry, metrics = entry.registry, entry.metrics
    tried: set[str] = set()
    while (view := registry.choose(tried)) is not None:
        tried.add(view.worker_id)
        view.pending += 1
        try:
            answer = await attempt(view)
        except WorkerUnreachable as exc:
            registry.mark_down(view, str(exc))
            metrics.offers.labels("unreachable").inc()
            continue
        except WorkerFailed as exc:
            metrics.offers.labels("failed").inc()
            return None, _error(502, "worker_failed", f"worker {view.worker_id}: {exc}", "server_error")
        finally:
            view.pending -= 1
        if full(answer):
            registry.mark_full(view)
            metrics.offers.labels("worker_full").inc()
            continue
        return view, answer
    metrics.offers.labels("cluster_full").inc()
    if registry.count("ready") == 0:
        return None, _unavailable(entry, "no_worker_ready", "no worker is ready to take a call; retry later")
    return None, _unavailable(entry, "server_full", "all sessions are in use; retry later")


async def place(request: web.Request) -> web.Response:
    """An offer: to the least-loaded worker with room; the next one if it turns out full or gone."""
    entry = request.app[ENTRY_KEY]
    body = await request.read()
    if (resumed := _resumed_session(request, body)) is not None:
        # A resume re-attaches a session where it lives (its engine slot, its context): not placed.
        return await _forward_to_holder(request, body, (resumed, "session"))

    async def offer(view: WorkerView) -> web.Response:
        started = time.monotonic()
        response = await forward(entry.http, view.url, request, body, entry.timeout())
        entry.metrics.forward_seconds.labels("offer").observe(time.monotonic() - started)
        return response

    view, response = await _on_a_worker(entry, offer, _is_full)
    if view is not None:
        if response.status < 300:
            view.placed += 1
            entry.metrics.offers.labels("placed").inc()
        else:
            entry.metrics.offers.labels("refused").inc()
    return response


async def any_worker(request: web.Request) -> web.Response:
    """A request that takes no slot and needs no session (minting a client key): to a ready worker."""
    entry = request.app[ENTRY_KEY]
    body = await request.read()
    tried: set[str] = set()
    while (view := entry.registry.choose_any(tried)) is not None:
        tried.add(view.worker_id)
        try:
            return await forward(entry.http, view.url, request, body, entry.timeout())
        except WorkerUnreachable as exc:
            entry.registry.mark_down(view, str(exc))
        except WorkerFailed as exc:
            return _error(502, "worker_failed", f"worker {view.worker_id}: {exc}", "server_error")
    return _unavailable(entry, "no_worker_ready", "no worker is ready; retry later")


async def place_websocket(request: web.Request) -> web.StreamResponse:
    """A carrier's media stream starts a call: to the least-loaded worker, relayed both ways.

    Unlike WebRTC media, a carrier's audio is in the WebSocket itself, so it passes through the entry.
    """
    entry = request.app[ENTRY_KEY]

    async def connect(view: WorkerView) -> aiohttp.ClientWebSocketResponse | web.Response:
        return await open_websocket(entry.http, view.url, request, entry.settings.cluster.forward_timeout_s)

    # A worker refuses a handshake in a restated form (the body does not survive the client
    # library), so a refusal is passed on rather than read as "full".
    view, upstream = await _on_a_worker(entry, connect, lambda _: False)
    if isinstance(upstream, web.Response):
        if view is not None:
            entry.metrics.offers.labels("refused").inc()
        return upstream
    view.placed += 1
    entry.metrics.offers.labels("placed").inc()
    return await relay_websocket(request, upstream)


# --- follow-ups ------------------------------------------------------------------------------------


def _target(request: web.Request) -> tuple[str, str]:
    """The id a follow-up names and what the client calls it (a realtime call or a session)."""
    if "call_id" in request.match_info:
        return request.match_info["call_id"], "call"
    if "session_id" in request.match_info:
        return request.match_info["session_id"], "session"
    return request.query.get("call_id", ""), "call"


def _not_found(session_id: str, what: str, detail: str = "") -> web.Response:
    message = f"no {what} {session_id!r}{detail}"
    if what == "call":  # the OpenAI surface's own error, as a single server gives it
        return realtime.error(404, "call_not_found", message, param="call_id")
    return _error(404, "session_not_found", message)


def _holder(request: web.Request, target: tuple[str, str] | None = None) -> WorkerView | web.Response:
    """The worker that holds the session a follow-up names, or the 404 a single server would give."""
    session_id, what = target or _target(request)
    view = request.app[ENTRY_KEY].registry.workers.get(worker_of(session_id) or "")
    if view is None:
        hint = " (through the cluster entry, name a call by its session id)" \
            if request.path.startswith("/v1/telephony/") else ""
        return _not_found(session_id, what, hint)
    if view.state in ("dead", "stopped") or view.url is None:
        return _not_found(session_id, what, f": its worker {view.worker_id} is {view.state}")
    return view


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
    return await _forward_to_holder(request, await request.read(), _target(request))


async def _forward_to_holder(request: web.Request, body: bytes, target: tuple[str, str]) -> web.Response:
    entry = request.app[ENTRY_KEY]
    session_id = target[0]
    view = _holder(request, target)
    if isinstance(view, web.Response):
        return view
    started = time.monotonic()
    try:
        response = await forward(entry.http, view.url, request, body, entry.timeout())
    except WorkerUnreachable as exc:
        entry.registry.mark_down(view, str(exc))
        return _unavailable(entry, "worker_unavailable",
                            f"worker {view.worker_id} of session {session_id!r} cannot be reached; retry later")
    except WorkerFailed as exc:
        return _error(502, "worker_failed", f"worker {view.worker_id}: {exc}", "server_error")
    entry.metrics.forward_seconds.labels("follow_up").observe(time.monotonic() - started)
    return response


async def routed_server_key(request: web.Request) -> web.Response:
    """A hang-up: the server key is checked first, as a single server does, then it is routed."""
    if (denied := _admin(request)) is not None:
        return denied
    return await routed(request)


async def sideband(request: web.Request) -> web.StreamResponse:
    """The sideband WebSocket of a realtime call: relayed to the worker named in ``call_id``."""
    if (denied := _server_key_only(request)) is not None:
        return denied
    if not request.query.get("call_id"):
        return realtime.error(400, "missing_call_id", "the query parameter call_id is required", param="call_id")
    return await routed_websocket(request)


async def routed_websocket(request: web.Request) -> web.StreamResponse:
    """A WebSocket about one session (a phone call's event stream, a realtime call's sideband): to
    the worker in the session id."""
    entry = request.app[ENTRY_KEY]
    view = _holder(request)
    if isinstance(view, web.Response):
        return view
    try:
        upstream = await open_websocket(entry.http, view.url, request, entry.settings.cluster.forward_timeout_s)
    except WorkerUnreachable as exc:
        entry.registry.mark_down(view, str(exc))
        return _unavailable(entry, "worker_unavailable", f"worker {view.worker_id} cannot be reached; retry later")
    except WorkerFailed as exc:
        return _error(502, "worker_failed", f"worker {view.worker_id}: {exc}", "server_error")
    if isinstance(upstream, web.Response):
        if upstream.status == 404:  # the session ended: say so as a single server does
            return _not_found(*_target(request))
        return upstream
    return await relay_websocket(request, upstream)


async def list_sessions(request: web.Request) -> web.Response:
    """Every worker's sessions in one list (workers that cannot be reached are left out)."""
    entry = request.app[ENTRY_KEY]
    views = [v for v in entry.registry.workers.values() if v.state in ("ready", "draining") and v.url]
    results = await asyncio.gather(*(forward(entry.http, v.url, request, b"", entry.timeout())
                                     for v in views), return_exceptions=True)
    sessions: list[dict[str, Any]] = []
    for result in results:
        if isinstance(result, web.Response):
            if result.status != 200:
                return result  # the workers' answer to a missing or wrong key
            sessions.extend(json.loads(result.body)["sessions"])
    return web.json_response({"capacity": entry.registry.capacity, "free": entry.registry.free,
                              "sessions": sessions})


# --- health and operations -------------------------------------------------------------------------


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "version": __version__})


async def readyz(request: web.Request) -> web.Response:
    entry = request.app[ENTRY_KEY]
    registry = entry.registry
    engines = sorted({v.status["engine"] for v in registry.workers.values() if v.status})
    body = {"engine": ",".join(engines) or entry.settings.engine.name, "capacity": registry.capacity,
            "free": registry.free, "active": registry.active,
            "workers": {state: n for state in ("ready", "starting", "draining", "down", "dead", "stopped")
                        if (n := registry.count(state))}}
    if registry.count("ready") == 0:
        return web.json_response({"status": "starting", **body}, status=503)
    if registry.free <= 0:
        return web.json_response({"status": "full", **body}, status=503,
                                 headers={"Retry-After": str(entry.settings.session.retry_after_s)})
    return web.json_response({"status": "ready", **body})


async def metrics(request: web.Request) -> web.Response:
    m = request.app[ENTRY_KEY].metrics
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


async def list_workers(request: web.Request) -> web.Response:
    if (denied := _admin(request)) is not None:
        return denied
    entry = request.app[ENTRY_KEY]
    return web.json_response({"workers": [v.describe() for v in entry.registry.workers.values()]})


def _worker_or_404(request: web.Request) -> WorkerView | web.Response:
    worker = request.match_info["worker_id"]
    view = request.app[ENTRY_KEY].registry.workers.get(worker)
    if view is None:
        return _error(404, "worker_not_found", f"no worker {worker!r}")
    return view


async def drain_worker(request: web.Request) -> web.Response:
    if (denied := _admin(request)) is not None:
        return denied
    view = _worker_or_404(request)
    if isinstance(view, web.Response):
        return view
    entry = request.app[ENTRY_KEY]
    raw = await request.read()
    try:
        options = json.loads(raw) if raw.strip() else {}
    except ValueError as exc:
        return _error(400, "invalid_json", f"request body is not valid JSON: {exc}")
    if not isinstance(options, dict) or set(options) - {"deadline_s", "restart"}:
        return _error(400, "invalid_request", "body: an object with deadline_s (seconds) and restart (boolean)")
    deadline = options.get("deadline_s", entry.settings.cluster.drain_timeout_s)
    restart = options.get("restart", True)
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) or not deadline > 0:
        return _error(400, "invalid_request", "deadline_s must be a number of seconds above 0")
    if not isinstance(restart, bool):
        return _error(400, "invalid_request", "restart must be true or false")
    if view.state not in ("ready", "draining"):
        return _error(409, "worker_not_ready", f"worker {view.worker_id} is {view.state}")
    try:
        await entry.drain(view, float(deadline), restart)
    except Exception as exc:  # the worker died under the request: the poller will say so
        return _unavailable(entry, "worker_unavailable", f"worker {view.worker_id}: {type(exc).__name__}: {exc}")
    return web.json_response(view.describe(), status=202)


async def worker_metrics(request: web.Request) -> web.Response:
    view = _worker_or_404(request)
    if isinstance(view, web.Response):
        return view
    entry = request.app[ENTRY_KEY]
    if view.url is None or view.state in ("dead", "stopped"):
        return _unavailable(entry, "worker_unavailable", f"worker {view.worker_id} is {view.state}")
    try:
        return await forward(entry.http, view.url, request, b"", entry.timeout(), path_qs="/metrics")
    except (WorkerUnreachable, WorkerFailed) as exc:
        return _unavailable(entry, "worker_unavailable", str(exc))


# --- application -----------------------------------------------------------------------------------


def create_entry_app(settings: Settings) -> web.Application:
    # A realtime call's multipart body holds a session part besides the SDP; the worker bounds each.
    app = web.Application(middlewares=[cors], client_max_size=settings.server.max_sdp_bytes
                          + realtime.MAX_SESSION_PART_BYTES + 4096)
    entry = Entry(settings)
    app[SETTINGS_KEY] = settings
    app[ENTRY_KEY] = entry

    app.router.add_post("/v1/rtc/offer", place)
    app.router.add_post("/whip", place)
    app.router.add_patch("/whip/{session_id}", routed)
    app.router.add_delete("/whip/{session_id}", routed)
    app.router.add_get("/v1/sessions", list_sessions)
    app.router.add_get("/v1/sessions/{session_id}", routed)
    app.router.add_delete("/v1/sessions/{session_id}", routed)
    app.router.add_post(realtime.CALLS_PATH, place)
    app.router.add_post(realtime.CALLS_PATH + "/{call_id}/hangup", routed_server_key)
    app.router.add_post("/v1/realtime/client_secrets", any_worker)
    app.router.add_get("/v1/realtime", sideband)
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
    if settings.web_root.is_dir():
        app.router.add_static("/static/", settings.web_root, show_index=False)

    async def on_startup(app: web.Application) -> None:
        await app[ENTRY_KEY].start()

    async def on_cleanup(app: web.Application) -> None:
        await app[ENTRY_KEY].stop()

    app.on_startup.append(on_startup)
    app.on_cleanup.append(on_cleanup)
    return app


async def _await_ref(ref: Any) -> Any:
    return await ref
