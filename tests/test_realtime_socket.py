"""The realtime WebSocket (``GET /v1/realtime``) in the OpenAI GA dialect, driven by the ``openai``
SDK pinned in the ``test`` extra (``client.realtime.connect`` with ``base_url``), unmodified, and by a
plain socket client for what no SDK sends. Every event received is checked against our schema and
the SDK's own models of the server events (``assert_ga_events_valid``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp
import numpy as np
import pytest
from conftest import PATIENT_WINDOWS, running_server, synthesize, wait_until
from openai import AsyncOpenAI

from lychee_rtc.server.app import REGISTRY_KEY
from realtime_ws_support import RATE, RawSocket, audio_of, b64, chunks, echo_similarity, from_pcm16, to_pcm16
from test_openai_realtime import assert_ga_events_valid

SPEECH = "Hello there. This is a test of the echo engine, one two three."
SILENCE_S = 3.0


def pcm(text: str = SPEECH, rate: int = RATE) -> tuple[np.ndarray, bytes]:
    speech = synthesize(text, rate=rate)
    return speech, to_pcm16(speech)


async def stream(conn, data: bytes, chunk_ms: int = 40, realtime: bool = True) -> None:
    """Append ``data`` as a client does: ``chunk_ms`` at a time, paced in real time if asked."""
    for piece in chunks(data, chunk_ms):
        await conn.input_audio_buffer.append(audio=b64(piece))
        if realtime:
            await asyncio.sleep(chunk_ms / 1000)


async def read_until(conn, seen: list[dict], done, timeout: float = 60.0) -> None:
    """Keep every event (raw, as it came) until ``done(event)``."""
    async def read() -> None:
        while True:
            raw = json.loads(await conn.recv_bytes())
            seen.append(raw)
            if done(raw):
                return
    await asyncio.wait_for(read(), timeout)


def sdk(url: str, key: str = "local") -> AsyncOpenAI:
    return AsyncOpenAI(api_key=key, base_url=f"{url}/v1", max_retries=0)


async def test_the_openai_sdk_holds_a_spoken_conversation_in_real_time(utterance):
    speech, data = pcm()
    async with running_server(session=PATIENT_WINDOWS) as (url, app):
        client = sdk(url)
        seen: list[dict] = []
        async with client.realtime.connect(model="gpt-realtime") as conn:
            # The SDK sends nothing by itself; the application configures the session first.
            await conn.session.update(session={"type": "realtime", "output_modalities": ["audio"], "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": {"type": "server_vad"}},
                "output": {"format": {"type": "audio/pcm", "rate": 24000}}}})
            sender = asyncio.ensure_future(stream(conn, data + bytes(int(SILENCE_S * RATE) * 2)))
            await read_until(conn, seen, lambda e: e["type"] == "response.done")
            await sender
            registry = app[REGISTRY_KEY]
            (call,) = registry.calls.values()
            assert call.snapshot()["transport"] == "websocket"
        # The client went away: its slot is free at once (nothing can resume a GA socket).
        await wait_until(lambda: not registry.calls, 10, "the slot to be freed")
        await client.close()

    types = [e["type"] for e in seen]
    assert types[0] == "session.created" and "session.updated" in types
    created = seen[0]["session"]
    assert created["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
    assert created["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}
    # The whole sequence of one response, with every id.
    order = ["response.created", "response.output_item.added", "conversation.item.added",
             "response.content_part.added", "response.output_audio.delta", "response.output_audio.done",
             "response.output_audio_transcript.done", "response.content_part.done", "response.output_item.done",
             "conversation.item.done", "response.done"]
    start = types.index("response.created")
    response_types = [t for t in types[start:] if t in order]
    assert [t for i, t in enumerate(response_types) if i == 0 or t != response_types[i - 1]] == order
    done = seen[-1]
    assert done["response"]["status"] == "completed"
    rid = done["response"]["id"]
    assert all(e["response_id"] == rid for e in seen if e["type"] == "response.output_audio.delta")
    # No output buffer events over a socket (OpenAI sends them over WebRTC only); no error at all.
    assert not [t for t in types if t.startswith("output_audio_buffer.") or t == "error"]
    # What came back is what was said (the echo engine replays the utterance).
    heard = from_pcm16(audio_of(seen, rid))
    assert len(heard) > 0.8 * len(speech)
    assert echo_similarity(speech, heard) > 0.8
    assert_ga_events_valid(seen)


def snapshot(app) -> dict:
    (call,) = app[REGISTRY_KEY].calls.values()
    return call.snapshot()


async def test_a_file_sent_faster_than_real_time_is_heard_whole_at_the_engines_pace(long_utterance):
    speech, data = pcm("The quick brown fox jumps over the lazy dog, and then it runs far away across the green "
                       "hills towards the river, where it rests until the evening comes.")
    sent = data + bytes(2 * RATE * 2)
    async with running_server(session=PATIENT_WINDOWS) as (url, app):
        client = sdk(url)
        seen: list[dict] = []
        async with client.realtime.connect(model="lychee-fd") as conn:
            # The whole file and two seconds of silence at once, as an evaluation script sends it.
            await stream(conn, sent, chunk_ms=1000, realtime=False)
            await read_until(conn, seen, lambda e: e["type"] == "response.done")
            counters = snapshot(app)["counters"]
        await client.close()
    # Fed as fast as the engine took it, and none of it dropped: the uplink waited for the engine.
    assert counters["socket_waits_for_engine"] > 0 and counters["engine_windows_dropped"] == 0
    # Every window up to the last of the client's audio was the client's own: silence was filled only
    # after it (the model listens on, in real time, once the input has run out).
    window = 6400
    client_samples = len(sent) // 2 * 16000 // RATE
    assert counters["window_windows"] - counters["window_underruns"] >= client_samples // window
    heard = from_pcm16(audio_of(seen))
    assert seen[-1]["response"]["status"] == "completed"
    assert len(heard) > 0.8 * len(speech) and echo_similarity(speech, heard) > 0.8
    assert_ga_events_valid(seen)


async def test_when_the_client_stops_sending_the_model_goes_on_listening_and_answering():
    speech, data = pcm()
    async with running_server(session=PATIENT_WINDOWS) as (url, app):
        client = sdk(url)
        seen: list[dict] = []
        async with client.realtime.connect() as conn:  # no model in the URL at all
            await stream(conn, data)  # speech, and then nothing: no silence is sent
            # The echo engine answers once it has heard enough silence after the speech: the
            # session's clock supplies it, so the answer comes and plays to its end.
            await read_until(conn, seen, lambda e: e["type"] == "response.done")
            counters = snapshot(app)["counters"]
        await client.close()
    assert seen[-1]["response"]["status"] == "completed"
    assert counters["window_underruns"] > 0  # windows of silence, filled in real time
    heard = from_pcm16(audio_of(seen))
    assert echo_similarity(speech, heard) > 0.8
    assert_ga_events_valid(seen)


async def test_cancel_and_truncate_are_followed_by_no_audio_of_the_old_response(long_utterance):
    speech, data = pcm("The quick brown fox jumps over the lazy dog, and then it runs far away across the green "
                       "hills towards the river, where it rests until the evening comes.")
    async with running_server(session=PATIENT_WINDOWS) as (url, app):
        client = sdk(url)
        seen: list[dict] = []
        async with client.realtime.connect(model="gpt-realtime") as conn:
            talk = data + bytes(2 * RATE * 2)
            sender = asyncio.ensure_future(stream(conn, talk))
            await read_until(conn, seen, lambda e: e["type"] == "response.output_audio.delta")
            first = seen[-1]["response_id"]
            await conn.response.cancel()
            await read_until(conn, seen, lambda e: e["type"] == "response.done")
            await sender
            done = seen[-1]
            assert done["response"]["id"] == first and done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}

            # Again, and this time the client says how much it played (less than was sent).
            sender = asyncio.ensure_future(stream(conn, talk))
            await read_until(conn, seen, lambda e: e["type"] == "response.output_audio.delta"
                             and e["response_id"] != first)
            second, item = seen[-1]["response_id"], seen[-1]["item_id"]
            await read_until(conn, seen, lambda e: e["type"] == "response.output_audio.delta"
                             and len(audio_of(seen, second)) >= RATE * 2)  # a second of it sent
            await conn.conversation.item.truncate(item_id=item, content_index=0, audio_end_ms=300)
            await read_until(conn, seen, lambda e: e["type"] == "conversation.item.truncated")
            await read_until(conn, seen, lambda e: e["type"] == "response.done" and e["response"]["id"] == second,
                             timeout=10) if not [e for e in seen if e["type"] == "response.done"
                                                 and e["response"]["id"] == second] else None
            await sender
            truncated = next(e for e in seen if e["type"] == "conversation.item.truncated")
            assert truncated["item_id"] == item and truncated["audio_end_ms"] == 300
            # Truncating again beyond what was sent is clamped, not refused; deleting is answered.
            await conn.conversation.item.truncate(item_id=item, content_index=0, audio_end_ms=10**9)
            await read_until(conn, seen, lambda e: e["type"] == "conversation.item.truncated"
                             and e["audio_end_ms"] != 300)
            await conn.conversation.item.delete(item_id=item)
            await read_until(conn, seen, lambda e: e["type"] == "conversation.item.deleted")
        await client.close()
    for rid in (first, second):
        done_at = next(i for i, e in enumerate(seen) if e["type"] == "response.done" and e["response"]["id"] == rid)
        assert not [e for e in seen[done_at:] if e["type"] == "response.output_audio.delta"
                    and e["response_id"] == rid], f"audio of {rid} after its response.done"
    clamped = [e for e in seen if e["type"] == "conversation.item.truncated"][-1]
    sent_ms = 1000 * len(audio_of(seen, second)) / (RATE * 2)
    assert 300 < clamped["audio_end_ms"] <= sent_ms + 1
    assert not [e for e in seen if e["type"] == "error"]
    assert_ga_events_valid(seen)


async def test_speaking_over_the_answer_is_a_barge_in_the_client_hears_as_one(interjection):
    speech, data = pcm("The quick brown fox jumps over the lazy dog, and then it runs far away across the green "
                       "hills towards the river, where it rests until the evening comes.")
    over = to_pcm16(synthesize("Wait, stop, stop please, I have a question for you.", rate=RATE, voice="en+f3"))
    async with running_server(session=PATIENT_WINDOWS) as (url, app):
        client = sdk(url)
        seen: list[dict] = []
        async with client.realtime.connect(model="gpt-realtime") as conn:
            await stream(conn, data + bytes(RATE * 2))
            await read_until(conn, seen, lambda e: e["type"] == "response.output_audio.delta")
            first = seen[-1]["response_id"]
            # The user talks over the answer (the client keeps streaming, as frameworks do).
            sender = asyncio.ensure_future(stream(conn, over + bytes(3 * RATE * 2)))
            await read_until(conn, seen, lambda e: e["type"] == "response.done")
            await read_until(conn, seen, lambda e: e["type"] == "response.done")  # the answer to the interjection
            await sender
        await client.close()
    dones = [e for e in seen if e["type"] == "response.done"]
    assert dones[0]["response"]["id"] == first
    assert dones[0]["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert dones[1]["response"]["status"] == "completed"
    first_done = seen.index(dones[0])
    # speech_started came once the answer was cut, and before its end: the client sees a barge-in.
    started = [i for i, e in enumerate(seen) if e["type"] == "input_audio_buffer.speech_started"]
    created = next(i for i, e in enumerate(seen) if e["type"] == "response.created" and e["response"]["id"] == first)
    barge = [i for i in started if created < i]
    assert barge and barge[0] < first_done
    assert not [e for e in seen[first_done:] if e["type"] == "response.output_audio.delta" and e["response_id"] == first]
    assert echo_similarity(from_pcm16(over), from_pcm16(audio_of(seen, dones[1]["response"]["id"]))) > 0.7
    assert_ga_events_valid(seen)


async def test_g711_in_and_out_as_the_session_asks():
    from lychee_rtc.telephony.g711 import g711_decode, g711_encode  # checked against FFmpeg in test_telephony_units

    speech = synthesize(SPEECH, rate=8000)
    async with running_server(session=PATIENT_WINDOWS) as (url, app):
        async with aiohttp.ClientSession() as http:
            sock = await RawSocket.connect(http, f"{url}/v1/realtime?model=gpt-realtime")
            await sock.send({"type": "session.update", "event_id": "u1", "session": {
                "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}},
                                              "output": {"format": {"type": "audio/pcma"}}}}})
            updated = await sock.wait("session.updated")
            assert updated["session"]["audio"]["input"]["format"] == {"type": "audio/pcmu"}
            assert updated["session"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
            assert "audio.input.format" not in updated["lychee_rtc"].get("ignored", [])
            for piece in chunks(g711_encode(speech, "mulaw") + g711_encode(np.zeros(3 * 8000), "mulaw"), 100,
                                rate=8000, width=1):
                await sock.send({"type": "input_audio_buffer.append", "audio": b64(piece)})
                await asyncio.sleep(0.1)
            done = await sock.wait("response.done")
            heard = g711_decode(audio_of(sock.events, done["response"]["id"]), "alaw")
            await sock.close()
    assert echo_similarity(speech, heard, rate=8000) > 0.8
    assert not sock.of("error")
    assert_ga_events_valid(sock.events)


async def test_bad_input_on_the_socket_gets_typed_errors_and_harms_no_one():
    async with running_server(session=PATIENT_WINDOWS, websocket={"max_frame_bytes": 1 << 20}) as (url, app):
        async with aiohttp.ClientSession() as http:
            bystander = await RawSocket.connect(http, f"{url}/v1/realtime")
            sock = await RawSocket.connect(http, f"{url}/v1/realtime?model=x")
            await sock.ws.send_str("not json")
            await sock.ws.send_bytes(b"\xff\xfe")
            await sock.send({"type": "no.such.event", "event_id": "e1"})
            await sock.send({"type": "input_audio_buffer.append", "event_id": "e2", "audio": "!!!"})
            await sock.send({"type": "input_audio_buffer.append", "event_id": "e3", "audio": b64(b"\x00\x01\x02")})
            await sock.send({"type": "input_audio_buffer.append", "event_id": "e4"})
            # Out of order: nothing to truncate, cancel or retrieve yet.
            await sock.send({"type": "conversation.item.truncate", "event_id": "e5", "item_id": "item_x",
                             "content_index": 0, "audio_end_ms": 5})
            await sock.send({"type": "response.cancel", "event_id": "e6"})
            await sock.send({"type": "response.create", "event_id": "e7", "response": {"metadata": {"k": {"x": 1}}}})
            await sock.send({"type": "session.update", "event_id": "e8", "session": {
                "type": "realtime", "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000}}}}})
            await wait_until(lambda: len(sock.of("error")) >= 10, 30, "ten errors")
            codes = [(e["error"]["event_id"], e["error"]["code"]) for e in sock.of("error")]
            assert codes == [(None, "invalid_json"), (None, "invalid_json"), ("e1", "unknown_event"),
                             ("e2", "bad_audio"), ("e3", "bad_audio"), ("e4", "invalid_event"),
                             ("e5", "item_truncate_invalid_item_id"), ("e6", "response_cancel_not_active"),
                             ("e7", "invalid_value"), ("e8", "unsupported_audio_format")]
            assert all(e["error"]["message"] and e["error"]["type"] == "invalid_request_error" for e in sock.of("error"))
            # A frame above the limit closes the socket (1009); a 20 MB one as well.
            await sock.ws.send_str(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * (1 << 20)}))
            assert await sock.closed() == 1009
            big = await RawSocket.connect(http, f"{url}/v1/realtime")
            await big.wait("session.created")
            with contextlib.suppress(ConnectionError):  # the server may close before the frame is all sent
                await big.ws.send_bytes(b"x" * 20_000_000)
            assert await big.closed() == 1009
            await wait_until(lambda: len(app[REGISTRY_KEY].calls) == 1, 10, "the closed sockets' slots")
            # The other session never noticed.
            await bystander.send({"type": "session.update", "session": {"type": "realtime", "instructions": "hi"}})
            updated = await bystander.wait("session.updated")
            assert updated["session"]["instructions"] == "hi" and not bystander.of("error")
            await bystander.close()
    assert_ga_events_valid(sock.events + bystander.events)


async def test_the_largest_append_the_protocol_allows_is_taken_or_refused_with_a_typed_error():
    """OpenAI's limit is 15 MiB per append: four minutes of 24 kHz PCM is queued (the engine takes
    it at its own pace); as G.711 the same size is more audio than a session queues, and says so."""
    async with running_server(session=PATIENT_WINDOWS) as (url, app):
        async with aiohttp.ClientSession() as http:
            sock = await RawSocket.connect(http, f"{url}/v1/realtime")
            await sock.wait("session.created")
            audio = b64(bytes(15 * (1 << 20) * 3 // 4))  # 15 MiB of base64
            await sock.send({"type": "input_audio_buffer.append", "event_id": "big", "audio": audio})
            await wait_until(lambda: snapshot(app)["counters"]["socket_appends"] == 1, 60, "the append")
            appended_ms = snapshot(app)["counters"]["socket_appended_ms"]
            assert appended_ms == pytest.approx(1000 * len(audio) * 3 / 4 / 2 / RATE, abs=1)
            await sock.send({"type": "session.update", "session": {"type": "realtime", "audio": {
                "input": {"format": {"type": "audio/pcmu"}}}}})
            await sock.send({"type": "input_audio_buffer.append", "event_id": "ulaw", "audio": audio})
            refused = await sock.wait("error")
            assert refused["error"]["event_id"] == "ulaw" and refused["error"]["code"] == "input_backpressure"
            assert refused["error"]["type"] == "rate_limit_error"
            await sock.close()
        await wait_until(lambda: not app[REGISTRY_KEY].calls, 10, "the slot to be freed")


async def test_sockets_are_admitted_like_calls_keys_and_capacity():
    from test_openai_realtime import AUTH, KEY

    async with running_server(server={"auth_token": KEY}, session={**PATIENT_WINDOWS, "max_sessions": 1}) as (url, app):
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await http.ws_connect(f"{url.replace('http', 'ws')}/v1/realtime", headers=headers)
                assert refused.value.status == 401
            async with http.get(f"{url}/v1/realtime?model=%01", headers=AUTH) as resp:
                assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_value"
            async with http.post(f"{url}/v1/realtime/client_secrets", headers=AUTH,
                                 json={"session": {"type": "realtime", "instructions": "Be brief."}}) as resp:
                key = (await resp.json())["value"]
            # An ek_ key opens a socket, starting from its session; the SDK sends it as its api key.
            client = sdk(url, key)
            async with client.realtime.connect(model="gpt-realtime") as conn:
                created = json.loads(await conn.recv_bytes())
                assert created["type"] == "session.created" and created["session"]["instructions"] == "Be brief."
                # The one slot is taken: the next socket is refused before the upgrade.
                with pytest.raises(aiohttp.WSServerHandshakeError) as full:
                    await http.ws_connect(f"{url.replace('http', 'ws')}/v1/realtime", headers=AUTH)
                assert full.value.status == 503 and full.value.headers["Retry-After"] == "5"
            await client.close()
            await wait_until(lambda: not app[REGISTRY_KEY].calls, 10, "the slot to be freed")
            sock = await RawSocket.connect(http, f"{url}/v1/realtime", headers=AUTH)
            await sock.wait("session.created")
            await sock.close()


async def test_a_socket_that_says_nothing_is_closed_and_frees_its_slot():
    async with running_server(websocket={"first_message_timeout_s": 0.5, "idle_timeout_s": 1.0}) as (url, app):
        async with aiohttp.ClientSession() as http:
            silent = await RawSocket.connect(http, f"{url}/v1/realtime")
            assert await silent.closed() == 1008
            idle = await RawSocket.connect(http, f"{url}/v1/realtime")
            await idle.send({"type": "session.update", "session": {"type": "realtime"}})
            await idle.wait("session.updated")
            assert await idle.closed() == 1008
        await wait_until(lambda: not app[REGISTRY_KEY].calls, 10, "the slots to be freed")


@pytest.mark.parametrize("profile", ["configs/loopback.yaml"])
async def test_other_engines_answer_on_the_socket(profile):
    speech, data = pcm()
    async with running_server(profile, session=PATIENT_WINDOWS) as (url, app):
        client = sdk(url)
        seen: list[dict] = []
        async with client.realtime.connect(model="gpt-realtime") as conn:
            await stream(conn, data + bytes(RATE * 2))
            await read_until(conn, seen, lambda e: e["type"] == "response.output_audio.delta"
                             and len(audio_of(seen)) >= len(data))
        await client.close()
    assert echo_similarity(speech, from_pcm16(audio_of(seen))) > 0.8
    assert_ga_events_valid(seen)


@pytest.fixture(scope="module")
def tiny_lychee(tmp_path_factory) -> str:
    """Lychee-FD and Token2Wav as ``make tiny`` serves them: tiny random checkpoints in the released
    layout and the CPU profile written next to them (``lychee-rtc tiny-checkpoint``)."""
    from lychee_rtc.engine.lychee import tiny

    out = tmp_path_factory.mktemp("lychee-socket") / "tiny"
    assert tiny.main([str(out), "--seed", "11", "--decision-bias", "4"]) == 0
    return str(out / "lychee-cpu.yaml")


@pytest.mark.timeout(600)
async def test_the_tiny_lychee_fd_model_answers_over_the_socket(tiny_lychee):
    rng = np.random.default_rng(0)
    noise = to_pcm16((0.05 * rng.standard_normal(RATE * 30)).astype(np.float32))
    async with running_server(tiny_lychee) as (url, app):
        client = sdk(url)
        seen: list[dict] = []
        async with client.realtime.connect(model="lychee-fd") as conn:
            sender = asyncio.ensure_future(stream(conn, noise, chunk_ms=100))
            await read_until(conn, seen, lambda e: e["type"] == "session.created")
            assert seen[0]["session"]["audio"]["input"]["turn_detection"]["type"] == "semantic_vad"
            await conn.response.create(response={"metadata": {"turn": "first"}})  # "answer now"
            await read_until(conn, seen, lambda e: e["type"] == "response.output_audio.delta", timeout=180)
            created = next(e for e in seen if e["type"] == "response.created")
            assert created["response"]["metadata"] == {"turn": "first"}
            rid = created["response"]["id"]
            await conn.response.cancel()
            await read_until(conn, seen, lambda e: e["type"] == "response.done", timeout=60)
            sender.cancel()
        await client.close()
    done = seen[-1]
    assert done["response"]["id"] == rid and done["response"]["status"] == "cancelled"
    assert done["response"]["metadata"] == {"turn": "first"}
    heard = from_pcm16(audio_of(seen, rid))
    assert len(heard) and np.isfinite(heard).all() and np.abs(heard).max() > 0
    assert not [e for e in seen if e["type"] == "error"]
    assert_ga_events_valid(seen)


async def test_a_client_that_stops_reading_is_dropped_and_costs_bounded_memory():
    """The client sends and never reads (a socket of its own, its kernel buffer small): the
    server's kernel buffer is kept small too, its send queue fills, and the socket is dropped with
    the slot freed; what the server held was bounded all along."""
    async with running_server(websocket={"queue_events": 64, "queue_bytes": 1 << 20,
                                         "send_buffer_bytes": 4096}) as (url, app):
        writer = await silent_reader(int(url.rsplit(":", 1)[1]), "/v1/realtime")
        try:
            for i in range(100):  # each is answered with the session's object, 16 kB long, nobody reads
                writer.write(masked_text(json.dumps({"type": "session.update", "session": {
                    "type": "realtime", "instructions": f"{i} " + "x" * 16000}})))
            await writer.drain()
            await wait_until(lambda: not app[REGISTRY_KEY].calls, 30, "the socket to be dropped")
            closed = app[REGISTRY_KEY].metrics.sessions_closed.labels("client_not_reading")
            assert closed._value.get() == 1
        finally:
            writer.transport.abort()


async def silent_reader(port: int, path: str) -> asyncio.StreamWriter:
    """A WebSocket client that completes the handshake and then reads nothing, with a 4 KiB
    receive buffer: what the server sends stays with the server."""
    import base64 as b64lib
    import os
    import socket

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    reader, writer = await asyncio.open_connection(sock=sock)
    key = b64lib.b64encode(os.urandom(16)).decode()
    writer.write((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    status = await reader.readuntil(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 101"), status
    writer.transport.pause_reading()  # and nothing more is ever read
    return writer


def masked_text(text: str) -> bytes:
    """One client text frame (RFC 6455: clients mask)."""
    import os
    import struct

    payload = text.encode()
    mask = os.urandom(4)
    head = bytes([0x81])
    n = len(payload)
    head += bytes([0x80 | n]) if n < 126 else bytes([0x80 | 126]) + struct.pack("!H", n) if n < 65536 \
        else bytes([0x80 | 127]) + struct.pack("!Q", n)
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


async def test_a_vanished_client_frees_its_slot_when_the_socket_says_so_or_pings_go_unanswered():
    """A socket that goes away without a word (its peer silent, the network frozen) is noticed by
    the WebSocket pings: a GA session ends at once, a duplex one after the resume window."""
    from realtime_ws_support import TcpRelay

    async with running_server(websocket={"heartbeat_s": 0.5}, session={"resume_window_s": 1.0}) as (url, app):
        for query in ("", "?duplex=1"):
            relay = await TcpRelay(int(url.rsplit(":", 1)[1])).start()
            async with aiohttp.ClientSession() as http:
                ws = await http.ws_connect(f"ws://127.0.0.1:{relay.port}/v1/realtime{query}", autoping=False)
                await ws.receive(timeout=10)  # session.created
                await wait_until(lambda: app[REGISTRY_KEY].calls, 10, "the session")
                relay.freeze()  # nothing passes any more, and nothing is closed
                await wait_until(lambda: not app[REGISTRY_KEY].calls, 30, "the slot to be freed")
                await ws.close()
            await relay.close()


async def test_shutdown_closes_the_sockets_cleanly():
    """SIGTERM's path (the app's shutdown): every socket session ends with its close reason and
    the going-away close code, a duplex one included (its resume is no longer possible)."""
    async with aiohttp.ClientSession() as http:
        async with running_server() as (url, app):
            ga = await RawSocket.connect(http, f"{url}/v1/realtime")
            duplex = await RawSocket.connect(http, f"{url}/v1/duplex")
            await ga.wait("session.created")
            await duplex.wait("session.created")
            registry = app[REGISTRY_KEY]
        assert await ga.closed() == 1001 and await duplex.closed() == 1001
        assert duplex.of("session.closed")[0]["reason"] == "server_shutdown"
        assert registry.metrics.sessions_closed.labels("server_shutdown")._value.get() == 2
