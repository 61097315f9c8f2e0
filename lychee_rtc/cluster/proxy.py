"""HTTP forwarding from the entry to a worker: the request as it came, the response as it went.

Status, headers (repeated ones such as WHIP's ``Link`` included) and body pass through unchanged;
only hop-by-hop headers are dropped and ``X-Forwarded-For`` is added. A worker that cannot be
connected to raises ``WorkerUnreachable`` before anything reached it, so an offer can safely go to
another worker; once the request was sent, a failure is the client's 502.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from lychee_rtc.server.http import error_response

HOP_BY_HOP = frozenset(h.lower() for h in (
    "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "TE", "Trailer", "Trailers",
    "Transfer-Encoding", "Upgrade", "Host", "Content-Length"))
# The connection was never made (aiohttp >= 3.10 tells this timeout apart from a slow answer).
CONNECT_TIMEOUT = getattr(aiohttp, "ConnectionTimeoutError", ())
MAX_RESPONSE_BYTES = 4 * 1024 * 1024  # answers and session snapshots are a few kB


class WorkerUnreachable(Exception):
    """No connection to the worker could be made: the request did not reach it."""


class WorkerFailed(Exception):
    """The worker took the request but gave no complete answer (it died, or took too long)."""


def forward_headers(request: web.Request) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in request.headers.items():
        if name.lower() not in HOP_BY_HOP:
            headers.add(name, value)
    peer = request.remote
    if peer:
        previous = request.headers.get("X-Forwarded-For")
        headers["X-Forwarded-For"] = f"{previous}, {peer}" if previous else peer
    return headers


@contextlib.contextmanager
def _worker_errors(base_url: str, timeout: aiohttp.ClientTimeout) -> Iterator[None]:
    """aiohttp's failures, told apart as the entry needs them: the request never reached the
    worker (``WorkerUnreachable``), or it did and no complete answer came (``WorkerFailed``)."""
    try:
        yield
    except CONNECT_TIMEOUT as exc:
        raise WorkerUnreachable(f"cannot connect to {base_url}: {exc}") from None
    except aiohttp.ClientConnectorError as exc:
        raise WorkerUnreachable(f"cannot connect to {base_url}: {exc.os_error or exc}") from None
    except asyncio.TimeoutError:
        raise WorkerFailed(f"no answer from {base_url} within {timeout.total or timeout.sock_read:g} s") from None
    except aiohttp.ClientError as exc:
        raise WorkerFailed(f"{base_url} failed: {type(exc).__name__}: {exc}") from None


def _passed_headers(upstream: aiohttp.ClientResponse) -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict()
    for name, value in upstream.headers.items():
        if name.lower() not in HOP_BY_HOP:
            headers.add(name, value)
    return headers


async def _whole(upstream: aiohttp.ClientResponse, base_url: str) -> web.Response:
    """The worker's answer read whole (bounded) and passed on."""
    data = await upstream.content.read(MAX_RESPONSE_BYTES + 1)
    if len(data) > MAX_RESPONSE_BYTES:
        raise WorkerFailed(f"response from {base_url} exceeds {MAX_RESPONSE_BYTES} bytes")
    return web.Response(status=upstream.status, headers=_passed_headers(upstream), body=data)


async def forward(http: aiohttp.ClientSession, base_url: str, request: web.Request, body: bytes,
                  timeout: aiohttp.ClientTimeout, path_qs: str | None = None) -> web.Response:
    url = base_url + (path_qs if path_qs is not None else request.path_qs)
    with _worker_errors(base_url, timeout):
        async with http.request(request.method, url, headers=forward_headers(request), data=body or None,
                                timeout=timeout, allow_redirects=False) as upstream:
            return await _whole(upstream, base_url)


DOWNLOAD_CHUNK_BYTES = 64 * 1024


async def forward_download(http: aiohttp.ClientSession, base_url: str, request: web.Request,
                           timeout: aiohttp.ClientTimeout) -> web.StreamResponse:
    """A file from the worker (a call recording), passed on chunk by chunk as it arrives: any
    length, in bounded memory; a range request's 206 too. Other answers come back whole, as
    ``forward`` gives them. If the worker fails mid-file, the response ends short of its length."""
    with _worker_errors(base_url, timeout):
        upstream = await http.request(request.method, base_url + request.path_qs, headers=forward_headers(request),
                                      timeout=timeout, allow_redirects=False)
    async with upstream:
        if upstream.status not in (200, 206):
            with _worker_errors(base_url, timeout):
                return await _whole(upstream, base_url)
        response = web.StreamResponse(status=upstream.status, headers=_passed_headers(upstream))
        if upstream.content_length is not None:  # the bytes pass on as they are (no decompression)
            response.content_length = upstream.content_length
        await response.prepare(request)
        async for chunk in upstream.content.iter_chunked(DOWNLOAD_CHUNK_BYTES):
            await response.write(chunk)
        await response.write_eof()
        return response


# WebSocket handshake headers: the entry makes its own handshake with the worker.
WS_HANDSHAKE = frozenset(h.lower() for h in (
    "Sec-WebSocket-Key", "Sec-WebSocket-Version", "Sec-WebSocket-Extensions", "Sec-WebSocket-Protocol"))
MAX_WS_MESSAGE_BYTES = 1024 * 1024


async def _pump(source, sink, on_first: Callable[[], None] | None = None) -> None:
    """Frames from ``source`` to ``sink`` until ``source`` closes; then ``sink`` closes with its code."""
    async for message in source:
        if on_first is not None and message.type in (aiohttp.WSMsgType.TEXT, aiohttp.WSMsgType.BINARY):
            on_first()
            on_first = None
        if message.type == aiohttp.WSMsgType.TEXT:
            await sink.send_str(message.data)
        elif message.type == aiohttp.WSMsgType.BINARY:
            await sink.send_bytes(message.data)
        elif message.type == aiohttp.WSMsgType.ERROR:
            break
    code = source.close_code if source.close_code is not None else aiohttp.WSCloseCode.GOING_AWAY
    await sink.close(code=code)


async def open_websocket(http: aiohttp.ClientSession, base_url: str, request: web.Request,
                         handshake_timeout_s: float, max_msg_size: int = MAX_WS_MESSAGE_BYTES
                         ) -> aiohttp.ClientWebSocketResponse | web.Response:
    """The worker's side of a WebSocket (or, when the worker refuses the handshake, its status)."""
    headers = CIMultiDict((k, v) for k, v in forward_headers(request).items() if k.lower() not in WS_HANDSHAKE)
    protocols = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
    url = base_url.replace("http", "ws", 1) + request.path_qs
    try:
        return await asyncio.wait_for(
            http.ws_connect(url, headers=headers, protocols=protocols, autoping=True,
                            max_msg_size=max_msg_size), handshake_timeout_s)
    except CONNECT_TIMEOUT as exc:
        raise WorkerUnreachable(f"cannot connect to {base_url}: {exc}") from None
    except aiohttp.ClientConnectorError as exc:
        raise WorkerUnreachable(f"cannot connect to {base_url}: {exc.os_error or exc}") from None
    except aiohttp.WSServerHandshakeError as exc:
        return refused_handshake(exc)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise WorkerFailed(f"{base_url} failed: {type(exc).__name__}: {exc}") from None


# What a refused handshake's status means; the worker's JSON body does not survive the client
# library's handshake, so the entry restates it in the same error shape.
_REFUSAL_CODES = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
                  409: "conflict", 503: "unavailable"}
_PASSED_HEADERS = ("WWW-Authenticate", "Retry-After")


def refused_handshake(exc: aiohttp.WSServerHandshakeError) -> web.Response:
    """The worker's refusal of a WebSocket handshake, as a JSON error with its status and headers."""
    status = exc.status if exc.status >= 400 else 502
    headers = {k: exc.headers[k] for k in _PASSED_HEADERS if exc.headers and k in exc.headers}
    code = _REFUSAL_CODES.get(status, "refused")
    message = f"the worker refused the WebSocket: {exc.status} {exc.message or ''}".rstrip()
    return error_response(status, code, message, headers=headers)


async def relay_websocket(request: web.Request, upstream: aiohttp.ClientWebSocketResponse,
                          on_first_reply: Callable[[], None] | None = None,
                          downstream: web.WebSocketResponse | None = None,
                          max_msg_size: int = MAX_WS_MESSAGE_BYTES) -> web.WebSocketResponse:
    """Frames both ways between the client and the worker until one side closes (its code passes on);
    ``on_first_reply`` is called when the worker's first frame arrives. ``downstream``: the client's
    socket when it was opened already (to read a first message that decides the worker)."""
    if downstream is None:
        downstream = web.WebSocketResponse(protocols=[upstream.protocol] if upstream.protocol else (),
                                           max_msg_size=max_msg_size, autoping=True)
    try:
        if not downstream.prepared:
            await downstream.prepare(request)
        pumps = {asyncio.ensure_future(_pump(downstream, upstream)),
                 asyncio.ensure_future(_pump(upstream, downstream, on_first_reply))}
        _, pending = await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        if pending:  # the other direction gets the close passed on, then ends
            _, pending = await asyncio.wait(pending, timeout=10.0)
        for task in pending:
            task.cancel()
    finally:
        await upstream.close()
    return downstream
