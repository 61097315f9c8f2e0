"""The HTTP edge every route shares: error bodies, strict JSON, bounded body reading, CORS.

The single server, its OpenAI-compatible routes, the carrier endpoints, the cluster entry and the
entry's relay to workers all answer through these helpers, so an error looks the same wherever it
comes from (``{"error": {"type", "code", "message"}}``), nothing non-finite is ever sent, and a body
is never read past its limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, Mapping

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from lychee_rtc.calls.call import ServerFull
from lychee_rtc.jsonio import JsonError, strict_json_dumps, strict_json_loads
from lychee_rtc.rtc.sdp import SdpError
from lychee_rtc.server.lifecycle import ShuttingDown, lifecycle_of

log = logging.getLogger(__name__)

WHIP_PATCH_TYPE = "application/trickle-ice-sdpfrag"
# X-Session-Token: a realtime call's own secret, on its 201 (a page reads it to end its call).
CORS_EXPOSE = "Location, ETag, Link, Accept-Patch, Accept-Post, Retry-After, X-Session-Token"
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
    retry_after_s: int | None = None

    def __str__(self) -> str:
        return self.message

    def response(self, **extra: Any) -> web.Response:
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else None
        return error_response(self.status, self.code, self.message, headers=headers, **extra)


class ClientGone(Exception):
    """The client closed the connection before its request body was complete."""


async def read_limited(read_chunk: Callable[[], Awaitable[bytes]], limit: int, what: str) -> bytes:
    """All of a stream up to ``limit`` bytes (413 beyond), however it was split on the wire.

    Call it inside ``reading`` (``read_body`` does): that bounds the time the client may take."""
    data = bytearray()
    try:
        while chunk := await read_chunk():
            data += chunk
            if len(data) > limit:
                raise BodyError(413, "invalid_body", f"{what} exceeds {limit} bytes")
    except ConnectionResetError:
        raise ClientGone(what) from None
    return bytes(data)


@contextlib.asynccontextmanager
async def reading(request: web.Request, what: str = "request body") -> AsyncIterator[None]:
    """Every wait on a request's body happens inside this: a client that takes longer than
    ``server.body_timeout_s`` gets 408, and shutdown ends the wait at once (503)."""
    lifecycle = lifecycle_of(request)
    try:
        async with lifecycle.reading():
            yield
    except ShuttingDown:
        raise BodyError(503, "server_shutting_down", f"the server is shutting down; {what} was not read",
                        retry_after_s=1) from None
    except TimeoutError:
        raise BodyError(408, "request_timeout",
                        f"{what} did not arrive within {lifecycle.body_timeout_s:g} s") from None


async def read_body(request: web.Request, limit: int, what: str = "request body") -> bytes:
    if request.content_length is not None and request.content_length > limit:
        raise BodyError(413, "invalid_body", f"{what} of {request.content_length} bytes exceeds {limit}")
    async with reading(request, what):
        return await read_limited(lambda: request.content.read(READ_CHUNK_BYTES), limit, what)


def as_text(data: bytes, what: str = "request body") -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise BodyError(400, "invalid_body", f"{what} is not UTF-8 text") from None


async def read_text(request: web.Request, limit: int, what: str = "request body") -> str:
    return as_text(await read_body(request, limit, what), what)


async def read_multipart(request: web.Request, limits: Mapping[str, int], max_parts: int) -> dict[str, bytes]:
    """A ``multipart/form-data`` body as {part name: bytes}: only the named parts, each within its
    limit, at most ``max_parts``. Anything aiohttp's reader cannot take (no boundary, a broken part
    header, a nested multipart, a body cut short) is a 400 ``invalid_multipart``, never a 500."""
    parts: dict[str, bytes] = {}
    async with reading(request, "the multipart body"):
        try:
            reader = await request.multipart()
            for _ in range(max_parts + 1):
                part = await reader.next()
                if part is None:
                    return parts
                if len(parts) == max_parts:
                    raise BodyError(400, "invalid_body", f"more than {max_parts} parts")
                if not isinstance(part, BodyPartReader):
                    raise BodyError(400, "invalid_multipart", "a part is itself multipart")
                name = part.name
                if name not in limits:
                    raise BodyError(400, "invalid_body", f"unknown part {name!r}: expected {', '.join(map(repr, limits))}")
                if name in parts:
                    raise BodyError(400, "invalid_body", f"part {name!r} is given twice")
                parts[name] = await read_limited(part.read_chunk, limits[name], f"part {name!r}")
        except (ValueError, AssertionError, HttpProcessingError, LookupError) as exc:
            # aiohttp's multipart reader says "malformed" with these (and str/bytes mix-ups as ValueError).
            raise BodyError(400, "invalid_multipart", f"malformed multipart body: {exc}"[:300]) from None
    return parts


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


# --- middleware ------------------------------------------------------------------------------------


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
    """CORS headers, unless the response already carries them (an answer relayed from a worker).

    ``Vary: Origin`` on every answer: which origins are allowed, and so what a cache may reuse for
    another page, depends on the request's Origin."""
    if "Origin" not in response.headers.get("Vary", ""):
        response.headers.add("Vary", "Origin")
    if allow is None or "Access-Control-Allow-Origin" in response.headers:
        return
    response.headers["Access-Control-Allow-Origin"] = allow
    response.headers["Access-Control-Expose-Headers"] = CORS_EXPOSE
    if request.method == "OPTIONS":
        response.headers["Access-Control-Allow-Methods"] = CORS_METHODS
        response.headers["Access-Control-Allow-Headers"] = CORS_HEADERS
        response.headers["Access-Control-Max-Age"] = "600"


Guard = Callable[[web.Request], Awaitable["web.StreamResponse | None"]]


def edge_middleware(origins_of: Callable[[web.Request], Iterable[str]], guard: Guard | None = None):
    """Preflights, CORS, refused bodies, clients that hang up mid-body, and every error as the shared
    JSON body: aiohttp's plain-text ones and a handler's unexpected exception (a logged 500).

    ``guard`` runs before the handler (authentication, the route's declared bounds); a response
    from it is the answer.
    """

    @web.middleware
    async def edge(request: web.Request, handler: Handler) -> web.StreamResponse:
        allow = allowed_origin(origins_of(request), request.headers.get("Origin"))
        if request.method == "OPTIONS":
            response: web.StreamResponse = preflight(request)
        else:
            response = await _handle(request, handler, guard)
        if response.prepared:  # a WebSocket: its handshake is long gone
            return response
        add_cors_headers(request, response, allow)
        return response

    return edge


async def _handle(request: web.Request, handler: Handler, guard: Guard | None) -> web.StreamResponse:
    try:
        refused = await guard(request) if guard is not None else None
        return refused if refused is not None else await handler(request)
    except BodyError as exc:  # a route that needs more in its error body (OpenAI's param) catches it first
        return exc.response()
    except ClientGone as exc:
        # Nobody is left to read an answer: one line, no traceback, 499 in the access log.
        log.info("%s %s: the client closed the connection while sending %s", request.method, request.path, exc)
        return web.Response(status=CLIENT_CLOSED_REQUEST)
    except ShuttingDown:
        return error_response(503, "server_shutting_down", "the server is shutting down", headers={"Retry-After": "1"})
    except web.HTTPException as exc:
        if exc.status < 400 or exc.content_type == "application/json":
            raise
        response = error_response(exc.status, exc.reason.lower().replace(" ", "_"), exc.reason)
        if "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        # A fault of ours, not the client's: the traceback is logged (and fails any test that sees
        # it), the client gets the same JSON error body as every other answer.
        log.exception("%s %s: internal error", request.method, request.path)
        return error_response(500, "internal_error", "the server failed to handle this request")


# --- files ---------------------------------------------------------------------------------------------


def _file_refusal(request: web.Request, st: os.stat_result) -> web.Response | None:
    """What aiohttp's FileResponse would answer with an empty body (a failed precondition, a range
    past the end), decided first so that it is a JSON error like every other."""
    etag = f"{st.st_mtime_ns:x}-{st.st_size:x}"
    if (if_match := request.if_match) is not None and not any(
            tag.value == etag and not tag.is_weak or tag.value == "*" for tag in if_match):
        return error_response(412, "precondition_failed", "If-Match does not match the file's entity tag")
    if request.if_match is None and (since := request.if_unmodified_since) is not None \
            and st.st_mtime > since.timestamp():
        return error_response(412, "precondition_failed", "the file changed after If-Unmodified-Since")
    if (if_range := request.if_range) is not None and st.st_mtime > if_range.timestamp():
        return None  # the range is ignored: the whole file, 200
    unsatisfiable = {"Content-Range": f"bytes */{st.st_size}"}
    try:
        start = request.http_range.start
    except ValueError:
        return error_response(416, "range_not_satisfiable", "malformed Range header", headers=unsatisfiable)
    if start is not None and start >= 0 and start >= st.st_size:
        return error_response(416, "range_not_satisfiable", f"the file has {st.st_size} bytes",
                              headers=unsatisfiable)
    return None


async def file_response(request: web.Request, path: Path, headers: Mapping[str, str] | None = None) -> web.StreamResponse:
    """``path`` as aiohttp serves files (ranges, conditional requests), with every refusal a JSON error."""
    try:
        st = await asyncio.to_thread(path.stat)
    except OSError:
        return error_response(404, "not_found", "no such file")
    refused = _file_refusal(request, st)
    if refused is not None:
        return refused
    return web.FileResponse(path, headers=headers)
