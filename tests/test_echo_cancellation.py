"""A caller on speakerphone (lychee_rtc.bench.speakerphone): the agent's voice comes back through a
simulated room into the caller's microphone, 120 ms later, as loud as the caller's own speech, over
pink noise at 25 dB SNR. Real calls (aiortc over loopback) against the echo engine, which listens
with its VAD while it speaks and stops when it hears speech (barge-in).

Without the uplink processing the agent hears itself and cuts its own answer; with it, the agent
speaks for more than a minute without interrupting itself, and the caller can still interrupt it.
"""

from __future__ import annotations

import asyncio

import aiohttp
import numpy as np
import pytest
from conftest import PATIENT_WINDOWS, running_server, synthesize
from telephony_support import EventStream, carrier, get_json, spec
from test_telephony import at_rate, phone_server

from lychee_rtc.bench.client import RATE
from lychee_rtc.bench.server_process import spawned_server
from lychee_rtc.bench.speakerphone import CarrierSpeakerphone, RoomSetup, rms, speakerphone_client

ROOM = RoomSetup(echo_db=0.0, delay_ms=120.0, snr_db=25.0)
QUESTION = "Hello there. This is a test of the echo engine, one two three."  # about 4 s
# What OpenAI clients get with noise_reduction far_field: the echo canceller, noise suppression (the
# room's noise is in the microphone too) and the high-pass filter.
FAR_FIELD = {"echo_cancellation": True, "noise_suppression": True, "high_pass_filter": True}


def at_level(x: np.ndarray, level: float) -> np.ndarray:
    return (x * (level / rms(x[np.abs(x) > 0.01 * np.max(np.abs(x))]))).astype(np.float32)


def speech() -> tuple[np.ndarray, np.ndarray]:
    question = at_level(synthesize(QUESTION), ROOM.speech_rms)
    interjection = at_level(synthesize("Wait, stop, stop please, I have a question for you.", voice="en+f3"),
                            ROOM.speech_rms)
    return question, interjection


async def processing_counters(url: str) -> list:
    """What each session's uplink processing counted (to say why an agent cut itself off)."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/v1/sessions") as resp:
        return [s.get("audio_processing") for s in (await resp.json())["sessions"]]


def barge_ins(client, after: int = 0) -> list[dict]:
    return [e for e in client.events[after:] if e["type"] == "output_audio_buffer.cleared"]


async def test_without_processing_the_agent_interrupts_itself():
    question, _ = speech()
    async with running_server(engine={"echo": {"answer_repeats": 4}}, session=PATIENT_WINDOWS) as (url, _):
        client = speakerphone_client(url, ROOM)
        await client.connect()  # a browser's offer: no processing unless asked for
        try:
            created = (await client.wait_event("session.created"))["session"]["audio_processing"]
            assert not created["echo_cancellation"] and not created["noise_suppression"]
            client.mic.feed(np.zeros(RATE // 2, np.float32))
            client.mic.feed(question)
            started = await client.wait_event("output_audio_buffer.started", timeout=60)
            done = await client.wait_event("response.done", timeout=120, response_id=started["response_id"])
            # Nobody spoke after the question: the agent heard its own voice and cut itself off.
            assert done["response"]["status"] == "cancelled", "the agent finished without hearing itself"
            assert done["response"]["status_details"]["reason"] == "barge_in"
            assert client.mic.echo_energy > 0
        finally:
            await client.close()


@pytest.mark.timeout(420)
async def test_with_processing_a_minute_of_speech_without_self_interruption_and_barge_in_still_works():
    question, interjection = speech()
    # 20 times the question (about 3.7 s as heard): over a minute of agent speech in one answer. The
    # server runs in a process of its own, as it would, so the caller's room simulation and the
    # server do not hold up each other's event loop for a minute.
    env = {"LYCHEE_RTC_ENGINE__ECHO__ANSWER_REPEATS": "20", "LYCHEE_RTC_SESSION__WINDOW_GRACE_MS": "2000"}
    async with spawned_server("echo", env) as (url, _):
        client = speakerphone_client(url, ROOM)
        await client.connect(session={"audio_processing": FAR_FIELD})
        try:
            active = (await client.wait_event("session.created"))["session"]["audio_processing"]
            assert active["echo_cancellation"] and active["noise_suppression"] and active["high_pass_filter"]
            client.mic.feed(np.zeros(RATE // 2, np.float32))
            client.mic.feed(question)
            started = await client.wait_event("output_audio_buffer.started", timeout=60)
            first = client.events.index(started)
            # 66 s of downlink: over 60 s of it the answer's speech, the rest the odd underrun of a busy machine.
            await client.wait_audio(started["sample_offset"] + 66 * RATE, timeout=180)
            # Over a minute of the agent's own voice in the caller's microphone, and not one cut.
            cut = barge_ins(client, first)
            assert not cut, f"the agent interrupted itself: {cut}; processing {await processing_counters(url)}"
            assert not [e for e in client.events[first:] if e["type"] == "input_audio_buffer.speech_started"]
            assert client.mic.echo_energy > 0
            # The caller talks over the agent (double talk): that still interrupts it.
            mark = len(client.events)
            client.mic.feed(interjection)
            cleared = await client.wait_event("output_audio_buffer.cleared", timeout=60, after=mark)
            assert cleared["response_id"] == started["response_id"]
            assert cleared["played_ms"] >= 60_000
            done = await client.wait_event("response.done", timeout=60, response_id=started["response_id"])
            assert done["response"]["status_details"]["reason"] == "barge_in"
        finally:
            await client.close()


@pytest.mark.parametrize("processing", [False, True], ids=["unprocessed", "carrier_default"])
async def test_a_phone_on_speaker_behind_a_carrier(processing):
    """The same room behind a carrier (Twilio's frames, 8 kHz mu-law): the reference is what the
    pacer sent, ahead by the carrier's lead, and what a flush took back is not in it."""
    question, _ = speech()
    question = at_rate(question, 8000)
    profile = {} if processing else {"audio_processing": {"carrier": {"echo_cancellation": False}}}
    async with phone_server(engine={"echo": {"answer_repeats": 4}}, session=PATIENT_WINDOWS, **profile) as (url, _):
        phone = carrier(url, "twilio")
        await phone.connect()
        events = EventStream(url, spec("twilio")["call_id"])
        room = CarrierSpeakerphone(phone, ROOM)
        mic = asyncio.create_task(room.run())
        try:
            await events.connect()
            active = (await events.wait("session.created"))["session"]["audio_processing"]
            assert active["echo_cancellation"] is processing
            room.say(np.zeros(4000, np.float32))
            room.say(question)
            started = await events.wait("response.created", timeout=60)
            done = await events.wait("response.done", timeout=120, response_id=started["response_id"])
            assert room.echo_energy > 0
            after = events.events.index(started)
            heard_itself = [e for e in events.events[after:] if e["type"] == "input_audio_buffer.speech_started"]
            if processing:  # four times the question (about 15 s) as the caller heard it, uncut
                assert done["response"]["status"] == "completed", "the agent interrupted itself"
                assert not heard_itself
                assert done["response"]["played_ms"] > 12_000
                # The stage found the echo on the line (the engine hears the canceller only there).
                _, listing = await get_json(url, "/v1/sessions")
                assert listing["sessions"][0]["audio_processing"]["echo_detected"] is True
            else:
                assert done["response"]["status_details"]["reason"] == "barge_in"
        finally:
            mic.cancel()
            await events.close()
            await phone.close()
