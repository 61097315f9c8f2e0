"""Every route of an app, declared once: its method and path, who may call it (``auth.Access``),
the body it takes and its bound, and, for a route about one session, how the session it names is
found. The HTTP edge reads the declaration before the handler runs: it refuses a caller that may
not call the route, and a body whose declared length is over its bound, so no handler reads,
parses or reserves anything for a caller it has not authenticated.

A route is added through its table (``RouteTable.add``), never straight to the router: an app
refuses to start with a route its table does not declare (``RouteTable.check``), so a new route
cannot go unguarded. ``docs/reliability.md`` holds the table as ``markdown()`` renders it, and the
tests walk it against a live server.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import web
from aiohttp.web_urldispatcher import AbstractRoute

from lychee_rtc.calls.tokens import Opener
from lychee_rtc.config import Settings
from lychee_rtc.server import http
from lychee_rtc.server.auth import Access, bearer, is_admin, keyless_is_local

TARGET_KEY = web.RequestKey("route_target", object)  # what a SESSION route's locator found (Target.value)
ADMITTED_KEY = web.RequestKey("route_admitted", object)  # what a route's own credential check admitted

ErrorFactory = Callable[..., web.Response]  # (status, code, message, headers=...) -> the route's error body


@dataclass(frozen=True)
class Body:
    """What a route reads: its content types and the most bytes it takes (413 beyond)."""

    types: tuple[str, ...]
    limit: int


@dataclass(frozen=True)
class Target:
    """The session a request names, as its route's locator found it."""

    opener: Opener
    value: Any = None  # handed to the handler (request[TARGET_KEY]): the call, the recording's meta


Locate = Callable[[web.Request], Awaitable["Target | web.Response"]]
# A credential other than the server key, checked before the body: what it admitted (kept in
# request[ADMITTED_KEY]), None for "not this credential", or the refusal to answer with.
Admit = Callable[[web.Request], Awaitable[Any]]

# What the docs say each access level accepts (docs/reliability.md explains each).
ACCESS_TEXT = {
    Access.OPEN: "anyone",
    Access.CREATE: "server key (anyone without one)",
    Access.ADMIN: "server key (without one: loopback-only servers)",
    Access.SESSION: "server key",
    Access.CARRIER: "the carrier's own credential",
}


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Any
    access: Access
    body: Body | None = None
    locate: Locate | None = None  # SESSION: the session the request names (or the 404 to answer)
    admit: Admit | None = None  # CREATE: another credential the route takes (and what it is, for the docs)
    admits: str = ""
    opened_by: str = ""  # SESSION: which secrets open it, for the docs
    secret_in_path: bool = False  # SESSION: the path holds the secret (a WHIP resource URL): found is opened
    # This declaration holds when the request has this query parameter (``GET /v1/realtime?call_id=``
    # is a call's sideband, the same path without it a new session); one without holds otherwise.
    query: str | None = None
    websocket: bool = False
    error: ErrorFactory = http.error_response  # the route's error body (OpenAI's carries param)
    forwarded: bool = False  # a cluster entry's route that the worker holding the session authorises

    @property
    def who(self) -> str:
        if self.access is Access.SESSION and self.opened_by:
            return f"{self.opened_by}; or the server key"
        text = ACCESS_TEXT[self.access]
        return f"{text}; or {self.admits}" if self.admits else text

    @property
    def shown_path(self) -> str:
        """The path as the OpenAPI file writes it (no pattern in a parameter)."""
        return re.sub(r"\{(\w+):[^}]*\}", r"{\1}", self.path)

    @property
    def shown(self) -> str:
        """The path as the docs' table writes it (a selecting query parameter included)."""
        return f"{self.shown_path}?{self.query}=…" if self.query else self.shown_path


class RouteTable:
    def __init__(self) -> None:
        self.routes: list[Route] = []
        self._by_route: dict[AbstractRoute, list[Route]] = {}
        self._static: dict[Any, Route] = {}

    def add(self, app: web.Application, route: Route) -> None:
        """Add ``route`` to ``app``'s router under its declaration; a second declaration of the same
        method and path (told apart by ``query``) shares the first one's handler."""
        same = [r for r in self.routes if (r.method, r.path) == (route.method, route.path)]
        if same:
            if route.handler is not same[0].handler:
                raise ValueError(f"{route.method} {route.path}: declarations of one path share one handler")
            for declared in self._by_route.values():
                if declared[0] is same[0]:
                    declared.append(route)
        elif route.method == "GET":  # HEAD comes with it, under the same declaration
            added = app.router.add_get(route.path, route.handler)
            for other in added.resource:
                if other.method in ("GET", "HEAD"):
                    self._by_route[other] = [route]
        else:
            self._by_route[app.router.add_route(route.method, route.path, route.handler)] = [route]
        self.routes.append(route)

    def add_static(self, app: web.Application, prefix: str, folder: Any) -> None:
        resource = app.router.add_static(prefix, folder, show_index=False)
        route = Route("GET", prefix.rstrip("/") + "/{file}", None, Access.OPEN)
        self._static[resource] = route
        self.routes.append(route)

    def find(self, request: web.Request) -> Route | None:
        matched = request.match_info.route
        declared = self._by_route.get(matched)
        if declared is None:
            return self._static.get(matched.resource) if matched is not None else None
        return next((r for r in declared if r.query is not None and r.query in request.query),
                    next((r for r in declared if r.query is None), None))

    def undeclared(self, app: web.Application) -> list[str]:
        """Routes of ``app`` this table does not declare (none, for an app that may start)."""
        return [f"{r.method} {r.resource.canonical if r.resource else '?'}" for r in app.router.routes()
                if r not in self._by_route and r.resource not in self._static]

    async def check(self, app: web.Application) -> None:
        """A start-up hook: an app with an undeclared route does not start."""
        missing = self.undeclared(app)
        if missing:
            raise RuntimeError(f"routes without a declaration in the route table: {', '.join(missing)}")

    def markdown(self) -> str:
        """The table as docs/reliability.md shows it."""
        lines = ["| method | path | access | who may call it | body |", "|---|---|---|---|---|"]
        for route in sorted(self.routes, key=lambda r: (r.shown, r.method)):
            if route.websocket:
                body = "WebSocket"
            elif route.body is not None:
                body = f"{', '.join(route.body.types)}, at most {route.body.limit} bytes"
            else:
                body = "none"
            lines.append(f"| {route.method} | `{route.shown}` | {route.access.value} | {route.who} | {body} |")
        return "\n".join(lines) + "\n"


ROUTES_KEY = web.AppKey("route_table", RouteTable)


def table_of(app: web.Application) -> RouteTable:
    table = app.get(ROUTES_KEY)
    if table is None:
        table = app[ROUTES_KEY] = RouteTable()
    return table


# --- the check the edge runs before every handler ------------------------------------------------------


def _unauthorized(route: Route, message: str) -> web.Response:
    return route.error(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


async def authorize(request: web.Request, settings: Settings) -> web.StreamResponse | None:
    """The refusal to answer instead of running the route's handler, or None to run it."""
    table = request.app.get(ROUTES_KEY)
    route = table.find(request) if table is not None else None
    if route is None:
        if request.match_info.http_exception is not None:
            return None  # no such path or method: the router's own 404/405
        return http.error_response(403, "undeclared_route", "this route has no access declaration")
    server_key = settings.server.auth_token
    refusal = await _check(request, route, server_key, settings)
    if refusal is not None:
        return refusal
    if route.body is not None and request.content_length is not None and request.content_length > route.body.limit:
        return route.error(413, "invalid_body",
                           f"request body of {request.content_length} bytes exceeds {route.body.limit}")
    return None


async def _check(request: web.Request, route: Route, server_key: str | None,
                 settings: Settings) -> web.StreamResponse | None:
    access = route.access
    if access in (Access.OPEN, Access.CARRIER) or route.forwarded:
        return None
    admin = is_admin(request, server_key)
    if access is Access.ADMIN:
        if admin or keyless_is_local(settings):
            return None
        if server_key is None:
            return route.error(403, "server_key_required", "set server.auth_token to use this endpoint: without a "
                               "server key it is only available when the server listens on loopback")
        return _unauthorized(route, "this endpoint needs the server key as bearer token")
    if access is Access.CREATE:
        if route.admit is not None and not admin:
            admitted = await route.admit(request)
            if isinstance(admitted, web.StreamResponse):
                return admitted
            if admitted is not None:
                request[ADMITTED_KEY] = admitted
                return None
        if admin or server_key is None:
            return None
        return _unauthorized(route, "missing or wrong bearer token")
    # SESSION: the session named in the path; its own secret or the server key, whatever the mode. A
    # caller with no credential at all is refused before anything is looked up.
    assert route.locate is not None, f"{route.method} {route.path}: a SESSION route needs a locator"
    presented = bearer(request)
    if presented is None and not route.secret_in_path:
        return _unauthorized(route, f"this needs {route.opened_by or 'its secret'} (or the server key) as bearer token")
    target = await route.locate(request)
    if isinstance(target, web.StreamResponse):
        return target
    if not (admin or route.secret_in_path or target.opener.opens(presented, time.time())):
        return _unauthorized(route, f"this needs {route.opened_by or 'its secret'} (or the server key) as bearer token")
    request[TARGET_KEY] = target.value
    return None


def edge(settings_of: Callable[[web.Request], Settings]):
    """The edge middleware of an app whose routes are in its table (``http.edge_middleware``)."""

    async def guard(request: web.Request) -> web.StreamResponse | None:
        return await authorize(request, settings_of(request))

    return http.edge_middleware(lambda request: settings_of(request).server.cors_origins, guard)
