"""Phone calls over carrier media streams, against the real server and the echo engine.

Each carrier's dialect is exercised with frames written from its public documentation (the JSON
fixtures in tests/fixtures/telephony/), played by a carrier emulator that also plays the carrier's
part in playout: it "plays" what it receives in real time and echoes marks when their audio has
played, or at once on a flush where the carrier does. The application side is the call's event
stream (our events vocabulary over a WebSocket).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest
from conftest import PATIENT_WINDOWS, running_server, synthesize
from telephony_support import (
    APP_KEY,
    CREDENTIALS,
    PROVIDERS,
    EventStream,
    carrier,
    get_json,
    media_url,
    spec,
    until,
)
from strict import unavailable
from test_rtc_echo import best_match, through_16k

from lychee_rtc.bench.carrier import CarrierEmulator
from lychee_rtc.pcm import PcmResampler
from lychee_rtc.server.app import REGISTRY_KEY
from lychee_rtc.session.protocol import validate_server_event
from lychee_rtc.telephony.auth import TWILIO_SIGNATURE

TELEPHONY = dict(CREDENTIALS)


@pytest.fixture(scope="module")
def short_utterance() -> np.ndarray:
    return synthesize("Hello there, one two three.")  # 48 kHz


def at_rate(x48k: np.ndarray, rate: int) -> np.ndarray:
    r = PcmResampler(48000, rate)
    return np.concatenate([r.process(x48k), r.flush()])


def silence(rate: int, seconds: float) -> np.ndarray:
    return np.zeros(int(rate * seconds), np.float32)


def phone_server(**overrides):
    """A server that takes carrier calls, with the application's server key (APP_KEY): the key that
    opens a carrier call's event stream."""
    telephony = {**TELEPHONY, **overrides.pop("telephony", {})}
    server = {"auth_token": APP_KEY, **overrides.pop("server", {})}
    return running_server(telephony=telephony, server=server, **overrides)


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_call_both_ways(provider, short_utterance):
    """Start, the caller's speech in, the echo engine's answer out in the carrier's format, hang-up."""
    async with phone_server() as (url, app):
        phone = carrier(url, provider)
        await phone.connect()
        events = EventStream(url, spec(provider)["call_id"])
        try:
            await events.connect()
            speech = at_rate(short_utterance, phone.rate)
            await phone.play(np.concatenate([silence(phone.rate, 0.3), speech, silence(phone.rate, 1.2)]))
            done = await events.wait("response.done", timeout=40)
            assert done["response"]["status"] == "completed"
            assert not phone.log.unexpected, f"frames the carrier does not accept: {phone.log.unexpected[:3]}"
            for event in events.events:
                validate_server_event(event)
            assert events.events[0]["type"] == "session.created"

            # The answer is the utterance, decodable at the carrier's rate (a wrong rate or encoding
            # would change its length or destroy it).
            heard = phone.heard()
            assert abs(len(heard) - len(speech)) < 0.4 * phone.rate
            assert best_match(at_rate_up(heard, phone.rate), through_16k(short_utterance)) > 0.7
            sizes = {len(a.samples) * (2 if phone.encoding == "pcm16" else 1) for a in phone.log.audio}
            audio = spec(provider)["audio"]
            if "out_bytes" in audio:
                assert sizes == {audio["out_bytes"]}
            if "min_out_bytes" in audio:
                assert min(sizes) >= audio["min_out_bytes"]
                assert all(s % audio["out_multiple_bytes"] == 0 for s in sizes)

            # The response is done when the carrier has played it (its marks), not when it was sent.
            last_echo = max(t for t, _, _ in phone.log.marks_echoed)
            assert events.arrival_of(done) >= last_echo
            frame_ms = 1000.0 * max(len(a.samples) for a in phone.log.audio) / phone.rate
            assert abs(done["response"]["played_ms"] - 1000.0 * len(heard) / phone.rate) <= frame_ms + 1

            # Hang-up from the carrier's side ends the session and closes both sockets cleanly.
            if spec(provider)["stop"] is not None:
                await phone.hang_up()
            else:
                await phone.close()
            closed = await events.wait("session.closed", timeout=20)
            assert closed["reason"] in ("hangup", "carrier_closed")
            await asyncio.wait_for(events.closed.wait(), 20)
            if spec(provider)["stop"] is not None:
                await asyncio.wait_for(phone.closed.wait(), 20)
                assert phone.log.close_code == 1000
            await until(lambda: not app[REGISTRY_KEY].calls, what="the call leaving the registry")
            status, body = await get_json(url, "/v1/sessions")
            assert status == 200 and body["sessions"] == [] and body["free"] == body["capacity"]
        finally:
            await events.close()
            await phone.close()


def at_rate_up(x: np.ndarray, rate: int) -> np.ndarray:
    r = PcmResampler(rate, 48000)
    return np.concatenate([r.process(x), r.flush()])


async def test_barge_in_flushes_and_played_ms_comes_from_marks(long_utterance, interjection):
    """The caller talks over the agent: a flush at once, and played_ms is what the marks confirmed."""
    async with phone_server() as (url, _):
        phone = carrier(url, "twilio")
        await phone.connect()
        events = EventStream(url, spec("twilio")["call_id"])
        try:
            await events.connect()
            await phone.play(np.concatenate([silence(8000, 0.3), at_rate(long_utterance, 8000), silence(8000, 1.0)]))
            started = await events.wait("output_audio_buffer.started", timeout=40)
            await asyncio.sleep(1.5)
            talk = asyncio.create_task(phone.play(np.concatenate([at_rate(interjection, 8000), silence(8000, 1.0)])))
            cleared = await events.wait("output_audio_buffer.cleared", timeout=20)
            done = await events.wait("response.done", response_id=started["response_id"])
            assert done["response"]["status"] == "cancelled"
            await until(lambda: phone.log.clears, what="the flush reaching the carrier")
            clear_at = phone.log.clears[0]
            status, snap = await get_json(url, "/v1/sessions")
            counters = snap["sessions"][0]["counters"]
            # What the caller had heard of the response when the flush arrived (the carrier's playout
            # time, less the silence the pacer sent where the engine was late), against what the
            # marks had confirmed: the marks lag by their round trip and a mark interval, never lead.
            padded_ms = 1000.0 * counters["playout_underrun_samples"] / 8000
            heard_ms = phone.played_ms(clear_at)
            sent_ms = 1000.0 * sum(len(a.samples) for a in phone.log.audio if a.arrival <= clear_at) / 8000
            assert cleared["played_ms"] <= heard_ms + 1
            assert cleared["played_ms"] >= heard_ms - padded_ms - 300
            assert cleared["played_ms"] < sent_ms  # sent is not heard: the lead was still in the carrier
            assert done["response"]["played_ms"] == cleared["played_ms"]
            # Twilio echoed the marks our flush discarded; they did not count as played.
            assert counters["flushes"] >= 1 and counters["marks_after_clear"] >= 1
            assert any(cleared_echo for _, _, cleared_echo in phone.log.marks_echoed)
            await talk
        finally:
            await events.close()
            await phone.close()


def onset_ms(x: np.ndarray, rate: int) -> float:
    """Where speech in ``x`` begins: its first sample at a twentieth of its peak."""
    return 1000.0 * int(np.flatnonzero(np.abs(x) >= 0.05 * np.max(np.abs(x)))[0]) / rate


@pytest.mark.parametrize("provider", PROVIDERS)
async def test_a_barge_in_is_heard_at_once_and_answered_intact_with_the_default_processing(
        provider, long_utterance, interjection):
    """The caller talks over the agent's answer, with the uplink processing a phone leg gets by
    default (the echo canceller and the high-pass filter; the aec extra installed, as ``make test``
    does). The line carries no echo, as most phone calls (a handset, a mobile, this emulator) do:
    the engine's VAD must hear the caller as it would without processing, and what it answers (the
    echo engine repeats the interjection) must be what was said. On one stream (one ``play``) so
    every position is the audio's own: no wall-clock time is asserted."""
    async with phone_server(session=PATIENT_WINDOWS) as (url, _):
        phone = carrier(url, provider)
        await phone.connect()
        events = EventStream(url, spec(provider)["call_id"])
        try:
            await events.connect()
            active = (await events.wait("session.created"))["session"]["audio_processing"]
            if "unavailable" in active:
                unavailable(f"the phone legs' default processing needs the aec extra: {active['unavailable']}")
            assert active["echo_cancellation"] and active["high_pass_filter"]
            rate = phone.rate
            story, said = at_rate(long_utterance, rate), at_rate(interjection, rate)
            before = np.concatenate([silence(rate, 0.3), story, silence(rate, 2.0)])
            talk = asyncio.create_task(phone.play(np.concatenate([before, said, silence(rate, 3.0)])))
            started = await events.wait("output_audio_buffer.started", timeout=60)
            cleared = await events.wait("output_audio_buffer.cleared", timeout=60)
            assert cleared["response_id"] == started["response_id"]
            done = await events.wait("response.done", timeout=60, response_id=started["response_id"])
            assert done["response"]["status_details"]["reason"] == "barge_in"
            # The VAD put the interjection's start where it is in the stream (its pre-roll less, a
            # 32 ms chunk more): a suppressed onset would move it by the stretch suppressed.
            after = events.events.index(started)
            heard = [e for e in events.events[after:] if e["type"] == "input_audio_buffer.speech_started"][0]
            onset = 1000.0 * len(before) / rate + onset_ms(said, rate)
            assert -200 <= heard["audio_start_ms"] - onset <= 100, (heard["audio_start_ms"], onset)
            answer = await events.wait("output_audio_buffer.started", timeout=60, after=events.events.index(cleared))
            await events.wait("response.done", timeout=60, response_id=answer["response_id"])
            await talk
            await until(lambda: phone.log.clears, what="the flush reaching the carrier")
            second = phone.heard(since=phone.log.clears[-1])
            # No echo on this line: the engine heard it without the canceller all along.
            _, listing = await get_json(url, "/v1/sessions")
            assert listing["sessions"][0]["audio_processing"]["echo_detected"] is False
            score = best_match(at_rate_up(second, rate), at_rate_up(said, rate))
            print(f"{provider}: barge-in start {heard['audio_start_ms'] - onset:+.0f} ms from the onset; "
                  f"answer correlation {score:.3f}")
            # Measured 0.885-0.894 with this processing and without it alike (the envelope match of an
            # 8 kHz leg; a barge-in whose onset the canceller suppressed answered 0.71).
            assert score > 0.8, f"the answer matches what was said at {score:.2f}"
        finally:
            await events.close()
            await phone.close()


@pytest.mark.parametrize("provider", ["plivo", "vonage"])
async def test_cancel_from_the_event_stream_stops_audio_at_once(provider, long_utterance):
    """``response.cancel`` from the application: flush sent, no audio of the old epoch after it."""
    async with phone_server() as (url, _):
        phone = carrier(url, provider)
        await phone.connect()
        events = EventStream(url, spec(provider)["call_id"])
        try:
            await events.connect()
            rate = phone.rate
            await phone.play(np.concatenate([silence(rate, 0.3), at_rate(long_utterance, rate), silence(rate, 1.0)]))
            started = await events.wait("output_audio_buffer.started", timeout=40)
            await asyncio.sleep(1.0)
            await events.send({"type": "response.cancel", "event_id": "cancel-1"})
            cleared = await events.wait("output_audio_buffer.cleared", timeout=10)
            assert cleared["response_id"] == started["response_id"]
            await until(lambda: phone.log.clears, what="the flush reaching the carrier")
            clear_at = phone.log.clears[0]
            await phone.play(silence(rate, 1.5))  # the caller stays on the line, silent
            after = [a for a in phone.log.audio if a.arrival > clear_at]
            assert after == [], f"{len(after)} frames of a cancelled response were sent after the flush"
            status, snap = await get_json(url, "/v1/sessions")
            assert snap["sessions"][0]["counters"]["flushes"] == 1
        finally:
            await events.close()
            await phone.close()


async def test_dtmf_is_reported_and_interrupts(long_utterance):
    async with phone_server() as (url, _):
        phone = carrier(url, "telnyx")
        await phone.connect()
        events = EventStream(url, spec("telnyx")["call_id"])
        try:
            await events.connect()
            await phone.play(np.concatenate([silence(8000, 0.3), at_rate(long_utterance, 8000), silence(8000, 1.0)]))
            started = await events.wait("output_audio_buffer.started", timeout=40)
            await asyncio.sleep(0.5)
            await phone.press("5")
            digit = await events.wait("input_audio_buffer.dtmf_event_received", timeout=10)
            assert digit["event"] == "5"
            validate_server_event(digit)
            done = await events.wait("response.done", response_id=started["response_id"])
            assert done["response"]["status"] == "cancelled"
            assert done["response"]["status_details"] == {"reason": "dtmf"}
            await until(lambda: phone.log.clears, what="the flush reaching the carrier")
        finally:
            await events.close()
            await phone.close()


async def test_server_side_hang_up_closes_the_carrier_socket(short_utterance):
    async with phone_server() as (url, _):
        phone = carrier(url, "exotel")
        await phone.connect()
        events = EventStream(url, spec("exotel")["call_id"])
        try:
            await events.connect()
            created = await events.wait("session.created", timeout=10)
            status, _ = await get_json(url, f"/v1/sessions/{created['session']['id']}", method="DELETE")
            assert status == 200
            closed = await events.wait("session.closed", timeout=10)
            assert closed["reason"] == "deleted"
            await asyncio.wait_for(phone.closed.wait(), 20)
            assert phone.log.close_code == 1000
        finally:
            await events.close()
            await phone.close()


async def test_event_stream_can_end_the_call():
    async with phone_server() as (url, _):
        phone = carrier(url, "vonage")
        await phone.connect()
        events = EventStream(url, spec("vonage")["call_id"])
        try:
            await events.connect()
            await events.wait("session.created", timeout=10)
            await events.send({"type": "session.close"})
            await asyncio.wait_for(phone.closed.wait(), 20)
            assert phone.log.close_code == 1000
        finally:
            await events.close()
            await phone.close()


async def _refused_status(url: str, headers: dict[str, str]) -> int | None:
    async with aiohttp.ClientSession() as http:
        try:
            async with http.ws_connect(url, headers=headers):
                return None
        except aiohttp.WSServerHandshakeError as exc:
            return exc.status


async def test_callers_without_valid_credentials_are_refused_before_any_audio(short_utterance):
    async with phone_server() as (url, app):
        ws = media_url(url)
        assert await _refused_status(ws, {}) is None  # Plivo is configured: it may prove itself in start
        async with phone_server(telephony={"plivo": {"token": None}}) as (url2, _):
            assert await _refused_status(media_url(url2), {}) == 401
        assert await _refused_status(ws, {TWILIO_SIGNATURE: "bm90IGEgc2lnbmF0dXJl"}) == 401
        assert await _refused_status(ws, {"Authorization": "Bearer wrong"}) == 401
        # A credential is good for its own carrier only.
        headers = {"Authorization": f"Bearer {CREDENTIALS['vonage']['token']}"}
        assert await _refused_status(media_url(url, "twilio"), headers) == 401
        assert await _refused_status(media_url(url, "nobody"), headers) == 404
        # Plivo with a wrong token in its extraHeaders: closed on its start frame, no session opened.
        phone = CarrierEmulator(ws, spec("plivo"), values={"token": "wrongToken"})
        await phone.connect()
        try:
            await asyncio.wait_for(phone.closed.wait(), 20)
            assert phone.log.close_code == 1008
        finally:
            await phone.close()
        # A signed Twilio stream whose frames say Telnyx is refused too.
        twilio = carrier(url, "twilio")
        telnyx_as_twilio = CarrierEmulator(twilio.url, spec("telnyx"), headers=twilio.headers)
        await telnyx_as_twilio.connect()
        try:
            await asyncio.wait_for(telnyx_as_twilio.closed.wait(), 20)
            assert telnyx_as_twilio.log.close_code == 1008
        finally:
            await telnyx_as_twilio.close()
        status, body = await get_json_auth(url, "/v1/sessions", APP_KEY)
        assert status == 200 and body["sessions"] == []
        # The application's event stream takes the server's bearer token, not a carrier's.
        events_url = f"{url.replace('http://', 'ws://')}/v1/telephony/calls/anything/events"
        assert await _refused_status(events_url, {}) == 401


async def get_json_auth(url: str, path: str, token: str):
    async with aiohttp.ClientSession() as http:
        async with http.get(url + path, headers={"Authorization": f"Bearer {token}"}) as resp:
            return resp.status, await resp.json()


async def test_malformed_frames_get_errors_and_the_server_lives_on(short_utterance):
    async with phone_server(telephony={"max_bad_frames": 4}) as (url, _):
        phone = carrier(url, "twilio")
        await phone.connect()
        events = EventStream(url, spec("twilio")["call_id"])
        try:
            await events.connect()
            await events.wait("session.created", timeout=10)
            await phone.send_raw("this is not json")
            await phone.send_json({"event": "bogus", "streamSid": "MZ18ad3ab5a668481ce02b83e7395059f0"})
            await phone.send_json({"event": "media", "media": {"payload": "***not base64***"}})
            errors = await _errors(events, 3)
            assert [e["error"]["code"] for e in errors] == ["invalid_carrier_frame"] * 3
            assert "not valid JSON" in errors[0]["error"]["message"]
            assert "bogus" in errors[1]["error"]["message"]
            assert "base64" in errors[2]["error"]["message"]
            await phone.play(silence(8000, 0.2))  # the call goes on
            status, snap = await get_json(url, "/v1/sessions")
            assert len(snap["sessions"]) == 1 and snap["sessions"][0]["counters"]["carrier_bad_frames"] == 3
            await phone.send_raw(b"\x00\x01binary")  # the fourth bad frame ends the call
            await asyncio.wait_for(phone.closed.wait(), 20)
            assert phone.log.close_code == 1007
            closed = await events.wait("session.closed", timeout=10)
            assert closed["reason"] == "malformed_frames"
        finally:
            await events.close()
            await phone.close()
        # Garbage before a start frame: closed with a code that says why, no session.
        for frames, code in (([b"\x00"], 1002), (["{not json"], 1007),
                             ([json.dumps({"event": "media", "media": {"payload": ""}})], 1002)):
            bad = carrier(url, "twilio")
            await bad.connect(handshake=False)
            try:
                for frame in frames:
                    await bad.send_raw(frame)
                await asyncio.wait_for(bad.closed.wait(), 20)
                assert bad.log.close_code == code
            finally:
                await bad.close()
        status, body = await get_json(url, "/healthz")
        assert status == 200
        status, body = await get_json(url, "/v1/sessions")
        assert body["sessions"] == []
        good = carrier(url, "twilio")  # and the next call is served
        await good.connect()
        try:
            events = EventStream(url, spec("twilio")["call_id"])
            try:
                await events.connect()
                await events.wait("session.created", timeout=10)
            finally:
                await events.close()
        finally:
            await good.close()


async def _errors(events: EventStream, n: int, timeout: float = 10.0) -> list[dict]:
    await until(lambda: len(events.of("error")) >= n, timeout, f"{n} error events")
    return events.of("error")[:n]
