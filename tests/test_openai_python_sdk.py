"""The official ``openai`` Python SDK (pinned in the ``test`` extra) against this server, unmodified
apart from its base URL and key: it creates a call from an aiortc offer (multipart, with a session),
drives it over the sideband WebSocket as an application server would, and hangs it up. Every event
either side receives is checked against our schema and the SDK's own models of the server events.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
from conftest import running_server
from openai import AsyncOpenAI
from websockets.exceptions import ConnectionClosedOK

from lychee_rtc.bench.client import RtcClient
from lychee_rtc.server.app import REGISTRY_KEY
from test_openai_realtime import KEY, assert_ga_events_valid, strip_candidates

SILENCE = np.zeros(48000, np.float32)


async def next_event(conn, event_type: str, seen: list[dict], timeout: float = 30.0):
    """Read the sideband until an event of ``event_type`` arrives (every event read is kept).

    ``seen`` keeps each event as it came over the wire: the SDK builds its objects without
    validating them, so ``assert_ga_events_valid`` checks the raw JSON (our schema, the SDK's models).
    """

    async def read():
        while True:
            raw = await conn.recv_bytes()
            seen.append(json.loads(raw))
            event = conn.parse_event(raw)
            if event.type == event_type:
                return event

    return await asyncio.wait_for(read(), timeout)


async def read_until_closed(conn, seen: list[dict]) -> None:
    """Keep every event until the server closes the sideband normally."""
    while True:
        try:
            seen.append(json.loads(await conn.recv_bytes()))
        except ConnectionClosedOK:
            return


async def test_python_sdk_creates_drives_and_hangs_up_a_call(utterance):
    async with running_server(server={"auth_token": KEY}) as (url, app):
        openai = AsyncOpenAI(api_key=KEY, base_url=f"{url}/v1", max_retries=0)
        peer = RtcClient(url, channel_label="oai-events")
        try:
            offer = strip_candidates(await peer.make_offer())
            answer = await openai.realtime.calls.create(
                sdp=offer, session={"type": "realtime", "model": "gpt-realtime", "instructions": "Be brief."})
            # The SDK returns the answer; the call id is in the Location header.
            call_id = answer.response.headers["location"].rsplit("/", 1)[1]
            assert answer.response.status_code == 201 and call_id in app[REGISTRY_KEY].calls
            await peer.accept_answer(answer.text, timeout=30)
            created = await peer.wait_event("session.created")
            assert created["session"]["instructions"] == "Be brief."

            seen: list[dict] = []
            async with openai.realtime.connect(call_id=call_id) as conn:
                await next_event(conn, "session.created", seen)
                # The application server changes the agent's set-up; the browser side sees it too.
                await conn.session.update(session={"type": "realtime", "instructions": "Be very brief."})
                updated = await next_event(conn, "session.updated", seen)
                assert updated.session.instructions == "Be very brief."
                await peer.wait_event("session.updated")

                # The caller speaks; the sideband follows the call and cancels the answer.
                peer.mic.feed(utterance)
                peer.mic.feed(SILENCE)
                response = await next_event(conn, "response.created", seen, timeout=60)
                await next_event(conn, "output_audio_buffer.started", seen)
                await conn.response.cancel()
                done = await next_event(conn, "response.done", seen)
                assert done.response.id == response.response.id and done.response.status == "cancelled"
                await peer.wait_event("output_audio_buffer.cleared", response_id=response.response.id)

                await openai.realtime.calls.hangup(call_id)
                assert call_id not in app[REGISTRY_KEY].calls
                # The sideband ends with the call.
                await asyncio.wait_for(read_until_closed(conn, seen), 10)
            assert_ga_events_valid(seen)
            assert_ga_events_valid(peer.events)
        finally:
            await peer.close()
            await openai.close()


async def test_a_sideband_joining_mid_answer_gets_that_answer_announced_and_done(long_utterance):
    async with running_server(server={"auth_token": KEY}) as (url, app):
        openai = AsyncOpenAI(api_key=KEY, base_url=f"{url}/v1", max_retries=0)
        peer = RtcClient(url, channel_label="oai-events")
        try:
            answer = await openai.realtime.calls.create(sdp=strip_candidates(await peer.make_offer()))
            call_id = answer.response.headers["location"].rsplit("/", 1)[1]
            await peer.accept_answer(answer.text, timeout=30)
            await peer.wait_event("session.created")
            # The answer (an echo of several seconds of speech) is already playing when the
            # application server attaches.
            peer.mic.feed(long_utterance)
            peer.mic.feed(SILENCE)
            started = await peer.wait_event("output_audio_buffer.started", timeout=60)
            rid = started["response_id"]
            seen: list[dict] = []
            async with openai.realtime.connect(call_id=call_id) as conn:
                await next_event(conn, "session.created", seen)
                created = await next_event(conn, "response.created", seen)
                assert created.response.id == rid
                done = await next_event(conn, "response.done", seen)
                assert done.response.id == rid and done.response.status == "completed"
                # Announced once, with its item, and the item completed.
                assert [e["type"] for e in seen].count("response.created") == 1
                assert done.response.output[0].id == created.response.id.replace("resp_", "item_", 1)
                await openai.realtime.calls.hangup(call_id)
            assert_ga_events_valid(seen)
        finally:
            await peer.close()
            await openai.close()
