"""Authorisation: the server key for creation and admin views, a secret per session for its resource."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from contract import check_response
from conftest import running_server
from lychee_rtc.bench.client import RtcClient
from lychee_rtc.calls.tokens import secret_matches

KEY = {"Authorization": "Bearer server-key-1"}


async def call(method: str, url: str, headers: dict[str, str] | None = None, **kw) -> tuple[int, bytes, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, headers=headers or {}, **kw) as resp:
            return resp.status, await resp.read(), resp.headers


def sample(metrics: bytes, name: str) -> float:
    for line in metrics.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def bearer(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def test_a_session_token_opens_its_own_session_only_and_the_server_key_opens_all():
    async with running_server(server={"auth_token": "server-key-1"}) as (url, _):
        a, b = RtcClient(url, auth_token="server-key-1"), RtcClient(url, auth_token="server-key-1")
        await a.connect()
        await b.connect()
        try:
            assert a.session_token and a.session_token != b.session_token
            assert a.session_token not in (a.session_id or "")
            status, body, headers = await call("GET", f"{url}/v1/sessions/{a.session_id}", bearer(a.session_token))
            assert status == 200
            check_response("/v1/sessions/{session_id}", "GET", status, headers, body)
            # A's token does not open B, nor the admin list, nor session creation.
            for method, path in [("GET", f"/v1/sessions/{b.session_id}"), ("DELETE", f"/v1/sessions/{b.session_id}"),
                                 ("GET", "/v1/sessions")]:
                status, body, headers = await call(method, url + path, bearer(a.session_token))
                assert status == 401, (method, path, body)
                check_response(path.replace(b.session_id, "{session_id}"), method, status, headers, body)
            status, _, _ = await call("POST", f"{url}/v1/rtc/offer", bearer(a.session_token),
                                      json={"sdp": "v=0", "type": "offer"})
            assert status == 401
            # The server key is the admin: it lists and opens every session.
            status, body, _ = await call("GET", f"{url}/v1/sessions", KEY)
            assert status == 200 and a.session_id.encode() in body
            status, _, _ = await call("GET", f"{url}/v1/sessions/{b.session_id}", KEY)
            assert status == 200
            status, _, _ = await call("DELETE", f"{url}/v1/sessions/{a.session_id}", bearer(a.session_token))
            assert status == 200
            closed = await a.wait_event("session.closed", timeout=20)
            assert closed["reason"] == "deleted"
            status, _, _ = await call("GET", f"{url}/v1/sessions/{a.session_id}", bearer(a.session_token))
            assert status == 404
            assert not b.events_of("session.closed")
        finally:
            await a.close()
            await b.close()


async def test_without_a_server_key_a_session_still_needs_its_token(echo_server):
    url, _ = echo_server
    client = RtcClient(url)
    await client.connect()
    try:
        for headers in ({}, bearer("stok_guess"), bearer("")):
            status, body, _ = await call("DELETE", f"{url}/v1/sessions/{client.session_id}", headers)
            assert status == 401, body
        status, _, _ = await call("GET", f"{url}/v1/sessions/{client.session_id}", client.auth_headers)
        assert status == 200
    finally:
        await client.close()


async def test_metrics_name_no_session(echo_server):
    url, _ = echo_server
    client = RtcClient(url)
    await client.connect()
    try:
        await client.wait_event("session.created")
        for _ in range(600):  # until the watchdog has sampled the session's playout depth
            _, body, _ = await call("GET", f"{url}/metrics")
            if sample(body, "lychee_rtc_playout_buffer_depth_seconds_count") > 0:
                break
            await asyncio.sleep(0.05)
        assert sample(body, "lychee_rtc_playout_buffer_depth_seconds_count") > 0
        assert client.session_id.encode() not in body and b"sess_" not in body
    finally:
        await client.close()


async def test_malformed_request_lines_do_not_flood_the_log(echo_server, caplog):
    url, _ = echo_server
    port = int(url.rsplit(":", 1)[1])
    caplog.set_level(logging.INFO, logger="aiohttp.server")
    lines = [b"GET /\x00 HTTP/1.1\r\n\r\n", b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", b"\x16\x03\x01\x02\x00\r\n\r\n"]
    for line in lines * 5:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(line)
        await writer.drain()
        assert (await reader.read(12)).startswith(b"HTTP/1.")
        writer.close()
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert all(r.exc_info is None and r.levelno <= logging.WARNING for r in records)
    assert len(records) <= 1  # one summary line a minute at most
    assert (await call("GET", f"{url}/healthz"))[0] == 200


def test_secret_comparison():
    assert secret_matches("stok_abc", "stok_abc")
    assert not secret_matches("stok_abd", "stok_abc")
    assert not secret_matches("", "")
    assert not secret_matches(None, "stok_abc")
    assert not secret_matches("stok_abc", None)
    assert not secret_matches("ß", "ss")
