"""The realtime WebSocket (``GET /v1/realtime``) in the OpenAI GA dialect, driven by the ``openai``
SDK pinned in the ``test`` extra (``client.realtime.connect`` with ``base_url``), unmodified, and by a
plain socket client for what no SDK sends. Every event received is checked against our schema and
the SDK's own models of the server events (``assert_ga_events_valid``).
"""

from __future__ import annotations

import asyncio
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
