"""Reconnect and resume: a client that vanishes mid-answer comes back on a new connection to the
same session (same engine slot and context, epoch counter and event sequence)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap

import aiohttp
import numpy as np

from conftest import running_server
from lychee_rtc.bench.client import RATE, RtcClient
from lychee_rtc.rtc.consent import ice_connections
from lychee_rtc.server.app import ENGINE_KEY, REGISTRY_KEY
from lychee_rtc.session.protocol import validate_server_event

# Talks, prints every event as it arrives, and is killed (no close, no BYE) while being answered.
VANISHING_TALKER = textwrap.dedent("""
    import asyncio, json, sys
    import numpy as np
    from conftest import synthesize
    from lychee_rtc.bench.client import RtcClient

    async def main():
        c = RtcClient(sys.argv[1])
        await c.connect()
        print(json.dumps({"session_id": c.session_id, "session_token": c.session_token}), flush=True)
        c.channel.on("message", lambda m: print(m, flush=True))
        c.mic.feed(np.zeros(24000, np.float32))
        c.mic.feed(synthesize("The quick brown fox jumps over the lazy dog, and then it runs far away "
                              "across the green hills towards the river."))
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


async def session_state(url: str, session_id: str, token: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/sessions/{session_id}", headers={"Authorization": f"Bearer {token}"}) as r:
            return r.status, (await r.json())


async def test_a_client_that_vanishes_mid_answer_resumes_the_same_session(utterance):
    settings = {"media_timeout_s": 1.5, "resume_window_s": 60}
    async with running_server(session=settings) as (url, app):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", VANISHING_TALKER, url, stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        resumed = None
        try:
            ids = json.loads(await asyncio.wait_for(proc.stdout.readline(), 60))
            session_id, token = ids["session_id"], ids["session_token"]
            seen: list[dict] = []
            while not any(e["type"] == "output_audio_buffer.started" for e in seen):
                seen.append(json.loads(await asyncio.wait_for(proc.stdout.readline(), 90)))
            started = next(e for e in seen if e["type"] == "output_audio_buffer.started")
            call = app[REGISTRY_KEY].calls[session_id]
            slot = call.session.slot
            proc.send_signal(signal.SIGKILL)  # mid-answer: the path is gone without a word
            await proc.wait()
            last_seq = seen[-1]["seq"]

            # The server notices (no media) and keeps the session, suspended, with its slot.
            for _ in range(600):
                status, snap = await session_state(url, session_id, token)
                if snap.get("connection_state") == "suspended":
                    break
                await asyncio.sleep(0.05)
            assert snap.get("connection_state") == "suspended", (status, snap)
            assert snap["epoch"] == 1  # the answer was cut
            assert app[ENGINE_KEY].free_slots == app[ENGINE_KEY].capabilities.max_sessions - 1
            old_pc = call.pc

            resumed = RtcClient(url)
            await resumed.connect(resume={"session_id": session_id, "session_token": token, "last_seq": last_seq})
            assert resumed.session_id == session_id
            note = await resumed.wait_event("session.resumed", timeout=30)
            assert note["lost"] == 0 and note["replayed"] >= 1 and note["session"]["epoch"] == 1
            # Events continue where the client left off, with nothing missing or repeated.
            seqs = [e["seq"] for e in resumed.events]
            assert seqs == list(range(last_seq + 1, last_seq + 1 + len(seqs)))
            done = next(e for e in resumed.events if e["type"] == "response.done")
            assert done["response_id"] == started["response_id"]
            assert done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"]["reason"] == "connection_lost"
            for event in resumed.events:
                validate_server_event(event)
            assert call.session.slot is slot and app[REGISTRY_KEY].calls[session_id] is call
            assert old_pc.connectionState == "closed"

            # The same session answers on the new connection, in the epoch it had reached.
            n = len(resumed.events)
            resumed.mic.feed(np.zeros(RATE // 2, np.float32))
            resumed.mic.feed(utterance)
            answer = await resumed.wait_event("output_audio_buffer.started", timeout=60, after=n)
            assert answer["epoch"] == 1 and answer["response_id"] != started["response_id"]
            finished = await resumed.wait_event("response.done", timeout=60, after=n)
            assert finished["response"]["status"] == "completed"
            # No audio of the cut answer reached the new connection before the new one began.
            before = resumed.received.signal(0, answer["sample_offset"] - RATE // 50)
            assert len(before) == 0 or np.max(np.abs(before)) < 0.01
            status, snap = await session_state(url, session_id, token)
            assert snap["counters"]["resumes"] == 1
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            if resumed is not None:
                await resumed.close()


async def test_a_resume_needs_the_token_and_the_window():
    async with running_server(session={"media_timeout_s": 1.0, "resume_window_s": 1.5}) as (url, app):
        first = RtcClient(url)
        await first.connect()
        session_id, token = first.session_id, first.session_token
        await first.wait_event("session.created")
        # The first connection vanishes: its sockets go quiet, nothing is said.
        for connection in ice_connections(first.pc):
            for protocol in connection._protocols:
                protocol.transport.close()
        try:
            other = RtcClient(url)
            try:
                await other.connect(resume={"session_id": session_id, "session_token": "stok_wrong", "last_seq": 0})
            except RuntimeError as exc:
                assert "401" in str(exc)
            else:
                raise AssertionError("a wrong token resumed the session")
            finally:
                await other.close()
            # Past the window the session is gone, with its slot.
            for _ in range(400):
                if session_id not in app[REGISTRY_KEY].calls:
                    break
                await asyncio.sleep(0.05)
            assert session_id not in app[REGISTRY_KEY].calls
            assert app[ENGINE_KEY].free_slots == app[ENGINE_KEY].capabilities.max_sessions
            late = RtcClient(url)
            try:
                await late.connect(resume={"session_id": session_id, "session_token": token, "last_seq": 0})
            except RuntimeError as exc:
                assert "404" in str(exc)
            else:
                raise AssertionError("a session resumed after its window")
            finally:
                await late.close()
        finally:
            await first.close()
