"""Which worker a request goes to, and what the entry answers when none can take it.

Shared by the entry's HTTP routes (``entry.py``) and its WebSocket routes (``sockets.py``): a
follow-up names its session, whose id names its worker (``ids.py``); a refusal looks as a single
server's would (the OpenAI surface's ``call_not_found``, our ``session_not_found``), and a worker
that cannot be reached or fails mid-answer is a 503 or a 502.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from lychee_rtc.cluster.fleet import Fleet, NoPlacement
from lychee_rtc.cluster.ids import worker_of
from lychee_rtc.cluster.proxy import WorkerFailed, WorkerUnreachable
from lychee_rtc.cluster.registry import WorkerView
from lychee_rtc.config import Settings
from lychee_rtc.server import auth, http
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


def admin_refusal(request: web.Request) -> web.Response | None:
    """The server key, where one is configured (what a single server's middleware asks of its routes)."""
    if not auth.has_server_key(request, request.app[SETTINGS_KEY].server.auth_token):
        return http.unauthorized()
    return None


def server_key_refusal(request: web.Request) -> web.Response | None:
    """A route a single server opens with the server key only (hangup, sideband): refused here as
    there, before the entry says anything about the call."""
    if (denied := admin_refusal(request)) is not None:
        return denied
    return realtime.needs_server_key(request.app[SETTINGS_KEY])


def no_placement(fleet: Fleet, refusal: NoPlacement) -> web.Response:
    if refusal.status == 503:
        return unavailable(fleet, refusal.code, refusal.message)
    return http.error_response(refusal.status, refusal.code, refusal.message)


def target_of(request: web.Request) -> tuple[str, str]:
    """The id a follow-up names and what the client calls it (a realtime call or a session)."""
    if "call_id" in request.match_info:
        return request.match_info["call_id"], "call"
    if "session_id" in request.match_info:
        return request.match_info["session_id"], "session"
    return request.query.get("call_id", ""), "call"


def not_found(session_id: str, what: str, detail: str = "") -> web.Response:
    message = f"no {what} {session_id!r}{detail}"
    if what == "call":  # the OpenAI surface's own error, as a single server gives it
        return realtime.error(404, "call_not_found", message, param="call_id")
    return http.error_response(404, "session_not_found", message)


def worker_holding(request: web.Request, session_id: str) -> WorkerView | str:
    """The worker that holds ``session_id``, or why there is none to ask (a detail for a 404)."""
    view = request.app[FLEET_KEY].registry.workers.get(worker_of(session_id) or "")
    if view is None:
        return " (through the cluster entry, name a call by its session id)" \
            if request.path.startswith("/v1/telephony/") else ""
    if view.state in ("dead", "stopped") or view.url is None:
        return f": its worker {view.worker_id} is {view.state}"
    return view


def holder(request: web.Request, target: tuple[str, str] | None = None) -> WorkerView | web.Response:
    """The worker that holds the session a follow-up names, or the 404 a single server would give."""
    session_id, what = target or target_of(request)
    view = worker_holding(request, session_id)
    return not_found(session_id, what, view) if isinstance(view, str) else view


async def from_holder(fleet: Fleet, view: WorkerView, session_id: str,
                      send: Callable[[], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """``send()`` to the worker holding the session: one that cannot be reached is marked down and
    answered 503; one that took the request and gave no complete answer, 502."""
    try:
        return await send()
    except WorkerUnreachable as exc:
        fleet.registry.mark_down(view, str(exc))
        return unavailable(fleet, "worker_unavailable",
                           f"worker {view.worker_id} of session {session_id!r} cannot be reached; retry later")
    except WorkerFailed as exc:
        return http.error_response(502, "worker_failed", f"worker {view.worker_id}: {exc}")
