"""The HTTP edge every route shares: error bodies, strict JSON, bounded body reading, CORS.

The single server, its OpenAI-compatible routes, the carrier endpoints, the cluster entry and the
entry's relay to workers all answer through these helpers, so an error looks the same wherever it
comes from (``{"error": {"type", "code", "message"}}``), nothing non-finite is ever sent, and a body
is never read past its limit.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Iterable, Mapping

from aiohttp import web

from lychee_rtc.calls.call import ServerFull
from lychee_rtc.jsonio import JsonError, strict_json_dumps, strict_json_loads
from lychee_rtc.rtc.sdp import SdpError

log = logging.getLogger(__name__)

WHIP_PATCH_TYPE = "application/trickle-ice-sdpfrag"
CORS_EXPOSE = "Location, ETag, Link, Accept-Patch, Accept-Post, Retry-After"
CORS_METHODS = "GET, POST, PATCH, DELETE, OPTIONS"
# X-OpenAI-Agents-SDK: the OpenAI browser SDK names itself on every call offer.
CORS_HEADERS = "Authorization, Content-Type, If-Match, X-OpenAI-Agents-SDK"
# nginx's "client closed request": what the access log shows for a body the client never finished.
CLIENT_CLOSED_REQUEST = 499
READ_CHUNK_BYTES = 8192

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_response(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    # Strict: a browser's JSON.parse rejects NaN and Infinity, so they are never sent.
    return web.json_response(data, status=status, headers=headers, dumps=strict_json_dumps)


def error_response(status: int, code: str, message: str, error_type: str | None = None,
                   headers: Mapping[str, str] | None = None, **extra: Any) -> web.Response:
    """The error body of every route; ``extra`` adds fields a dialect needs (OpenAI's ``param``)."""
    if error_type is None:
        error_type = "server_error" if status >= 500 else "invalid_request_error"
    return json_response({"error": {"type": error_type, "code": code, "message": message, **extra}},
                         status=status, headers=headers)


def unauthorized(message: str = "missing or wrong bearer token") -> web.Response:
    return error_response(401, "unauthorized", message, headers={"WWW-Authenticate": "Bearer"})


def unavailable(code: str, message: str, retry_after_s: int) -> web.Response:
    """503 with ``Retry-After``: full, draining, or no worker ready."""
    return error_response(503, code, message, "server_error", {"Retry-After": str(retry_after_s)})


def server_full(exc: ServerFull, **extra: Any) -> web.Response:
    return error_response(503, "server_full", "all sessions are in use; retry later", "server_error",
                          {"Retry-After": str(exc.retry_after_s)}, **extra)


def sdp_refused(exc: SdpError, **extra: Any) -> web.Response:
    """400 for an SDP that is not one, 422 for a valid one this server cannot answer."""
    if exc.unprocessable:
        return error_response(422, "unprocessable_sdp", str(exc), **extra)
    return error_response(400, "invalid_sdp", str(exc), **extra)


# --- request bodies --------------------------------------------------------------------------------


@dataclass
class BodyError(Exception):
    """A request body refused before anything acted on it."""

    status: int
    code: str
    message: str

    def __str__(self) -> str:
        return self.message

    def response(self, **extra: Any) -> web.Response:
        return error_response(self.status, self.code, self.message, **extra)


class ClientGone(Exception):
    """The client closed the connection before its request body was complete."""


async def read_limited(read_chunk: Callable[[], Awaitable[bytes]], limit: int, what: str) -> bytes:
    """All of a stream up to ``limit`` bytes (413 beyond), however it was split on the wire."""
    data = bytearray()
    try:
        while chunk := await read_chunk():
            data += chunk
            if len(data) > limit:
                raise BodyError(413, "invalid_body", f"{what} exceeds {limit} bytes")
    except ConnectionResetError:
        raise ClientGone(what) from None
    return bytes(data)


async def read_body(request: web.Request, limit: int, what: str = "request body") -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise BodyError(413, "invalid_body", f"{what} of {request.content_length} bytes exceeds {limit}")
    return await read_limited(lambda: request.content.read(READ_CHUNK_BYTES), limit, what)


def as_text(data: bytes, what: str = "request body") -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BodyError(400, "invalid_body", f"{what} is not UTF-8 text") from None


async def read_text(request: web.Request, limit: int, what: str = "request body") -> str:
    return as_text(await read_body(request, limit, what), what)


# --- middleware ------------------------------------------------------------------------------------


async def read_json_object(request: web.Request, limit: int, what: str = "request body",
                           empty: dict[str, Any] | None = None) -> dict[str, Any]:
    """The body as a JSON object; ``empty``, if given, stands for a body with no text at all."""
    text = await read_text(request, limit, what)
    if empty is not None and not text.strip():
        return dict(empty)
    try:
        body = strict_json_loads(text)
    except JsonError as exc:
        raise BodyError(400, "invalid_json", f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BodyError(400, "invalid_request", "request body must be a JSON object")
    return body


def allowed_origin(origins: Iterable[str], origin: str | None) -> str | None:
    origins = list(origins)
    return "*" if "*" in origins else (origin if origin in origins else None)


def preflight(request: web.Request) -> web.Response:
    response = web.Response(status=204)
    if request.path.startswith("/whip"):
        response.headers["Accept-Post"] = "application/sdp"
        response.headers["Accept-Patch"] = WHIP_PATCH_TYPE
    return response


def add_cors_headers(request: web.Request, response: web.StreamResponse, allow: str | None) -> None:
    """CORS headers, unless the response already carries them (an answer relayed from a worker)."""
    if allow is None or "Access-Control-Allow-Origin" in response.headers:
        return
    response.headers["Access-Control-Allow-Origin"] = allow
    response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSE
    if request.method == "OPTIONS":
        response.headers["Access-Control-Allow-Methods"] = CORS_METHODS
        response.headers["Access-Control-Allow-Headers"] = CORS_HEADERS
        response.headers["Access-Control-Max-Age"] = "600"
    if allow != "*":
        response.headers["Vary"] = "Origin"


def edge_middleware(origins_of: Callable[[web.Request], Iterable[str]],
                    guard: Callable[[web.Request], web.StreamResponse | None] | None = None):
    """Preflights, CORS, refused bodies and aiohttp's plain-text errors as JSON bodies, and clients that
    hang up mid-body.

    ``guard`` runs before the handler (authentication); a response from it is the answer.
    """

    @web.middleware
    async def edge(request: web.Request, handler: Handler) -> web.StreamResponse:
        allow = allowed_origin(origins_of(request), request.headers.get("Origin"))
        if request.method == "OPTIONS":
            response: web.StreamResponse = preflight(request)
        else:
            refused = guard(request) if guard is not None else None
            response = refused if refused is not None else await _handle(request, handler)
        if response.prepared:  # a WebSocket: its handshake is long gone
            return response
        add_cors_headers(request, response, allow)
        return response

    return edge


async def _handle(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except BodyError as exc:  # a route that needs more in its error body (OpenAI's param) catches it first
        return exc.response()
    except ClientGone as exc:
        # Nobody is left to read an answer: one line, no traceback, 499 in the access log.
        log.info("%s %s: the client closed the connection while sending %s", request.method, request.path, exc)
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        response = error_response(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
