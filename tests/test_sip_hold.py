"""Hold and resume: the server puts a baresip caller on hold (re-INVITE a=inactive) and takes it off again.

While held the session's uplink clock stands still: no windows reach the engine and none is counted
as an underrun, the media timeout does not end the call, and resuming does not read the held time
as late audio.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from conftest import running_server, speech_fixture, synthesize, wait_until
from contract import check_response
from sip_tools import RATE, LoopbackCapture, to_8k
from test_rtc_echo import best_match
from test_sip_transfer import BARESIP_PORTS, baresip_config
from test_sip_gateway import (KEYED, OPERATOR, EventTap, answered_session, gateway_overrides, received_audio,  # noqa: F401
                              registered, speech_8k, stack)

from lychee_rtc.session.event_stream import EventChannel
from lychee_rtc.session.native import NativeDialect

pytestmark = pytest.mark.timeout(600)


async def post(url: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}{path}", json=body or {}, headers=OPERATOR) as resp:
            raw = await resp.read()
            check_response("/v1/telephony/calls/{call}/" + path.rsplit("/", 1)[1], "POST", resp.status, resp.headers, raw)
            return resp.status, json.loads(raw)


async def test_caller_is_held_and_resumed_without_underruns_or_timeout(stack, tmp_path, speech_8k):
    conf = baresip_config(tmp_path, speech_8k)
    async with running_server("configs/telephony.yaml", server=KEYED, gateway=gateway_overrides(stack),
                              session={"media_timeout_s": 2, "window_grace_ms": 400}) as (url, app):
        await registered(app)
        proc = await asyncio.create_subprocess_exec(
            "baresip", "-f", str(conf), "-e", f"/dial {stack.bot_uri}", "-t", "120",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        try:
            (call,) = await answered_session(app)
            tap = EventTap()
            NativeDialect(call.session, EventChannel(tap)).attach()
            clock = call.session.window_clock.counters
            await wait_until(lambda: clock.windows >= 3, 60, "the uplink to run")
            sid = call.session.id
            assert (await post(url, f"/v1/telephony/calls/{sid}/hold", {"direction": "bogus"}))[0] == 400
            assert (await post(url, "/v1/telephony/calls/sess_nope/hold"))[0] == 404
            status, body = await post(url, f"/v1/telephony/calls/{sid}/hold", {"direction": "inactive"})
            assert status == 200 and body == {"session_id": sid, "held": True, "changed": True}
            assert call.session.on_hold and tap.of("call.hold")[-1]["held"] is True
            assert call.session.responses.active is None and call.session.sink.depth_ms == 0  # nothing queued
            windows, underruns = clock.windows, clock.underruns
            # Three seconds of the server's own paced output go by: more than the media timeout.
            sent = call.track.counters.frames
            await wait_until(lambda: call.track.counters.frames >= sent + 150, 60, "3 s on hold")
            assert not call.session.closed, call.session.close_reason
            assert (clock.windows, clock.underruns) == (windows, underruns)
            status, body = await post(url, f"/v1/telephony/calls/{sid}/unhold")
            assert status == 200 and body["held"] is False and not call.session.on_hold
            await wait_until(lambda: clock.windows >= windows + 3, 60, "the uplink to run again")
            assert clock.underruns - underruns <= 2, "the held time was counted as underruns"
            assert [e["held"] for e in tap.of("call.hold")] == [True, False]
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()


async def test_music_on_hold_reaches_the_held_caller(stack, tmp_path, speech_8k):
    """With gateway.janus.hold_audio, hold is a=sendonly and the caller hears the music, looped."""
    music_text = "Wait, stop, stop please, I have a question for you."
    music_path = speech_fixture(music_text, "en+f3")
    music = to_8k(synthesize(music_text, voice="en+f3"), 48000)
    conf = baresip_config(tmp_path, speech_8k)
    async with running_server("configs/telephony.yaml", server=KEYED, gateway=gateway_overrides(stack, hold_audio=str(music_path)),
                              session={"window_grace_ms": 400}) as (url, app):
        await registered(app)
        async with LoopbackCapture(tmp_path / "caller.pcap", "udp dst portrange %d-%d" % BARESIP_PORTS) as capture:
            proc = await asyncio.create_subprocess_exec(
                "baresip", "-f", str(conf), "-e", f"/dial {stack.bot_uri}", "-t", "120",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            try:
                (call,) = await answered_session(app)
                await wait_until(lambda: call.session.window_clock.counters.windows >= 3, 60, "the uplink to run")
                status, body = await post(url, f"/v1/telephony/calls/{call.session.id}/hold")
                assert status == 200 and body["held"] is True
                held_at = time.time()
                # Two rounds of the music, by the server's own paced output.
                sent = call.track.counters.frames
                rounds = 2 * len(music) / RATE
                await wait_until(lambda: call.track.counters.frames >= sent + 50 * rounds, 90, "the music to play")
                resumed_at = time.time()
                assert (await post(url, f"/v1/telephony/calls/{call.session.id}/unhold"))[0] == 200
                rtp = await capture.stop()
            finally:
                if proc.returncode is None:
                    proc.kill()
                    await proc.wait()
    on_hold = [p for p in rtp if held_at <= p.arrival <= resumed_at]
    heard = best_match(received_audio(on_hold), music, RATE)
    print(f"music on hold correlation {heard:.2f}")
    print(f"music correlation {heard:.3f}")
    assert heard > 0.9, f"music correlation {heard:.2f}"
