"""HTTP signaling against the real server: JSON offer/answer, WHIP, health, capacity, bad input."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
import yaml
from aiortc import RTCPeerConnection, RTCSessionDescription
from openapi_spec_validator import validate as validate_openapi

from contract import SPEC_PATH, check_response
from conftest import running_server
from lychee_rtc.bench.client import MicrophoneTrack, RtcClient
from lychee_rtc.server.app import ENGINE_KEY


async def make_offer(direction: str = "sendrecv", kind: str = "audio") -> tuple[RTCPeerConnection, str]:
    pc = RTCPeerConnection()
    if kind == "audio":
        pc.addTransceiver(MicrophoneTrack(), direction=direction)
    else:
        pc.addTransceiver("video", direction=direction)
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


async def request(method: str, url: str, path: str, **kw):
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url + path, **kw) as resp:
            body = await resp.read()
            return resp.status, resp.headers, body


def test_openapi_document_is_valid():
    validate_openapi(yaml.safe_load(SPEC_PATH.read_text()))


async def test_health_ready_and_metrics(echo_server):
    url, _ = echo_server
    status, headers, body = await request("GET", url, "/healthz")
    assert status == 200
    check_response("/healthz", "GET", status, headers, body)
    status, headers, body = await request("GET", url, "/readyz")
    assert status == 200
    check_response("/readyz", "GET", status, headers, body)
    status, headers, body = await request("GET", url, "/metrics")
    assert status == 200 and b"lychee_rtc_active_sessions" in body
    assert b"process_resident_memory_bytes" in body and b"process_open_fds" in body
    status, headers, body = await request("GET", url, "/v1/sessions")
    assert status == 200
    check_response("/v1/sessions", "GET", status, headers, body)


@pytest.mark.parametrize(
    "payload, status, code",
    [
        ("{not json", 400, "invalid_json"),
        ("[1, 2]", 400, "invalid_request"),
        ('{"type": "offer"}', 400, "invalid_request"),
        ('{"sdp": "v=0", "type": "answer"}', 400, "invalid_request"),
        ('{"sdp": "garbage", "type": "offer"}', 400, "invalid_sdp"),
        ('{"sdp": "v=0\\r\\no=- 1 1 IN IP4 0.0.0.0\\r\\ns=-\\r\\nt=0 0\\r\\n", "type": "offer"}', 400, "invalid_sdp"),
        ('{"sdp": "x", "type": "offer", "extra": 1}', 400, "invalid_request"),
        ('{"sdp": "x", "type": "offer", "session": {"temperature": "hot"}}', 400, "invalid_session"),
        ('{"sdp": "x", "type": "offer", "session": {"voice": "alloy"}}', 400, "invalid_session"),
        ('{"sdp": "v=0\\r\\no=- 1 1 IN IP4 0.0.0.0\\r\\ns=-\\r\\nt=0 0\\r\\nm=audio \u00b2 RTP 0\\r\\n", '
         '"type": "offer"}', 400, "invalid_sdp"),
    ],
)
async def test_malformed_offers_get_precise_errors(echo_server, payload, status, code):
    url, app = echo_server
    got, headers, body = await request("POST", url, "/v1/rtc/offer", data=payload,
                                       headers={"Content-Type": "application/json"})
    assert got == status, body
    check_response("/v1/rtc/offer", "POST", got, headers, body)
    import json

    assert json.loads(body)["error"]["code"] == code
    # The server still serves afterwards.
    assert (await request("GET", url, "/readyz"))[0] == 200


async def test_offer_without_audio_is_unprocessable(echo_server):
    url, _ = echo_server
    pc, sdp = await make_offer(kind="video")
    try:
        status, headers, body = await request("POST", url, "/v1/rtc/offer", json={"sdp": sdp, "type": "offer"})
        assert status == 422
        check_response("/v1/rtc/offer", "POST", status, headers, body)
        assert b"audio" in body
    finally:
        await pc.close()


async def test_json_offer_answer_and_session_listing(echo_server):
    url, _ = echo_server
    pc, sdp = await make_offer()
    try:
        status, headers, body = await request("POST", url, "/v1/rtc/offer",
                                              json={"sdp": sdp, "type": "offer", "session": {"metrics": True}})
        assert status == 200
        check_response("/v1/rtc/offer", "POST", status, headers, body)
        import json

        answer = json.loads(body)
        assert "a=rtpmap:" in answer["sdp"] and "opus/48000" in answer["sdp"]
        # Only the configured codecs are offered back.
        assert "G722" not in answer["sdp"]
        token = {"Authorization": f"Bearer {answer['session_token']}"}
        status, headers, body = await request("GET", url, f"/v1/sessions/{answer['session_id']}", headers=token)
        assert status == 200
        check_response("/v1/sessions/{session_id}", "GET", status, headers, body)
        assert json.loads(body)["epoch"] == 0
        status, headers, body = await request("DELETE", url, f"/v1/sessions/{answer['session_id']}", headers=token)
        assert status == 200
        status, headers, body = await request("GET", url, f"/v1/sessions/{answer['session_id']}", headers=token)
        assert status == 404
        check_response("/v1/sessions/{session_id}", "GET", status, headers, body)
    finally:
        await pc.close()


async def test_capacity_refusal_with_retry_after():
    async with running_server(session={"max_sessions": 1, "retry_after_s": 7}) as (url, app):
        first = RtcClient(url)
        await first.connect()
        try:
            pc, sdp = await make_offer()
            status, headers, body = await request("POST", url, "/v1/rtc/offer", json={"sdp": sdp, "type": "offer"})
            await pc.close()
            assert status == 503 and headers["Retry-After"] == "7"
            check_response("/v1/rtc/offer", "POST", status, headers, body)
            status, headers, body = await request("GET", url, "/readyz")
            assert status == 503 and b"full" in body
            check_response("/readyz", "GET", status, headers, body)
            pc, sdp = await make_offer("sendonly")
            status, headers, body = await request("POST", url, "/whip", data=sdp,
                                                  headers={"Content-Type": "application/sdp"})
            await pc.close()
            assert status == 503
            check_response("/whip", "POST", status, headers, body)
        finally:
            await first.close()
        # The slot comes back once the first caller hangs up.
        for _ in range(600):
            if (await request("GET", url, "/readyz"))[0] == 200:
                break
            await asyncio.sleep(0.1)
        assert (await request("GET", url, "/readyz"))[0] == 200


async def test_whip_post_patch_delete():
    ice = [{"urls": ["stun:stun.example.org:3478"]},
           {"urls": "turn:turn.example.org:3478", "username": "u", "credential": "p"}]
    async with running_server(rtc={"ice_servers": ice}) as (url, app):
        pc, sdp = await make_offer("sendonly")
        try:
            status, headers, body = await request("POST", url, "/whip", data=sdp,
                                                  headers={"Content-Type": "application/sdp", "Origin": "https://x.test"})
            assert status == 201
            check_response("/whip", "POST", status, headers, body)
            location, etag = headers["Location"], headers["ETag"]
            assert location.startswith("/whip/whip_")
            assert headers["Access-Control-Allow-Origin"] == "*"
            assert "Location" in headers["Access-Control-Expose-Headers"]
            links = headers.getall("Link")
            assert any('rel="ice-server"' in link and "stun.example.org" in link for link in links)
            assert any('username="u"' in link for link in links)
            await pc.setRemoteDescription(RTCSessionDescription(sdp=body.decode(), type="answer"))

            frag = "a=ice-ufrag:{}\r\na=ice-pwd:{}\r\nm=audio 9 UDP/TLS/RTP/SAVPF 0\r\na=mid:0\r\n" \
                   "a=candidate:1 1 udp 2130706431 127.0.0.1 40000 typ host\r\na=end-of-candidates\r\n"
            ufrag = next(l.split(":", 1)[1] for l in sdp.splitlines() if l.startswith("a=ice-ufrag:"))
            status, headers, body = await request("PATCH", url, location, data=frag.format(ufrag, "x" * 22),
                                                  headers={"Content-Type": "application/trickle-ice-sdpfrag",
                                                           "If-Match": etag})
            assert status == 204, body
            status, headers, body = await request("PATCH", url, location, data=frag.format("other", "x" * 22),
                                                  headers={"Content-Type": "application/trickle-ice-sdpfrag"})
            assert status == 422 and b"ICE restart" in body
            check_response("/whip/{resource_id}", "PATCH", status, headers, body)
            status, headers, body = await request("PATCH", url, location, data=frag.format(ufrag, "x"),
                                                  headers={"Content-Type": "application/trickle-ice-sdpfrag",
                                                           "If-Match": '"stale"'})
            assert status == 412
            status, headers, body = await request("PATCH", url, location, data="x",
                                                  headers={"Content-Type": "text/plain"})
            assert status == 415

            status, headers, body = await request("DELETE", url, location)
            assert status == 200
            status, headers, body = await request("DELETE", url, location)
            assert status == 404
            check_response("/whip/{resource_id}", "DELETE", status, headers, body)
        finally:
            await pc.close()


async def test_whip_rejects_wrong_content_type_and_preflight_is_allowed(echo_server):
    url, _ = echo_server
    status, headers, body = await request("POST", url, "/whip", data="v=0", headers={"Content-Type": "text/plain"})
    assert status == 415
    check_response("/whip", "POST", status, headers, body)
    status, headers, body = await request("OPTIONS", url, "/whip", headers={
        "Origin": "https://player.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert status == 204
    check_response("/whip", "OPTIONS", status, headers, body)
    assert headers["Access-Control-Allow-Origin"] == "*"
    assert "PATCH" in headers["Access-Control-Allow-Methods"]
    assert headers["Accept-Post"] == "application/sdp"


async def test_bearer_token_is_enforced_when_configured():
    async with running_server(server={"auth_token": "s3cret"}) as (url, app):
        status, headers, body = await request("GET", url, "/v1/sessions")
        assert status == 401
        check_response("/v1/sessions", "GET", status, headers, body)
        status, _, _ = await request("GET", url, "/v1/sessions", headers={"Authorization": "Bearer s3cret"})
        assert status == 200
        assert (await request("GET", url, "/healthz"))[0] == 200


async def test_offer_with_audio_and_video_is_answered_and_video_is_drained(echo_server):
    url, app = echo_server
    from lychee_rtc.server.app import REGISTRY_KEY

    pc = RTCPeerConnection()
    pc.addTransceiver(MicrophoneTrack(), direction="sendrecv")
    pc.addTransceiver("video", direction="sendonly")
    await pc.setLocalDescription(await pc.createOffer())
    try:
        status, headers, body = await request("POST", url, "/v1/rtc/offer",
                                              json={"sdp": pc.localDescription.sdp, "type": "offer"})
        assert status == 200
        import json

        answer = json.loads(body)
        assert "m=audio" in answer["sdp"] and "m=video" in answer["sdp"]
        call = app[REGISTRY_KEY].calls[answer["session_id"]]
        kinds = sorted(t.get_name().rsplit("-", 1)[1] for t in call.tasks if t.get_name().startswith("inbound"))
        assert kinds == ["audio", "video"]
    finally:
        await pc.close()


async def test_an_offer_split_across_packets_is_read_whole(echo_server):
    url, _ = echo_server
    pc, sdp = await make_offer()
    body = json.dumps({"sdp": sdp, "type": "offer"}).encode()

    async def slowly():
        yield body[:200]
        await asyncio.sleep(0.2)
        yield body[200:]

    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/rtc/offer", data=slowly(),
                                 headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200, await resp.text()
                assert (await resp.json())["type"] == "answer"
    finally:
        await pc.close()


async def test_failed_offers_give_their_slot_back():
    async with running_server(session={"max_sessions": 1}) as (url, app):
        for _ in range(3):  # G.722 only: valid SDP, but no codec in common -> refused after a slot was taken
            client = RtcClient(url, codec="G722")
            try:
                with pytest.raises(RuntimeError, match="422"):
                    await client.connect()
            finally:
                await client.close()
        assert app[ENGINE_KEY].free_slots == 1
        status, _, body = await request("GET", url, "/readyz")
        assert status == 200, body
        good = RtcClient(url)
        await good.connect()
        await good.close()
