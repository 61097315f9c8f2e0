"""vLLM-Omni's duplex dialect of the realtime WebSocket (``/v1/realtime?duplex=1``, ``/v1/duplex``),
driven by vLLM-Omni 0.30.0's own ``DuplexClient`` (loaded from its package without vLLM, see
``load_duplex_client``) and by a plain socket client for what it does not send.
"""

from __future__ import annotations

import asyncio
import base64

import aiohttp
from conftest import PATIENT_WINDOWS, running_server, synthesize, wait_until

from lychee_rtc.server.app import REGISTRY_KEY
from realtime_ws_support import (RawSocket, TcpRelay, echo_similarity, from_pcm16, load_duplex_client, resample,
                                 to_pcm16)

QUESTION = "Hello there. This is a test of the echo engine, one two three."
LONG = ("The quick brown fox jumps over the lazy dog, and then it runs far away across the green hills "
        "towards the river, where it rests until the evening comes.")


def assert_numbered(events: list[dict]) -> None:
    """Every event but the two about a socket carries a rising server_event_seq and the epoch."""
    seqs = [e["server_event_seq"] for e in events if e["type"] not in ("session.resumed", "session.replaced")]
    assert len(seqs) == len([e for e in events if e["type"] not in ("session.resumed", "session.replaced")])
    assert seqs == sorted(set(seqs))
    assert all(isinstance(e.get("epoch"), int) for e in events if "server_event_seq" in e)


async def test_the_duplex_client_converses_and_acknowledges_playback():
    duplex = load_duplex_client()
    question = synthesize(QUESTION, rate=16000)
    async with running_server(session=PATIENT_WINDOWS) as (url, app):
        collector = duplex.EventCollector()
        async with duplex.DuplexClient(url.replace("http", "ws"), model="lychee-fd") as client:
            collecting = asyncio.ensure_future(collector.consume(client))
            assert client.resume_token and client.session_id.startswith("sess_")
            caps = client.session_info["capabilities"]
            assert caps["chunk_period_ms"] == 400 and caps["supports_session_resume"] is True
            sent_at = asyncio.get_running_loop().time()
            await client.stream_pcm(to_pcm16(question) + bytes(2 * 16000 * 2))
            responses = client.responses()
            response = await asyncio.wait_for(anext(responses), 60)
            while response.decision == "listen":
                response = await asyncio.wait_for(anext(responses), 60)
            heard = b"".join([chunk async for chunk in response.audio()])
            await client.ack_playback(response.played_ms)  # no ids: the answer just heard
            await wait_until(lambda: collector.count("playback.acknowledged"), 10, "the acknowledgement")
            registry = app[REGISTRY_KEY]
            (call,) = registry.calls.values()
            record = call.session.responses.ledger.get(response.response_id)
            assert record.client_played_ms == int(response.played_ms)
        await asyncio.wait_for(collecting, 10)
        await wait_until(lambda: not registry.calls, 10, "the session to end with session.close")
    events = collector.events
    types = [e["type"] for e in events]
    assert "response.speak" in types and "session.closed" == types[-1] and not collector.errors()
    assert types.index("response.speak") < types.index("response.output_audio.delta")
    assert_numbered(events)
    assert echo_similarity(resample(question, 16000, 24000), from_pcm16(heard)) > 0.8
    # vLLM-Omni's own timing summary reads the deltas' cumulative audio_duration_ms.
    timing = collector.timing_summary(after_s=0.0, response_id=response.response_id)["request_metrics"]
    assert timing["audio_duration_ms"] == round(1000 * len(heard) / 2 / 24000, 1) or \
        abs(timing["audio_duration_ms"] - 1000 * len(heard) / 2 / 24000) < 1
    assert timing["ttfp_ms"] >= 0 and sent_at


async def test_a_dropped_connection_is_resumed_by_the_client_with_nothing_lost():
    duplex = load_duplex_client()
    speech = synthesize(LONG, rate=16000)
    async with running_server(session=PATIENT_WINDOWS) as (url, app):
        relay = await TcpRelay(int(url.rsplit(":", 1)[1])).start()
        collector = duplex.EventCollector()
        try:
            async with duplex.DuplexClient(f"ws://127.0.0.1:{relay.port}", model="lychee-fd") as client:
                collecting = asyncio.ensure_future(collector.consume(client))
                first_token = client.resume_token
                await client.stream_pcm(to_pcm16(speech) + bytes(16000 * 2))
                responses = client.responses()
                response = await asyncio.wait_for(anext(responses), 60)
                while response.decision == "listen":
                    response = await asyncio.wait_for(anext(responses), 60)
                chunks = response.audio()
                heard = bytearray(await asyncio.wait_for(anext(chunks), 30))
                relay.sever()  # mid-answer, the network drops: the client resumes by itself
                async for chunk in chunks:
                    heard += chunk
                await wait_until(lambda: collector.count("connection.resumed"), 30, "the resume")
                assert client.resume_token != first_token  # rotated on every resume
                (call,) = app[REGISTRY_KEY].calls.values()
                assert call.counters.sockets == 2 and relay.accepted == 2
            await asyncio.wait_for(collecting, 10)
        finally:
            await relay.close()
    assert response.done_event.raw["response"]["status"] == "completed"
    assert not collector.errors()
    # Nothing missing, nothing twice: the answer is the whole echo.
    assert echo_similarity(resample(speech, 16000, 24000), from_pcm16(bytes(heard))) > 0.8
    assert len(heard) / 2 / 24000 > 0.8 * len(speech) / 16000
    assert_numbered([e for e in collector.events if e["type"] != "connection.resumed"])


def ws_url(url: str, query: str = "duplex=1&autostart=0") -> str:
    return f"{url}/v1/realtime?{query}"


async def test_the_duplex_protocol_raw_resume_replace_journal_and_errors():
    async with running_server(session=PATIENT_WINDOWS, websocket={"first_message_timeout_s": 2}) as (url, app):
        async with aiohttp.ClientSession() as http:
            # A bare connection on /v1/duplex starts a session at once.
            auto = await RawSocket.connect(http, f"{url}/v1/duplex?model=anything")
            created = await auto.wait("session.created")
            assert created["server_event_seq"] == 1 and created["attachment_generation"] == 1
            assert created["session"]["audio"]["input"]["format"] == {"type": "pcm16", "rate": 16000}
            await auto.send({"type": "session.heartbeat", "event_id": "h1"})
            await auto.wait("session.heartbeat_ack")
            await auto.send({"type": "input.text.append", "event_id": "t1", "text": "hi"})
            await auto.send({"type": "playback.ack", "event_id": "p1", "item_id": "item_x", "response_id": "resp_y",
                             "played_ms": 10})
            await auto.send({"type": "turn.signal", "event_id": "s1", "event": "barge_in"})
            await auto.send({"type": "session.update", "event_id": "u1", "session": {"turn_detection": {
                "type": "semantic_vad"}}})
            await auto.send({"type": "input_audio_buffer.commit", "is_speech": False})
            await wait_until(lambda: len(auto.of("error")) >= 3 and auto.of("turn.event") and auto.of("response.listen"),
                             10, "the answers")
            codes = {e["error"]["event_id"]: e["error"]["code"] for e in auto.of("error")}
            assert codes == {"t1": "native_text_append_unsupported", "p1": "playback_item_mismatch",
                             "u1": "unsupported_turn_detection"}
            assert auto.of("turn.event")[0]["event"] == "barge_in"

            # A resume with the right token, while the old socket still stands: the old one is
            # replaced, the new one gets what the client says it has not seen.
            sid, token = created["session"]["id"], created["resume_token"]
            seen = created["server_event_seq"]
            second = await RawSocket.connect(http, ws_url(url))
            await second.send({"type": "session.resume", "session_id": sid, "resume_token": token,
                               "last_received_server_event_seq": seen})
            resumed = await second.wait("session.resumed")
            assert "server_event_seq" not in resumed and resumed["attachment_generation"] == 2
            assert resumed["resume_token"] != token
            assert await auto.closed() == 1000 and auto.of("session.replaced")
            await wait_until(lambda: len(second.events) >= 1 + resumed["replayed"], 10, "the replay")
            replayed = second.events[1:1 + resumed["replayed"]]
            assert [e["server_event_seq"] for e in replayed] == [e["server_event_seq"] for e in auto.events
                                                                  if e.get("server_event_seq", 0) > seen]
            # The old token no longer opens it; a cursor behind what was acknowledged is a gap.
            for resume, code in (({"resume_token": token}, "invalid_resume_token"),
                                 ({"session_id": "sess_nothing"}, "unknown_session")):
                probe = await RawSocket.connect(http, ws_url(url))
                await probe.send({"type": "session.resume", "session_id": sid, "resume_token": resumed["resume_token"],
                                  "last_received_server_event_seq": 0, **resume})
                assert (await probe.wait("error"))["error"]["code"] == code
                assert await probe.closed() == 1008
            await second.send({"type": "session.event_ack", "server_event_seq": second.events[-1]["server_event_seq"]})
            await second.send({"type": "session.heartbeat"})
            await second.wait("session.heartbeat_ack")
            gap = await RawSocket.connect(http, ws_url(url))
            await gap.send({"type": "session.resume", "session_id": sid, "resume_token": resumed["resume_token"],
                            "last_received_server_event_seq": 1})
            assert (await gap.wait("session.resync_required"))["reason"] == "journal_gap"
            await gap.closed()
            await wait_until(lambda: not app[REGISTRY_KEY].calls, 10, "the session to end")
            late = await RawSocket.connect(http, ws_url(url))
            await late.send({"type": "session.resume", "session_id": sid, "resume_token": "x"})
            assert (await late.wait("error"))["error"]["code"] == "session_resume_expired"
            # A socket that never says what it wants is closed; so is one that starts otherwise.
            quiet = await RawSocket.connect(http, ws_url(url))
            assert (await quiet.wait("error"))["error"]["code"] == "config_timeout"
            odd = await RawSocket.connect(http, ws_url(url))
            await odd.send({"type": "response.create"})
            assert (await odd.wait("error"))["error"]["code"] == "bad_event"
            for sock in (second, quiet, odd, late):
                await sock.close()
    assert_numbered(auto.events)


async def test_a_journal_without_acknowledgements_overflows_and_a_resume_says_so():
    speech = to_pcm16(synthesize(QUESTION, rate=16000))
    async with running_server(session=PATIENT_WINDOWS, websocket={"journal_bytes": 64 << 10}) as (url, app):
        async with aiohttp.ClientSession() as http:
            sock = await RawSocket.connect(http, ws_url(url))
            await sock.send({"type": "session.update", "session": {"input_audio_format": "pcm16",
                                                                   "sample_rate_hz": 16000}})
            created = await sock.wait("session.created")
            for i in range(0, len(speech) + 3 * 32000, 6400):
                chunk = (speech + bytes(3 * 32000))[i:i + 6400]
                await sock.send({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()})
            await sock.wait("response.done")  # more than 64 KiB of audio events, none acknowledged
            await sock.ws.close()
            await wait_until(lambda: next(iter(app[REGISTRY_KEY].calls.values())).suspended_at is not None, 10,
                             "the session to wait for a resume")
            again = await RawSocket.connect(http, ws_url(url))
            await again.send({"type": "session.resume", "session_id": created["session"]["id"],
                              "resume_token": created["resume_token"], "last_received_server_event_seq": 3})
            assert (await again.wait("session.resync_required"))["reason"] == "journal_overflow"
            await again.closed()
        await wait_until(lambda: not app[REGISTRY_KEY].calls, 10, "the session to end")
