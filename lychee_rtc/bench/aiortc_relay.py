"""A plain aiortc relay: the baseline a latency comparison needs.

What a server written directly on aiortc does with a call: the received audio track is sent straight
back (aiortc's stock jitter buffer, decoder, resampler and encoder; none of lychee-rtc's media
path). It answers the same JSON offer (``POST /v1/rtc/offer``) and serves the same tester page, so
``lychee-rtc bench browser --peer aiortc`` measures it exactly as it measures lychee-rtc.

Run by itself: ``python -m lychee_rtc.bench.aiortc_relay --port 8090``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription
from aiortc.contrib.media import MediaRelay

from lychee_rtc.bench.server_process import free_port, spawned_http_process
from lychee_rtc.resources import shared_path

MAX_CALLS = 8
PCS_KEY = web.AppKey("pcs", set)
MAX_CALLS_KEY = web.AppKey("max_calls", int)


async def offer(request: web.Request) -> web.Response:
    try:
        body = await request.json()
        sdp = body["sdp"]
        if not isinstance(sdp, str) or body.get("type") != "offer":
            raise ValueError
    except (ValueError, KeyError, TypeError):
        return web.json_response({"error": {"code": "invalid_request", "message": "expected {type: offer, sdp}"}},
                                 status=400)
    pcs: set[RTCPeerConnection] = request.app[PCS_KEY]
    if len(pcs) >= request.app[MAX_CALLS_KEY]:
        return web.json_response({"error": {"code": "server_full", "message": "relay is full"}}, status=503)
    pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
    pcs.add(pc)
    relay = MediaRelay()

    @pc.on("track")
    def on_track(track) -> None:
        if track.kind == "audio":
            pc.addTrack(relay.subscribe(track))

    @pc.on("connectionstatechange")
    async def on_state() -> None:
        if pc.connectionState in ("failed", "closed"):
            pcs.discard(pc)
            await pc.close()

    try:
        await pc.setRemoteDescription(RTCSessionDescription(sdp, "offer"))
        await pc.setLocalDescription(await pc.createAnswer())
    except ValueError as exc:  # aiortc's word for an SDP it cannot use
        pcs.discard(pc)
        await pc.close()
        return web.json_response({"error": {"code": "invalid_sdp", "message": str(exc)}}, status=400)
    return web.json_response({"type": "answer", "sdp": pc.localDescription.sdp, "session_id": f"relay_{id(pc):x}",
                              "session_token": ""})


async def page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(shared_path("web") / "latency.html")


async def readyz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ready"})


def create_app(max_calls: int = MAX_CALLS) -> web.Application:
    app = web.Application()
    app[PCS_KEY] = set()
    app[MAX_CALLS_KEY] = max_calls
    app.router.add_post("/v1/rtc/offer", offer)
    app.router.add_get("/latency", page)
    app.router.add_get("/readyz", readyz)
    app.router.add_static("/static/", shared_path("web"))

    async def close_all(app: web.Application) -> None:
        await asyncio.gather(*(pc.close() for pc in app[PCS_KEY]))

    app.on_shutdown.append(close_all)
    return app


@asynccontextmanager
async def spawned_relay(max_calls: int = MAX_CALLS) -> AsyncIterator[tuple[str, int]]:
    """The relay in a child process on a free port; yields (base_url, pid) once it answers."""
    port = free_port()
    argv = [sys.executable, "-m", "lychee_rtc.bench.aiortc_relay", "--port", str(port), "--max-calls", str(max_calls)]
    async with spawned_http_process(argv, port, "aiortc relay") as running:
        yield running


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--max-calls", type=int, default=MAX_CALLS)
    args = parser.parse_args()
    web.run_app(create_app(args.max_calls), host=args.host, port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
