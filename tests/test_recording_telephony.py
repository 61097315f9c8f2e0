"""A recorded phone call (a carrier media stream) with a barge-in: the agent channel is what the
carrier played to the caller, cut where the flush reached it; the caller channel is what the phone
sent. Both are checked on the recording's own clock (the server's monotonic clock, shared with the
carrier emulator in this process), read back with libsndfile."""

from __future__ import annotations

import asyncio
import time

import numpy as np
from conftest import wait_until
from recording_support import correlation_at, fetch_recording, lag_of, last_sound_before
from telephony_support import APP_AUTH, EventStream, carrier, spec
from test_telephony import at_rate, phone_server, silence

from lychee_rtc.pcm import PcmResampler
from lychee_rtc.server.app import REGISTRY_KEY

PHONE_RATE = 8000
FRAME_8K = PHONE_RATE // 50


def to_8k(x48k: np.ndarray) -> np.ndarray:
    r = PcmResampler(48000, PHONE_RATE)
    return np.concatenate([r.process(x48k), r.flush()])


def heard_timeline(phone, t0: float, length: int) -> np.ndarray:
    """What the emulated carrier played, placed at its play times on the recording's clock (8 kHz)."""
    out = np.zeros(length, np.float32)
    for a in phone.log.audio:
        end = a.play_start + len(a.samples) / PHONE_RATE
        if a.cut_at is not None:
            end = min(end, a.cut_at)
        start = round((a.play_start - t0) * PHONE_RATE)
        n = max(0, min(len(a.samples), round((end - a.play_start) * PHONE_RATE), length - start))
        out[start:start + n] = a.samples[:n]
    return out


async def test_a_phone_call_with_a_barge_in_is_recorded_as_the_caller_heard_it(tmp_path, long_utterance,
                                                                               interjection):
    recording = {"enabled": True, "directory": str(tmp_path)}
    async with phone_server(recording=recording) as (url, app):
        phone = carrier(url, "twilio")
        await phone.connect()
        events = EventStream(url, spec("twilio")["call_id"])
        try:
            await events.connect()
            registry = app[REGISTRY_KEY]
            await wait_until(lambda: registry.calls, 30, "the call to be registered")
            session_id = next(iter(registry.calls))
            t0 = registry.recordings.active[session_id].t0
            said = np.concatenate([silence(PHONE_RATE, 0.3), at_rate(long_utterance, PHONE_RATE),
                                   silence(PHONE_RATE, 1.0)])
            await phone.play(said)
            said_from = phone.send_times[0][1]
            started = await events.wait("output_audio_buffer.started", timeout=40)
            await wait_until(lambda: phone.played_ms(time.monotonic()) > 1200, 30, "a second of the answer heard")
            talk = asyncio.create_task(phone.play(np.concatenate([at_rate(interjection, PHONE_RATE),
                                                                  silence(PHONE_RATE, 1.0)])))
            await events.wait("output_audio_buffer.cleared", timeout=20)
            await wait_until(lambda: phone.log.clears, 20, "the flush reaching the carrier")
            await talk
            await phone.hang_up()
            await events.wait("session.closed", timeout=20)
            audio, sidecar = await fetch_recording(url, session_id, APP_AUTH)  # a carrier call: the server key
        finally:
            await events.close()
            await phone.close()

    caller, agent = to_8k(audio[:, 0]), to_8k(audio[:, 1])
    heard = heard_timeline(phone, t0, len(agent))
    # The agent channel is what the caller heard, where they heard it: no shift to find.
    assert abs(lag_of(heard, agent, hop=8)) <= FRAME_8K
    assert correlation_at(heard, agent, 0, hop=80) > 0.9
    clear_at = round((phone.log.clears[0] - t0) * PHONE_RATE)
    heard_stop = last_sound_before(heard, clear_at + PHONE_RATE // 2, hop=FRAME_8K // 4)
    recorded_stop = last_sound_before(agent, clear_at + PHONE_RATE // 2, hop=FRAME_8K // 4)
    assert heard_stop > round((started_at(sidecar) - 0.5) * PHONE_RATE)
    assert abs(recorded_stop - heard_stop) <= FRAME_8K, (recorded_stop, heard_stop)
    # Sent ahead but flushed: never heard, so never recorded.
    after = agent[recorded_stop + FRAME_8K:clear_at + PHONE_RATE // 4]
    assert np.max(np.abs(after), initial=0.0) < 0.01

    # The caller channel is what the phone sent, from when it sent it (within the uplink's jitter).
    said_at = round((said_from - t0) * PHONE_RATE)
    lag = lag_of(np.concatenate([np.zeros(said_at), said, np.zeros(len(caller))]), caller, hop=8)
    assert abs(lag) < PHONE_RATE // 10, lag
    assert correlation_at(said, caller[said_at:said_at + len(said)], 0, hop=80) > 0.8

    cut = next(e for e in sidecar if e["type"] == "output_audio_buffer.cleared")
    assert cut["played_ms"] > 1000
    assert abs(cut["t"] * PHONE_RATE - clear_at) < PHONE_RATE // 10


def started_at(sidecar: list[dict]) -> float:
    return next(e["t"] for e in sidecar if e["type"] == "output_audio_buffer.started")
