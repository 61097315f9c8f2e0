"""vLLM-Omni's duplex dialect of the realtime WebSocket (``/v1/realtime?duplex=1``, ``/v1/duplex``),
driven by vLLM-Omni 0.30.0's own ``DuplexClient`` (loaded from its package without vLLM, see
``load_duplex_client``) and by a plain socket client for what it does not send.
"""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
from conftest import PATIENT_WINDOWS, free_port, running_server, synthesize, wait_until

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
