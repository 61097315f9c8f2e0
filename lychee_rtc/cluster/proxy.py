"""HTTP forwarding from the entry to a worker: the request as it came, the response as it went.

Status, headers (repeated ones such as WHIP's ``Link`` included) and body pass through unchanged;
only hop-by-hop headers are dropped and ``X-Forwarded-For`` is added. A worker that cannot be
connected to raises ``WorkerUnreachable`` before anything reached it, so an offer can safely go to
another worker; once the request was sent, a failure is the client's 502.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

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


async def forward(http: aiohttp.ClientSession, base_url: str, request: web.Request, body: bytes,
                  timeout: aiohttp.ClientTimeout, path_qs: str | None = None) -> web.Response:
    url = base_url + (path_qs if path_qs is not None else request.path_qs)
    try:
        async with http.request(request.method, url, headers=forward_headers(request), data=body or None,
                                timeout=timeout, allow_redirects=False) as upstream:
            data = await upstream.content.read(MAX_RESPONSE_BYTES + 1)
            if len(data) > MAX_RESPONSE_BYTES:
                raise WorkerFailed(f"response from {base_url} exceeds {MAX_RESPONSE_BYTES} bytes")
            headers: CIMultiDict[str] = CIMultiDict()
            for name, value in upstream.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    headers.add(name, value)
            return web.Response(status=upstream.status, headers=headers, body=data)
    except CONNECT_TIMEOUT as exc:
        raise WorkerUnreachable(f"cannot connect to {base_url}: {exc}") from None
    except aiohttp.ClientConnectorError as exc:
        raise WorkerUnreachable(f"cannot connect to {base_url}: {exc.os_error or exc}") from None
    except asyncio.TimeoutError:
        raise WorkerFailed(f"no answer from {base_url} within {timeout.total:g} s") from None
    except aiohttp.ClientError as exc:
        raise WorkerFailed(f"{base_url} failed: {type(exc).__name__}: {exc}") from None
