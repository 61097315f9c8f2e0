"""The HTTP edge every route shares (server/http.py), on a bare aiohttp app: what any route gets from it."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from conftest import serving
from lychee_rtc.server import http


async def test_a_refused_body_is_answered_by_the_edge_with_the_shared_error_body():
    async def echo_text(request: web.Request) -> web.Response:
        return web.Response(text=await http.read_text(request, 16, "the note"))

    app = web.Application(middlewares=[http.edge_middleware(lambda request: ["https://page.example"])])
    app.router.add_post("/note", echo_text)
    async with serving(app) as url:
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


async def test_every_answer_varies_by_origin_and_every_error_is_json():
    """What CORS allows depends on the request's Origin, so a cache must key on it: ``Vary: Origin`` on
    answers, preflights and refusals alike, allowed origin or not. aiohttp's own refusals (an unknown
    path, a wrong method) and a handler's unexpected fault come back as the shared JSON error body."""
    async def fine(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(middlewares=[http.edge_middleware(lambda request: ["https://page.example"])])
    app.router.add_get("/fine", fine)
    async with serving(app) as url:
        async with aiohttp.ClientSession() as client:
            for origin in ("https://page.example", "https://elsewhere.example", None):
                headers = {"Origin": origin} if origin else {}
                for method, path, status in (("GET", "/fine", 200), ("GET", "/nowhere", 404), ("POST", "/fine", 405),
                                             ("OPTIONS", "/fine", 204)):
                    async with client.request(method, url + path, headers=headers) as resp:
                        assert resp.status == status
                        assert "Origin" in resp.headers.getall("Vary", []), (method, path, origin)
                        if status >= 400:
                            assert (await resp.json())["error"]["code"]
                        allowed = resp.headers.get("Access-Control-Allow-Origin")
                        assert allowed == (origin if origin == "https://page.example" else None)


@pytest.mark.allowed_logs(r"GET /broken: internal error")
async def test_an_unexpected_fault_is_a_logged_json_500():
    async def broken(request: web.Request) -> web.Response:
        raise RuntimeError("a fault of the server's own")

    app = web.Application(middlewares=[http.edge_middleware(lambda request: [])])
    app.router.add_get("/broken", broken)
    async with serving(app) as url:
        async with aiohttp.ClientSession() as client:
            async with client.get(f"{url}/broken") as resp:
                assert resp.status == 500
                assert (await resp.json())["error"] == {"type": "server_error", "code": "internal_error",
                                                        "message": "the server failed to handle this request"}


async def test_a_file_answer_refuses_with_the_json_error_body(tmp_path):
    """aiohttp answers a range past the end (416) and a failed precondition (412) with an empty body;
    ``http.file_response`` decides those first, as JSON errors like every other."""
    path = tmp_path / "recording.ogg"
    path.write_bytes(bytes(range(100)))

    async def serve_file(request: web.Request) -> web.StreamResponse:
        return await http.file_response(request, path, {"Content-Type": "audio/ogg"})

    app = web.Application(middlewares=[http.edge_middleware(lambda request: [])])
    app.router.add_get("/file", serve_file)
    async with serving(app) as url:
        async with aiohttp.ClientSession() as client:
            async with client.get(f"{url}/file", headers={"Range": "bytes=10-19"}) as resp:
                assert resp.status == 206 and await resp.read() == bytes(range(10, 20))
            for headers, status, code in (({"Range": "bytes=500-"}, 416, "range_not_satisfiable"),
                                          ({"Range": "bytes=zz"}, 416, "range_not_satisfiable"),
                                          ({"If-Match": '"not-its-tag"'}, 412, "precondition_failed")):
                async with client.get(f"{url}/file", headers=headers) as resp:
                    assert resp.status == status and (await resp.json())["error"]["code"] == code
                    if status == 416:
                        assert resp.headers["Content-Range"] == "bytes */100"
            async with client.get(f"{url}/file") as resp:
                assert resp.status == 200 and len(await resp.read()) == 100
