"""Fuzz suite (short form): generated hostile HTTP bodies, SDP offers and data-channel messages
against a real server. Nothing may produce a 5xx, an internal error, a logged traceback or an
event a browser cannot parse, and the server must keep serving.

LYCHEE_FUZZ_SEED replays a run; LYCHEE_FUZZ_SCALE multiplies the case counts (docs/reliability.md).
Under CI the scale cannot go below 1: a shorter run than the suite's is not the suite.
"""

from __future__ import annotations

import json
import logging
import os

import aiohttp
import pytest
from aiortc import RTCPeerConnection
from aiortc.exceptions import InvalidStateError

from conftest import running_server
from fuzzcases import client_message, json_body, multipart_body, offer_body, sdp_offer
from strict import in_ci

from lychee_rtc.bench.client import MicrophoneTrack, RtcClient
from lychee_rtc.jsonio import strict_json_loads
from lychee_rtc.server.route_table import table_of
from lychee_rtc.session.protocol import validate_server_event

SEED = int(os.environ.get("LYCHEE_FUZZ_SEED", "9"))
SCALE = float(os.environ.get("LYCHEE_FUZZ_SCALE", "1"))
HTTP_CASES = int(400 * SCALE)
SDP_CASES = int(300 * SCALE)
DC_CASES = int(600 * SCALE)
ROUTE_CASES = int(40 * SCALE)  # per content type of every route that takes a body
MULTIPART_CASES = int(200 * SCALE)
DC_BURST = 50  # well under the per-session message rate limit, so every case is parsed

# Up to 1300 requests and 600 data-channel messages against one server.
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(autouse=True)
def full_scale_in_ci() -> None:
    if in_ci() and SCALE < 1:
        pytest.fail(f"LYCHEE_FUZZ_SCALE={SCALE} runs fewer cases than the suite promises", pytrace=False)


async def real_offer() -> str:
    pc = RTCPeerConnection()
    pc.addTransceiver(MicrophoneTrack(), direction="sendrecv")
    pc.createDataChannel("events")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


def try_send(client: RtcClient, text: str) -> bool:
    """False once the channel is closing (the session ended itself: a generated session.close)."""
    if client.channel.readyState != "open":
        return False
    try:
        client.channel.send(text)
    except InvalidStateError:
        return False
    return True


# The 503s a hostile request may get: the server is full, or the SIP gateway is not there to dial.
REFUSALS_503 = {"server_full", "gateway_unavailable"}


def assert_no_server_error(status: int, raw: bytes, case: str) -> None:
    """No 5xx but a refusal (503 ``server_full``, ``gateway_unavailable``); every error a JSON body."""
    if status >= 400:
        error = strict_json_loads(raw)["error"]
        assert error["code"] and error["message"], f"seed {SEED} {case}: {raw[:300]!r}"
    if status < 500:
        return
    assert status == 503, f"seed {SEED} {case}: {status} {raw[:300]!r}"
    assert strict_json_loads(raw)["error"]["code"] in REFUSALS_503, f"seed {SEED} {case}: {raw[:300]!r}"


def no_tracebacks(caplog) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]


async def test_fuzz_http_and_sdp(caplog):
    caplog.set_level(logging.WARNING)
    sdp = await real_offer()
    async with running_server(session={"max_sessions": 2}) as (url, app):
        statuses: dict[int, int] = {}
        async with aiohttp.ClientSession() as http:
            for i in range(HTTP_CASES):
                body = offer_body(SEED, i, sdp)
                async with http.post(f"{url}/v1/rtc/offer", data=body.encode("utf-8", "surrogatepass"),
                                     headers={"Content-Type": "application/json"}) as resp:
                    raw = await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                    assert_no_server_error(resp.status, raw, f"http case {i}")
                    data = strict_json_loads(raw)
                    if resp.status == 200:
                        token = {"Authorization": f"Bearer {data['session_token']}"}
                        async with http.delete(f"{url}/v1/sessions/{data['session_id']}", headers=token) as d:
                            assert d.status == 200
                    else:
                        assert data["error"]["code"] and data["error"]["message"], (SEED, i, data)
            for i in range(SDP_CASES):
                async with http.post(f"{url}/whip", data=sdp_offer(SEED, i, sdp).encode("utf-8", "surrogatepass"),
                                     headers={"Content-Type": "application/sdp"}) as resp:
                    raw = await resp.read()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                    assert_no_server_error(resp.status, raw, f"sdp case {i}")
                    if resp.status == 201:
                        async with http.delete(url + resp.headers["Location"]) as d:
                            assert d.status == 200
            async with http.get(f"{url}/readyz") as resp:
                assert resp.status == 200
        assert not no_tracebacks(caplog), no_tracebacks(caplog)[:5]
        assert len(statuses) > 2, statuses  # the generator reaches past the first check


async def test_fuzz_data_channel(caplog):
    caplog.set_level(logging.WARNING)
    async with running_server() as (url, app):
        raw_events: list[str] = []
        client = None
        sessions = 0
        try:
            i = 0
            while i < DC_CASES:
                if client is None or client.channel.readyState != "open":
                    if client is not None:  # a generated session.close ended it: it must have said so
                        await client.wait_event("session.closed", timeout=20)
                        await client.close()
                    client = RtcClient(url)
                    await client.connect()
                    client.pc.sctp._remote_max_message_size = 0  # send oversize messages too, as a hostile peer
                    client.channel.on("message", raw_events.append)
                    await client.wait_event("session.created")
                    sessions += 1
                for _ in range(min(DC_BURST, DC_CASES - i)):
                    if not try_send(client, client_message(SEED, i)):
                        break
                    i += 1
                # A ping after the burst: once it is answered, every case before it was handled. (A ping
                # can meet an empty rate-limit bucket; it is then asked again.)
                for attempt in range(30):
                    marker = float(i) + attempt / 100
                    if not try_send(client, json.dumps({"type": "ping", "client_time": marker})):
                        break
                    try:
                        await client.wait_event("pong", timeout=2, client_time=marker)
                        break
                    except TimeoutError:
                        continue
                else:
                    raise AssertionError(f"seed {SEED}: the session stopped answering after case {i}")
            for text in raw_events:
                event = strict_json_loads(text)
                validate_server_event(event)
                if event["type"] == "error":
                    assert event["error"]["code"] != "internal_error", (SEED, event)
            assert raw_events and sessions >= 1
        finally:
            if client is not None:
                await client.close()
        assert not no_tracebacks(caplog), no_tracebacks(caplog)[:5]


KEY = "fuzz-server-key"
# The SIP gateway's routes, without Janus: what they do with a body is decided before dialling.
GATEWAY = {"janus": {"enabled": True, "url": "ws://127.0.0.1:9", "reconnect_max_s": 60}}


def bodies_for(kind: str, i: int, sdp: str) -> tuple[bytes, str]:
    if kind == "multipart/form-data":
        return multipart_body(SEED, i, sdp)
    if kind in ("application/sdp", "application/trickle-ice-sdpfrag"):
        return sdp_offer(SEED, i, sdp).encode("utf-8", "surrogatepass"), kind
    return json_body(SEED, i).encode("utf-8", "surrogatepass"), kind


@pytest.mark.filterwarnings("ignore::aiohttp.multipart.BadContentDispositionHeader")  # what the cases send
async def test_fuzz_every_route_that_takes_a_body(caplog, tmp_path):
    """Every route of the route table that reads a body gets generated hostile bodies of each type it
    takes (multipart offers included), with the credential that lets them through to the handler:
    nothing may answer 5xx (but a refusal), or anything but a JSON error body, or log a traceback."""
    caplog.set_level(logging.WARNING)
    sdp = await real_offer()
    overrides = dict(server={"auth_token": KEY}, gateway=GATEWAY, session={"max_sessions": 6},
                     recording={"directory": str(tmp_path)})
    async with running_server(**overrides) as (url, app):
        client = RtcClient(url, auth_token=KEY)
        await client.connect()
        auth = {"Authorization": f"Bearer {KEY}"}
        statuses: dict[str, dict[int, int]] = {}
        try:
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/v1/realtime/calls", data=sdp,
                                     headers={**auth, "Content-Type": "application/sdp"}) as resp:
                    assert resp.status == 201
                    call_id = resp.headers["Location"].rsplit("/", 1)[1]
                async with http.post(f"{url}/whip", data=sdp, headers={**auth, "Content-Type": "application/sdp"}) as resp:
                    assert resp.status == 201
                    whip = resp.headers["Location"]
                routes = [r for r in table_of(app).routes if r.body is not None]
                assert len(routes) >= 10  # every kind of body is here
                for route in routes:
                    path = (route.shown_path.replace("{session_id}", client.session_id)
                            .replace("{call_id}", call_id).replace("{call}", client.session_id)
                            .replace("/whip/{resource_id}", whip))
                    kinds = route.body.types
                    cases = MULTIPART_CASES if "multipart/form-data" in kinds else ROUTE_CASES * len(kinds)
                    seen = statuses.setdefault(f"{route.method} {route.shown_path}", {})
                    for i in range(cases):
                        data, content_type = bodies_for(kinds[i % len(kinds)], i, sdp)
                        async with http.request(route.method, url + path, data=data,
                                                headers={**auth, "Content-Type": content_type}) as resp:
                            raw = await resp.read()
                            seen[resp.status] = seen.get(resp.status, 0) + 1
                            assert_no_server_error(resp.status, raw, f"{route.method} {path} case {i}")
                            if resp.status in (200, 201) and route.shown_path in ("/v1/rtc/offer", "/whip",
                                                                                  "/v1/realtime/calls"):
                                await end_what_was_made(http, url, resp, raw, auth)
                async with http.get(f"{url}/readyz") as resp:
                    assert resp.status == 200
        finally:
            await client.close()
        assert not no_tracebacks(caplog), no_tracebacks(caplog)[:5]
        multipart = statuses["POST /v1/realtime/calls"]
        assert len(multipart) > 2, multipart  # the generator reaches past the first check


async def end_what_was_made(http: aiohttp.ClientSession, url: str, resp, raw: bytes, auth: dict[str, str]) -> None:
    """A fuzzed offer that was good enough to answer: its session ends, so the slots stay free."""
    if "Location" in resp.headers and resp.headers["Location"].startswith("/whip/"):
        session = url + resp.headers["Location"]
    elif "Location" in resp.headers:
        session = f"{url}/v1/sessions/{resp.headers['Location'].rsplit('/', 1)[1]}"
    else:
        session = f"{url}/v1/sessions/{strict_json_loads(raw)['session_id']}"
    async with http.delete(session, headers=auth) as d:
        assert d.status == 200
