"""The realtime WebSocket through the cluster entry, without Ray: two real servers stand as the
workers (each with its worker id in its session ids, as a worker's server has), registered with the
entry's fleet by hand; the path through Ray is in test_cluster.py. The ``openai`` SDK is placed on a
worker and relayed; vLLM-Omni's DuplexClient, whose connection through the entry drops, resumes on
the worker that holds its session; a full worker refuses at the handshake and the next one is asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from contextlib import asynccontextmanager
from typing import AsyncIterator

import aiohttp
from aiohttp import web
from conftest import PATIENT_WINDOWS, free_port, running_server, synthesize, wait_until
from openai import AsyncOpenAI

from lychee_rtc.cluster.entry import create_entry_app
from lychee_rtc.cluster.ids import session_prefix
from lychee_rtc.cluster.routing import FLEET_KEY
from lychee_rtc.config import load_settings
from lychee_rtc.server.app import REGISTRY_KEY
from realtime_ws_support import (RATE, TcpRelay, audio_of, b64, chunks, echo_similarity, from_pcm16,
                                 load_duplex_client, resample, to_pcm16)
from test_cluster_units import _status
from test_openai_realtime import KEY, assert_ga_events_valid

SPEECH = "Hello there. This is a test of the echo engine, one two three."


@asynccontextmanager
async def cluster(workers: dict[str, dict]) -> AsyncIterator[tuple[str, dict[str, web.Application]]]:
    """An entry in front of real servers, one per worker id, with the given session settings."""
    async with contextlib.AsyncExitStack() as stack:
        apps: dict[str, web.Application] = {}
        urls: dict[str, str] = {}
        for worker, session in workers.items():
            url, app = await stack.enter_async_context(
                running_server(server={"auth_token": KEY}, session={**PATIENT_WINDOWS, **session}))
            app[REGISTRY_KEY].id_prefix = session_prefix(worker)
            apps[worker], urls[worker] = app, url
        entry_app = create_entry_app(load_settings(None, environ={}, overrides={"server": {"auth_token": KEY}}))
        entry_app.on_startup.clear()  # no Ray: the fleet's workers are set by hand
        entry_app.on_cleanup.clear()
        fleet = entry_app[FLEET_KEY]
        fleet.http = aiohttp.ClientSession(auto_decompress=False)
        for worker in workers:
            view = fleet.registry.add(worker, None)
            view.status, view.state = _status(worker, workers[worker].get("max_sessions", 4),
                                              workers[worker].get("max_sessions", 4), url=urls[worker]), "ready"
        runner = web.AppRunner(entry_app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        try:
            yield f"http://127.0.0.1:{port}", apps
        finally:
            await fleet.http.close()
            await runner.cleanup()


async def test_the_openai_sdk_through_the_entry_and_a_full_worker_refused_at_the_handshake():
    speech = synthesize(SPEECH, rate=RATE)
    async with cluster({"w0": {"max_sessions": 1}, "w1": {"max_sessions": 1}}) as (entry, apps):
        client = AsyncOpenAI(api_key=KEY, base_url=f"{entry}/v1", max_retries=0)
        seen: list[dict] = []
        async with client.realtime.connect(model="gpt-realtime") as first:
            created = json.loads(await first.recv_bytes())
            holder = "w0" if created["session"]["id"].startswith("sess_" + session_prefix("w0")) else "w1"
            assert created["session"]["id"] in apps[holder][REGISTRY_KEY].calls
            # The entry's count says the holder is full: the next socket goes to the other worker.
            async with client.realtime.connect(model="gpt-realtime") as conn:
                seen.append(json.loads(await conn.recv_bytes()))
                other = next(w for w in apps if w != holder)
                assert seen[0]["session"]["id"] in apps[other][REGISTRY_KEY].calls
                for piece in chunks(to_pcm16(speech) + bytes(2 * RATE * 2), 100):
                    await conn.input_audio_buffer.append(audio=b64(piece))
                    await asyncio.sleep(0.1)
                while seen[-1]["type"] != "response.done":
                    seen.append(json.loads(await asyncio.wait_for(conn.recv_bytes(), 60)))
            async with aiohttp.ClientSession() as http:  # a key the entry checks itself
                try:
                    await http.ws_connect(f"{entry.replace('http', 'ws')}/v1/realtime",
                                          headers={"Authorization": "Bearer wrong"})
                    raise AssertionError("a wrong key opened a socket")
                except aiohttp.WSServerHandshakeError as refused:
                    assert refused.status == 401
        await client.close()
    assert echo_similarity(speech, from_pcm16(audio_of(seen))) > 0.8
    assert_ga_events_valid(seen)


async def test_the_duplex_client_resumes_through_the_entry_on_the_worker_that_holds_it():
    duplex = load_duplex_client()
    speech = synthesize(SPEECH, rate=16000)
    async with cluster({"w0": {}, "w1": {}}) as (entry, apps):
        relay = await TcpRelay(int(entry.rsplit(":", 1)[1])).start()
        collector = duplex.EventCollector()

        async def connect(url: str):  # DuplexClient sends no key; the constructor's hook adds one
            import websockets
            return await websockets.connect(url, additional_headers={"Authorization": f"Bearer {KEY}"},
                                            max_size=None)

        try:
            async with duplex.DuplexClient(f"ws://127.0.0.1:{relay.port}", model="lychee-fd",
                                           connect=connect) as client:
                collecting = asyncio.ensure_future(collector.consume(client))
                sid = client.session_id
                holder = next(w for w, app in apps.items() if sid in app[REGISTRY_KEY].calls)
                relay.sever()  # before anything is said: the client resumes, through the entry
                await wait_until(lambda: collector.count("connection.resumed"), 30, "the resume")
                await client.stream_pcm(to_pcm16(speech) + bytes(2 * 16000 * 2))
                responses = client.responses()
                response = await asyncio.wait_for(anext(responses), 60)
                while response.decision == "listen":
                    response = await asyncio.wait_for(anext(responses), 60)
                heard = b"".join([chunk async for chunk in response.audio()])
                call = apps[holder][REGISTRY_KEY].calls[sid]
                assert call.counters.sockets == 2  # the same session, on its own worker, a second socket
            await asyncio.wait_for(collecting, 10)
        finally:
            await relay.close()
    assert not collector.errors()
    assert echo_similarity(resample(speech, 16000, 24000), from_pcm16(heard)) > 0.8
