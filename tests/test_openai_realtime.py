"""The OpenAI Realtime WebRTC surface with a real aiortc peer: calls, client secrets, the GA dialect.

The peer posts its offer the way OpenAI's clients do (raw SDP, or multipart with a session) and,
like the browser SDK, with every candidate removed: the server learns the peer's address from its
connectivity checks. Every GA event received is checked against the ``oai.server.*`` definitions
of signaling/events.schema.json and against the ``openai`` package's models of the server events.
"""

from __future__ import annotations

import asyncio
import json
import time
import zlib

import aiohttp
import numpy as np
import pytest
from conftest import running_server, wait_until
from contract import check_response
from openai_events import assert_openai_server_events

from lychee_rtc.bench.client import RtcClient
from lychee_rtc.server.app import REGISTRY_KEY
from lychee_rtc.server.openai import client_secrets
from lychee_rtc.server.openai.client_secrets import ClientSecrets, InvalidClientSecret, SessionTooLarge
from lychee_rtc.server.openai.routes import REALTIME_KEY
from lychee_rtc.session.protocol import validator

KEY = "sk-test-server-key"
HANGUP = "/v1/realtime/calls/{call_id}/hangup"
SECRETS = "/v1/realtime/client_secrets"
AUTH = {"Authorization": f"Bearer {KEY}"}
SILENCE = np.zeros(48000, np.float32)
# What @openai/agents-realtime 0.20.0 sends in its first session.update (openaiRealtimeBase.mjs).
SDK_SESSION = {
    "type": "realtime",
    "instructions": "You are a terse assistant.",
    "model": "gpt-realtime-2.1",
    "output_modalities": ["audio"],
    "audio": {
        "input": {"format": {"type": "audio/pcm", "rate": 24000}, "noise_reduction": None,
                  "transcription": {"model": "gpt-4o-mini-transcribe"}, "turn_detection": {"type": "semantic_vad"}},
        "output": {"format": {"type": "audio/pcm", "rate": 24000}, "speed": 1},
    },
    "tool_choice": "auto",
}


def strip_candidates(sdp: str) -> str:
    lines = [ln for ln in sdp.splitlines() if not ln.startswith("a=candidate") and ln != "a=end-of-candidates"]
    return "\r\n".join(lines) + "\r\n"


def assert_ga_events_valid(events: list[dict]) -> None:
    """Against our schema and, independently, the ``openai`` package's models (tests/openai_events.py)."""
    for event in events:
        validator(f"oai.server.{event['type']}").validate(event)
    assert_openai_server_events(events)
    ids = [e["event_id"] for e in events]
    assert len(set(ids)) == len(ids), "event ids repeat"


async def open_call(url: str, headers: dict[str, str], session: dict | None = None) -> tuple[RtcClient, str]:
    client = RtcClient(url, channel_label="oai-events")
    offer = strip_candidates(await client.make_offer())
    assert "a=candidate" not in offer
    async with aiohttp.ClientSession() as http:
        if session is None:
            post = http.post(f"{url}/v1/realtime/calls", data=offer,
                             headers={**headers, "Content-Type": "application/sdp"})
        else:
            form = aiohttp.FormData()
            form.add_field("sdp", offer, content_type="application/sdp")
            form.add_field("session", json.dumps(session), content_type="application/json")
            post = http.post(f"{url}/v1/realtime/calls", data=form, headers=headers)
        async with post as resp:
            raw = await resp.read()
            body = raw.decode()
            assert resp.status == 201, body
            check_response("/v1/realtime/calls", "POST", resp.status, resp.headers, raw)
            assert resp.content_type == "application/sdp"
            location = resp.headers["Location"]
    assert location.startswith("/v1/realtime/calls/")
    call_id = location.rsplit("/", 1)[1]
    await client.accept_answer(body, timeout=30)
    return client, call_id


async def test_candidate_less_offer_connects_and_speaks_the_ga_dialect(utterance):
    async with running_server(server={"auth_token": KEY}) as (url, app):
        client, call_id = await open_call(url, AUTH)
        try:
            assert call_id in app[REGISTRY_KEY].calls
            created = await client.wait_event("session.created")
            assert created["session"]["type"] == "realtime" and created["session"]["id"] == call_id
            assert created["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"

            # The SDK's default configuration is accepted; what this engine does not do is reported.
            client.send({"type": "session.update", "event_id": "cfg1", "session": SDK_SESSION})
            updated = await client.wait_event("session.updated")
            assert updated["session"]["instructions"] == SDK_SESSION["instructions"]
            assert updated["lychee_rtc"]["instructions"] == "unused"  # the echo engine has no prompt
            assert set(updated["lychee_rtc"]["ignored"]) == {
                "model", "audio.input.transcription", "audio.input.turn_detection.type"}
            # A clear before any response has no response to name, so it is not answered (events are
            # handled in order: the update after it is answered once the clear has been handled).
            n = len(client.events)
            client.send({"type": "output_audio_buffer.clear"})
            # The partial update the SDK sends after session.created.
            client.send({"type": "session.update", "session": {"type": "realtime", "tracing": "auto"}})
            partial = await client.wait_event("session.updated", after=n)
            assert not client.events_of("output_audio_buffer.cleared") and not client.events_of("error")
            assert partial["lychee_rtc"]["ignored"] == ["tracing"]
            assert partial["session"]["instructions"] == SDK_SESSION["instructions"]

            # The user speaks; the engine endpoints the turn and answers.
            client.mic.feed(utterance)
            client.mic.feed(SILENCE)
            started = await client.wait_event("input_audio_buffer.speech_started", timeout=30)
            committed = await client.wait_event("input_audio_buffer.committed", timeout=30)
            assert committed["item_id"] == started["item_id"]
            user_item = await client.wait_event("conversation.item.done", timeout=10)
            assert user_item["item"]["role"] == "user"
            response = await client.wait_event("response.created", timeout=30)
            rid = response["response"]["id"]
            await client.wait_event("output_audio_buffer.started", timeout=30, response_id=rid)

            # interrupt() as the browser SDK does it: response.cancel, then output_audio_buffer.clear.
            client.send({"type": "response.cancel"})
            client.send({"type": "output_audio_buffer.clear"})
            cleared = await client.wait_event("output_audio_buffer.cleared", timeout=10, response_id=rid)
            done = await client.wait_event("response.done", timeout=10)
            assert done["response"]["id"] == rid and done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"]["reason"] == "client_cancelled"
            assert done["response"]["output"][0]["status"] == "incomplete"
            # The second request found nothing playing; it is still answered, naming the response last
            # heard (the event's response_id is a string to OpenAI's clients, never null).
            await wait_until(lambda: len(client.events_of("output_audio_buffer.cleared")) == 2, 10,
                             "the answer to the second clear")
            idle_clear = client.events_of("output_audio_buffer.cleared")[1]
            assert idle_clear["response_id"] == rid
            assert client.events.index(cleared) < client.events.index(done) < client.events.index(idle_clear)
            item_done = [e for e in client.events_of("conversation.item.done") if e["item"]["role"] == "assistant"]
            assert item_done and item_done[0]["previous_item_id"] == user_item["item"]["id"]

            # What SDKs send routinely is answered without an error: a text item is echoed into the
            # conversation record (the model, which takes speech only, does not hear it) and a
            # cancel that comes after its response ended is already done. Refused and malformed
            # client events get GA errors echoing their event_id, and the call goes on.
            client.send({"type": "conversation.item.create", "event_id": "ok1",
                         "item": {"id": "item_text1", "type": "message", "role": "user",
                                  "content": [{"type": "input_text", "text": "hi"}]}})
            echoed = await wait_until(lambda: next((e for e in client.events_of("conversation.item.added")
                                                     if e["item"]["id"] == "item_text1"), None), 10, "the echo")
            assert echoed["lychee_rtc"] == {"heard_by_model": False}
            assert echoed["item"]["content"] == [{"type": "input_text", "text": "hi"}]
            client.send({"type": "response.cancel", "event_id": "ok2"})
            client.send({"type": "conversation.item.truncate", "event_id": "c1", "item_id": "item_nowhere",
                         "content_index": 0, "audio_end_ms": 10})
            client.send({"type": "session.update", "event_id": "c2", "session": {"type": "transcription"}})
            client.send({"type": "session.update", "event_id": "c3", "session": {"instructions": 5}})
            client.send({"type": "conversation.item.retrieve", "event_id": "c4", "item_id": "item_nowhere"})
            client.send({"type": "conversation.item.retrieve", "item_id": user_item["item"]["id"]})
            retrieved = await client.wait_event("conversation.item.retrieved", timeout=10)
            assert retrieved["item"] == user_item["item"]
            await wait_until(lambda: len(client.events_of("error")) >= 4, 10, "four errors")
            errors = {e["error"]["event_id"]: e["error"]["code"] for e in client.events_of("error")}
            assert errors == {"c1": "item_truncate_invalid_item_id", "c2": "unsupported_session_type",
                              "c3": "invalid_event", "c4": "item_retrieve_invalid_item_id"}
            bad = next(e for e in client.events_of("error") if e["error"]["event_id"] == "c3")
            assert "session/instructions" in bad["error"]["message"]
            assert_ga_events_valid(client.events)

            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/v1/realtime/calls/{call_id}/hangup", headers=AUTH) as resp:
                    assert resp.status == 200
                    check_response(HANGUP, "POST", resp.status, resp.headers, await resp.read())
                assert call_id not in app[REGISTRY_KEY].calls
                async with http.post(f"{url}/v1/realtime/calls/{call_id}/hangup", headers=AUTH) as resp:
                    assert resp.status == 404
                    check_response(HANGUP, "POST", resp.status, resp.headers, await resp.read())
                    assert (await resp.json())["error"]["code"] == "call_not_found"
        finally:
            await client.close()


async def test_multipart_session_sets_instructions_before_the_call_opens():
    session = {"type": "realtime", "instructions": "Answer in French.", "audio": {"output": {"voice": "marin"}}}
    async with running_server(server={"auth_token": KEY}) as (url, app):
        client, call_id = await open_call(url, AUTH, session=session)
        try:
            created = await client.wait_event("session.created")
            assert created["session"]["instructions"] == "Answer in French."
            assert created["session"]["audio"]["output"]["voice"] is None  # no such voice here
            assert app[REGISTRY_KEY].calls[call_id].session.options.instructions == "Answer in French."
        finally:
            await client.close()


async def test_client_secrets_open_calls_only_until_they_expire():
    async with running_server(server={"auth_token": KEY}) as (url, app):
        async with aiohttp.ClientSession() as http:
            mint = {"session": {"type": "realtime", "instructions": "Be kind."},
                    "expires_after": {"anchor": "created_at", "seconds": 60}}
            async with http.post(f"{url}/v1/realtime/client_secrets", json=mint) as resp:
                assert resp.status == 401  # minting needs the server key
            async with http.post(f"{url}/v1/realtime/client_secrets", json=mint, headers=AUTH) as resp:
                assert resp.status == 200
                check_response(SECRETS, "POST", resp.status, resp.headers, await resp.read())
                secret = await resp.json()
            assert secret["value"].startswith("ek_")
            assert abs(secret["expires_at"] - (time.time() + 60)) < 30
            assert secret["session"]["instructions"] == "Be kind." and secret["session"]["type"] == "realtime"
            ek = {"Authorization": f"Bearer {secret['value']}"}
            # Never a substitute for the server key.
            async with http.post(f"{url}/v1/realtime/client_secrets", json=mint, headers=ek) as resp:
                assert resp.status == 401
            async with http.get(f"{url}/v1/sessions", headers=ek) as resp:
                assert resp.status == 401
            async with http.get(f"{url}/v1/realtime?call_id=x", headers=ek) as resp:
                assert resp.status == 401
            too_long = {"session": {"type": "realtime", "instructions": "".join(
                f"{i:x}" for i in range(3000)) + "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(4000))}}
            for bad, code in [({"expires_after": {"seconds": 5}}, "invalid_value"),
                              ({"session": {"type": "transcription"}}, "unsupported_session_type"),
                              (too_long, "session_too_large"),
                              ({"surprise": 1}, "unknown_parameter")]:
                async with http.post(f"{url}/v1/realtime/client_secrets", json=bad, headers=AUTH) as resp:
                    assert resp.status == 400 and (await resp.json())["error"]["code"] == code
                    check_response(SECRETS, "POST", resp.status, resp.headers, await resp.read())

        # The key opens a call that starts from the configuration it was minted with.
        client, call_id = await open_call(url, ek)
        try:
            created = await client.wait_event("session.created")
            assert created["session"]["instructions"] == "Be kind."
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/v1/realtime/calls/{call_id}/hangup", headers=ek) as resp:
                    assert resp.status == 401  # hanging up is the application server's, with its key
        finally:
            await client.close()

        # Once expired, it opens nothing.
        app[REALTIME_KEY].secrets.clock = lambda: time.time() + 61
        late = RtcClient(url, channel_label="oai-events")
        try:
            offer = await late.make_offer()
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/v1/realtime/calls", data=offer,
                                     headers={**ek, "Content-Type": "application/sdp"}) as resp:
                    assert resp.status == 401
                    assert (await resp.json())["error"]["code"] == "invalid_client_secret"
                    assert "expired" in (await resp.json())["error"]["message"]
        finally:
            await late.close()


def _resign(secrets: ClientSecrets, claims: object, *, compress=zlib.compress) -> str:
    """A key with a payload of the test's choosing, signed with the right key (as if by a bug)."""
    payload = client_secrets._b64encode(compress(json.dumps(claims).encode()))
    return f"ek_{payload}." + secrets._sign("ek_" + payload)


def test_a_client_secret_is_a_signed_token_verified_without_state():
    now = [1_000_000.0]
    minter = ClientSecrets("sk-one", clock=lambda: now[0])
    session = {"type": "realtime", "instructions": "Be kind. " * 200}
    secret = minter.mint(session, 60)
    assert secret.value.startswith("ek_") and len(secret.value) <= client_secrets.MAX_KEY_CHARS
    assert (secret.created_at, secret.expires_at) == (1_000_000, 1_000_060)
    assert minter.mint(session, 60).value != secret.value  # a nonce each
    # Another process with the same server key (a worker, an entry) reads the same record.
    other = ClientSecrets("sk-one", clock=lambda: now[0])
    assert other.verify(secret.value) == secret
    with pytest.raises(InvalidClientSecret, match="not minted with this server's key"):
        ClientSecrets("sk-two", clock=lambda: now[0]).verify(secret.value)
    with pytest.raises(InvalidClientSecret, match="not minted"):  # keyless: a random key per process
        ClientSecrets(None, clock=lambda: now[0]).verify(secret.value)

    payload, signature = secret.value[3:].split(".")
    flipped = signature[:-2] + ("A" if signature[-2] != "A" else "B") + signature[-1]
    forged_payload = client_secrets._b64encode(zlib.compress(json.dumps(
        {"v": 1, "iat": 1_000_000, "exp": 1_007_200, "nonce": "x" * 16, "session": {}}).encode()))
    for tampered in (f"ek_{payload}.{flipped}", f"ek_{forged_payload}.{signature}", f"ek_{payload[:-4]}.{signature}"):
        with pytest.raises(InvalidClientSecret, match="not minted"):
            other.verify(tampered)
    for malformed in ("ek_", "ek_abc", f"ek_{payload}", f"ek_{payload}.{signature}x", f"ek_{payload}!.{signature}",
                      f"sk_{payload}.{signature}", "ek_" + "A" * (client_secrets.MAX_KEY_CHARS + 1)):
        with pytest.raises(InvalidClientSecret):
            other.verify(malformed)

    now[0] += 59
    assert other.verify(secret.value).session == session
    now[0] += 1  # expired at its expires_at
    with pytest.raises(InvalidClientSecret, match="expired"):
        other.verify(secret.value)
    with pytest.raises(ValueError):
        minter.mint({}, 7201)
    with pytest.raises(ValueError):
        minter.mint({}, 9)


def test_a_client_secret_payload_is_bounded_and_read_strictly():
    now = 1_000_000.0
    secrets_ = ClientSecrets("sk-one", clock=lambda: now)
    # Incompressible instructions beyond what a header carries are refused at minting, clearly.
    noise = "".join(chr(0x4E00 + (i * 7919) % 20000) for i in range(4000))
    with pytest.raises(SessionTooLarge, match="at most 5120"):
        secrets_.mint({"instructions": noise})
    good = {"v": 1, "iat": 1_000_000, "exp": 1_000_600, "nonce": "n" * 16, "session": {"type": "realtime"}}
    assert secrets_.verify(_resign(secrets_, good)).session == {"type": "realtime"}
    for bad, reason in [
        ([1, 2], "wrong fields"),
        ({**good, "extra": 1}, "wrong fields"),
        ({k: v for k, v in good.items() if k != "nonce"}, "wrong fields"),
        ({**good, "v": 2}, "version"),
        ({**good, "v": True}, "version"),
        ({**good, "exp": "1000600"}, "lifetime"),
        ({**good, "iat": 1_000_000.5}, "lifetime"),
        ({**good, "exp": 1_000_000 + 7201}, "lifetime"),
        ({**good, "nonce": 5}, "nonce"),
        ({**good, "session": "realtime"}, "session"),
    ]:
        with pytest.raises(InvalidClientSecret, match=reason):
            secrets_.verify(_resign(secrets_, bad))
    # A payload that inflates beyond the bound is refused without inflating it all.
    bomb = _resign(secrets_, {**good, "session": {"instructions": " " * (2 * client_secrets.MAX_JSON_BYTES)}})
    with pytest.raises(InvalidClientSecret, match="oversized"):
        secrets_.verify(bomb)
    with pytest.raises(InvalidClientSecret, match="unreadable"):
        secrets_.verify(_resign(secrets_, good, compress=lambda raw: raw))  # not compressed
    nan = _resign(secrets_, good, compress=lambda raw: zlib.compress(raw.replace(b'"realtime"', b"NaN")))
    with pytest.raises(InvalidClientSecret, match="unreadable"):
        secrets_.verify(nan)


async def test_keyless_server_is_open_on_loopback_and_closed_beyond_it():
    async with running_server() as (url, _):  # local development: no server key, loopback only
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/realtime/client_secrets", json={}) as resp:
                assert resp.status == 200 and (await resp.json())["value"].startswith("ek_")
    # Listening on every interface without a key: no keys are minted and no sideband is opened.
    async with running_server(server={"host": "0.0.0.0"}) as (url, _):
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/realtime/client_secrets", json={}) as resp:
                assert resp.status == 403 and (await resp.json())["error"]["code"] == "server_key_required"
                check_response(SECRETS, "POST", resp.status, resp.headers, await resp.read())
            async with http.get(f"{url}/v1/realtime?call_id=x") as resp:
                assert resp.status == 403
                check_response("/v1/realtime", "GET", resp.status, resp.headers, await resp.read())


async def test_call_offers_are_checked_like_any_offer():
    async with running_server(server={"auth_token": KEY}) as (url, _):
        async with aiohttp.ClientSession() as http:
            calls = f"{url}/v1/realtime/calls"
            async with http.post(calls, data="v=0", headers={"Content-Type": "text/plain", **AUTH}) as resp:
                assert resp.status == 415
                check_response("/v1/realtime/calls", "POST", resp.status, resp.headers, await resp.read())
            async with http.post(calls, data="not sdp", headers={"Content-Type": "application/sdp", **AUTH}) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["param"] == "sdp"
            form = aiohttp.FormData()
            form.add_field("session", "{}", content_type="application/json")
            async with http.post(calls, data=form, headers=AUTH) as resp:
                assert resp.status == 400 and "'sdp' is required" in (await resp.json())["error"]["message"]
            async with http.post(calls, data="v=0", headers={"Content-Type": "application/sdp"}) as resp:
                assert resp.status == 401
            for query, status in [("", 400), ("?call_id=sess_nope", 404)]:
                async with http.get(f"{url}/v1/realtime{query}", headers=AUTH) as resp:
                    assert resp.status == status
                    check_response("/v1/realtime", "GET", resp.status, resp.headers, await resp.read())
            # A page on another origin: the preflight allows the SDK's headers; Location is exposed.
            preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "authorization,content-type,x-openai-agents-sdk"}
            async with http.options(calls, headers=preflight) as resp:
                assert resp.status == 204
                allowed = resp.headers["Access-Control-Allow-Headers"].lower()
                assert {"authorization", "content-type", "x-openai-agents-sdk"} <= {
                    h.strip() for h in allowed.split(",")}
                assert "Location" in resp.headers["Access-Control-Expose-Headers"]
