"""The HTTP edge every route shares (server/http.py), on a bare aiohttp app: what any route gets from it."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from conftest import free_port
from lychee_rtc.server import http


async def serve(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


async def test_a_refused_body_is_answered_by_the_edge_with_the_shared_error_body():
    async def echo_text(request: web.Request) -> web.Response:
        return web.Response(text=await http.read_text(request, 16, "the note"))

    app = web.Application(middlewares=[http.edge_middleware(lambda request: ["https://page.example"])])
    app.router.add_post("/note", echo_text)
    runner, url = await serve(app)
    try:
        async with aiohttp.ClientSession() as client:
            async with client.post(f"{url}/note", data=b"x" * 100) as resp:
                assert resp.status == 413
                assert (await resp.json())["error"] == {
                    "type": "invalid_request_error", "code": "invalid_body",
                    "message": "the note of 100 bytes exceeds 16"}
            async with client.post(f"{url}/note", data=b"\xff\xfe",
                                   headers={"Origin": "https://page.example"}) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_body"
                assert resp.headers["Access-Control-Allow-Origin"] == "https://page.example"
            async with client.post(f"{url}/note", data=b"fine") as resp:
                assert resp.status == 200 and await resp.text() == "fine"
    finally:
        await runner.cleanup()
