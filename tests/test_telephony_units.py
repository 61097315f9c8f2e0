"""Telephony pieces on their own: G.711, each dialect's parsing, credentials, the carrier pacer."""

from __future__ import annotations

import asyncio
import base64
import json

import av
import numpy as np
import pytest
from aiohttp import encode_basic_auth
from conftest import wait_until
from telephony_support import CREDENTIALS, PROVIDERS, spec
from twilio.request_validator import RequestValidator
from yarl import URL

from lychee_rtc.bench.carrier import fill, match
from lychee_rtc.config import TelephonySettings
from lychee_rtc.session.sink import CutReport
from lychee_rtc.telephony.auth import (
    TELNYX_TOKEN,
    TWILIO_SIGNATURE,
    check_request,
    plivo_token_ok,
    twilio_signature,
    url_variants,
)
from lychee_rtc.telephony.carriers import DIALECTS, detect
from lychee_rtc.telephony.carriers.exotel import ExotelDialect
from lychee_rtc.telephony.carriers.plivo import parse_extra_headers
from lychee_rtc.telephony.frames import (
    AudioFormat,
    AudioIn,
    DigitPressed,
    FrameError,
    MarkPlayed,
    StreamStarted,
    StreamStopped,
)
from lychee_rtc.telephony.g711 import g711_decode, g711_encode
from lychee_rtc.telephony.outbox import Outbox
from lychee_rtc.telephony.pacer import CarrierPacer

SETTINGS = TelephonySettings(**CREDENTIALS)


# --- G.711 --------------------------------------------------------------------------------------


def _ffmpeg_codes(codec: str, pcm16: np.ndarray) -> np.ndarray:
    enc = av.CodecContext.create(codec, "w")
    enc.sample_rate, enc.layout, enc.format = 8000, "mono", "s16"
    frame = av.AudioFrame.from_ndarray(pcm16[None, :], format="s16", layout="mono")
    frame.sample_rate, frame.pts = 8000, 0
    out = b"".join(bytes(p) for p in enc.encode(frame)) + b"".join(bytes(p) for p in enc.encode(None))
    return np.frombuffer(out, np.uint8)


@pytest.mark.parametrize("law,codec", [("mulaw", "pcm_mulaw"), ("alaw", "pcm_alaw")])
def test_g711_matches_ffmpeg(law, codec):
    codes = bytes(range(256))
    dec = av.CodecContext.create(codec, "r")
    dec.sample_rate, dec.layout = 8000, "mono"
    theirs = np.concatenate([f.to_ndarray().reshape(-1) for f in dec.decode(av.Packet(codes))])
    np.testing.assert_array_equal(np.round(g711_decode(codes, law) * 32768).astype(np.int16), theirs)
    # Encoding: the reference segment rule; FFmpeg rounds to the nearest code at segment edges, so
    # the two agree on almost every sample and never differ by more than one code step.
    pcm = np.arange(-32768, 32768, 7, dtype=np.int16)
    ours = np.frombuffer(g711_encode(pcm.astype(np.float32) / 32767.0, law), np.uint8)
    ffmpeg = _ffmpeg_codes(codec, np.round(pcm.astype(np.float32) / 32767.0 * 32767.0).astype(np.int16))
    assert np.mean(ours == ffmpeg) > 0.97
    err_ours = np.abs(g711_decode(ours.tobytes(), law) - pcm / 32768.0)
    err_ffmpeg = np.abs(g711_decode(ffmpeg.tobytes(), law) - pcm / 32768.0)
    assert np.max(err_ours - err_ffmpeg) < 0.02
    assert g711_encode(np.zeros(1), "mulaw") == b"\xff" and g711_encode(np.zeros(1), "alaw") == b"\xd5"


def test_g711_round_trip_keeps_a_tone():
    t = np.arange(8000) / 8000
    tone = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    for law in ("mulaw", "alaw"):
        back = g711_decode(g711_encode(tone, law), law)
        snr = 10 * np.log10(np.sum(tone ** 2) / np.sum((back - tone) ** 2))
        assert snr > 30, (law, snr)


# --- dialects -------------------------------------------------------------------------------------


@pytest.mark.parametrize("provider", PROVIDERS)
def test_detection_and_start_from_documented_frames(provider):
    s = spec(provider)
    start = fill(s["handshake"][-1], {"token": "x", "seq": 1})
    assert detect(start) is DIALECTS[provider]
    dialect = DIALECTS[provider]()
    event = dialect.parse(json.dumps(start))
    assert isinstance(event, StreamStarted)
    assert event.call_id == s["call_id"]
    assert event.audio == AudioFormat(s["audio"]["encoding"], s["audio"]["rate"])
    # Outbound frames have exactly the documented shapes.
    payload = base64.b64decode(match(s["outbound"]["media"], json.loads(dialect.media(b"\x01\x02")))["payload"]) \
        if s["outbound"]["media"] else dialect.media(b"\x01\x02")
    assert payload == b"\x01\x02"
    assert match(s["outbound"]["mark"], json.loads(dialect.mark("m1"))) == {"name": "m1"}
    assert match(s["outbound"]["clear"], json.loads(dialect.clear())) == {}
    # Inbound events of the documented shapes.
    if s["media"] is not None:
        frame = fill(s["media"], {"seq": 2, "chunk": 1, "timestamp": 40, "payload": base64.b64encode(b"\x7f" * 4).decode()})
        got = dialect.parse(json.dumps(frame))
        assert got == AudioIn(b"\x7f" * 4, 40.0)
    else:
        assert dialect.parse(b"\x00\x00" * 320) == AudioIn(b"\x00\x00" * 320)
    assert dialect.parse(json.dumps(fill(s["dtmf"], {"seq": 3, "digit": "#"}))) == DigitPressed("#")
    # Keys A-D come in either case and reach the session as the upper-case key.
    assert dialect.parse(json.dumps(fill(s["dtmf"], {"seq": 3, "digit": "b"}))) == DigitPressed("B")
    assert dialect.parse(json.dumps(fill(s["mark"], {"seq": 4, "name": "m1"}))) == MarkPlayed("m1")
    if s["stop"] is not None:
        assert isinstance(dialect.parse(json.dumps(fill(s["stop"], {"seq": 5}))), StreamStopped)


@pytest.mark.parametrize("provider", ["twilio", "telnyx", "plivo", "exotel"])
@pytest.mark.parametrize("bad,needle", [
    ("{", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"event": "nonsense"}), "unknown"),
    (json.dumps({"event": "media"}), "media"),
    (json.dumps({"event": "media", "media": {"payload": "%%%"}}), "base64"),
    (json.dumps({"event": "dtmf", "dtmf": {"digit": "12"}}), "DTMF"),
    (json.dumps({"event": "dtmf", "dtmf": {"digit": ""}}), "DTMF"),
    (json.dumps({"event": "mark", "mark": {}}), "name"),
])
def test_malformed_frames_are_precise_errors(provider, bad, needle):
    dialect = DIALECTS[provider]()
    if provider == "plivo" and '"mark"' in bad:
        bad = json.dumps({"event": "playedStream"})
    with pytest.raises(FrameError) as err:
        dialect.parse(bad)
    assert needle.lower() in str(err.value).lower()


def test_unsupported_formats_close_with_1003():
    twilio = spec("twilio")["handshake"][-1]
    twilio = json.loads(json.dumps(twilio))
    twilio["start"]["mediaFormat"]["encoding"] = "audio/opus"
    with pytest.raises(FrameError) as err:
        DIALECTS["twilio"]().parse(json.dumps(twilio))
    assert err.value.close_code == 1003
    with pytest.raises(FrameError) as err:
        DIALECTS["vonage"]().parse(json.dumps({"event": "websocket:connected", "content-type": "audio/l16;rate=44100"}))
    assert err.value.close_code == 1003


def test_exotel_start_in_either_spelling():
    """Exotel documents snake_case fields and its sample code sends camelCase; both start a call."""
    camel = {"event": "start", "start": {"streamSid": "MZ1", "callSid": "CA1", "accountSid": "AC1",
                                          "customParameters": {"k": "v"},
                                          "mediaFormat": {"encoding": "raw", "sampleRate": "16000"}}}
    dialect = ExotelDialect()
    started = dialect.parse(json.dumps(camel))
    assert (started.call_id, started.stream_id, started.audio.rate, started.parameters) == \
        ("CA1", "MZ1", 16000, {"k": "v"})
    assert json.loads(dialect.clear()) == {"event": "clear", "stream_sid": "MZ1"}
    snake = {"event": "start", "start": {"stream_sid": "MZ2", "call_sid": "CA2", "account_sid": "AC2"}}
    assert ExotelDialect().parse(json.dumps(snake)).audio.rate == 8000
    with pytest.raises(FrameError, match="start.call_sid"):
        ExotelDialect().parse(json.dumps({"event": "start", "start": {"stream_sid": "MZ3"}}))


def test_exotel_frames_fill_its_minimum_chunk():
    for rate, ms in ((8000, 200), (16000, 100), (24000, 80)):
        d = ExotelDialect()
        d.started = StreamStarted("c", "s", AudioFormat("pcm16", rate))
        assert d.frame_ms() == ms
        assert (rate * ms // 1000 * 2) % 320 == 0 and rate * ms // 1000 * 2 >= 3200


def test_plivo_extra_headers():
    assert parse_extra_headers("userId=12345;sessionId=abc") == {"userId": "12345", "sessionId": "abc"}
    assert parse_extra_headers("test1=12,test2=123") == {"test1": "12", "test2": "123"}
    assert parse_extra_headers(None) == {}
    assert plivo_token_ok({"token": CREDENTIALS["plivo"]["token"]}, SETTINGS)
    assert not plivo_token_ok({"token": "nope"}, SETTINGS) and not plivo_token_ok({}, SETTINGS)


# --- credentials ----------------------------------------------------------------------------------


def test_credentials_per_carrier():
    url = "wss://bot.example.com/v1/telephony/ws"
    twilio = RequestValidator(CREDENTIALS["twilio"]["auth_token"])
    sig = twilio.compute_signature(url, {})
    assert check_request({TWILIO_SIGNATURE: sig}, [url], SETTINGS).carriers == {"twilio"}
    wrong = check_request({TWILIO_SIGNATURE: RequestValidator("other").compute_signature(url, {})}, [url], SETTINGS)
    assert wrong.refusal and not wrong.carriers
    assert check_request({TELNYX_TOKEN: CREDENTIALS["telnyx"]["token"]}, [url], SETTINGS).carriers == {"telnyx"}
    basic = encode_basic_auth(CREDENTIALS["exotel"]["username"], CREDENTIALS["exotel"]["password"])
    assert check_request({"Authorization": basic}, [url], SETTINGS).carriers == {"exotel"}
    assert check_request({"Authorization": "Basic !!!"}, [url], SETTINGS).refusal
    bearer = f"Bearer {CREDENTIALS['vonage']['token']}"
    assert check_request({"Authorization": bearer}, [url], SETTINGS).carriers == {"vonage"}
    assert check_request({"Authorization": bearer}, [url], SETTINGS, carrier="twilio").refusal
    none = check_request({}, [url], SETTINGS)
    assert none.plivo_pending and none.refusal is None
    assert check_request({}, [url], TelephonySettings()).refusal  # nothing configured: nobody gets in


# Known answers: what the carriers' own code (or the standard they follow) produces, never our signer.

TWILIO_URLS = [
    "wss://bot.example.com/v1/telephony/ws",
    "wss://bot.example.com/v1/telephony/ws/twilio?tenant=acme&lang=en-GB",
    "wss://bot.example.com:8443/v1/telephony/ws",
    "ws://127.0.0.1:8080/v1/telephony/ws",
]


@pytest.mark.parametrize("url", TWILIO_URLS)
def test_twilio_signatures_made_by_twilios_own_validator_are_accepted(url):
    token = CREDENTIALS["twilio"]["auth_token"]
    twilio = RequestValidator(token)
    # A WebSocket upgrade is a GET: Twilio signs the full URL (query included) and no parameters.
    signature = twilio.compute_signature(url, {})
    assert check_request({TWILIO_SIGNATURE: signature}, [url], SETTINGS).carriers == {"twilio"}
    assert twilio.validate(url, {}, twilio_signature(token, url))  # and Twilio accepts what we would sign
    tampered = url.replace("/v1/", "/v2/")
    assert check_request({TWILIO_SIGNATURE: twilio.compute_signature(tampered, {})}, [url], SETTINGS).refusal


def test_twilio_signatures_with_or_without_the_default_port_are_accepted():
    # Signers differ on spelling out the default port; Twilio's validator computes both ways for https.
    twilio = RequestValidator(CREDENTIALS["twilio"]["auth_token"])
    plain, with_port = "wss://bot.example.com/v1/telephony/ws", "wss://bot.example.com:443/v1/telephony/ws"
    for signed, checked in ((with_port, plain), (plain, with_port)):
        signature = twilio.compute_signature(signed, {})
        assert check_request({TWILIO_SIGNATURE: signature}, [checked], SETTINGS).carriers == {"twilio"}
    assert twilio.validate("https://h/p", {}, twilio.compute_signature("https://h:443/p", {}))
    assert url_variants("https://h/p") == ["https://h/p", "https://h:443/p"]
    assert url_variants("ws://h:80/p") == ["ws://h:80/p", "ws://h/p"]


def test_exotel_basic_credentials_as_the_standard_and_a_client_library_encode_them():
    # RFC 7617 section 2's example: user "Aladdin", password "open sesame".
    rfc = TelephonySettings(exotel={"username": "Aladdin", "password": "open sesame"})
    url = "wss://bot.example.com/v1/telephony/ws"
    assert check_request({"Authorization": "Basic QWxhZGRpbjpvcGVuIHNlc2FtZQ=="}, [url], rfc).carriers == {"exotel"}
    wrong = "Basic QWxhZGRpbjpvcGVuIHNlc2Ft"  # "Aladdin:open sesam"
    assert check_request({"Authorization": wrong}, [url], rfc).refusal
    # Exotel takes the credentials in the stream URL (docs/telephony.md); the header is what a client
    # library makes of that URL's user information.
    documented = URL(f"wss://{CREDENTIALS['exotel']['username']}:{CREDENTIALS['exotel']['password']}"
                     "@bot.example.com/v1/telephony/ws")
    header = encode_basic_auth(documented.user or "", documented.password or "")
    assert check_request({"Authorization": header}, [url], SETTINGS).carriers == {"exotel"}


def test_vonage_bearer_token_as_the_standard_writes_it():
    # RFC 6750 section 2.1's example token: token68 characters ('.', '-', '_') pass unchanged.
    rfc = TelephonySettings(vonage={"token": "mF_9.B5f-4.1JqM"})
    url = "wss://bot.example.com/v1/telephony/ws"
    assert check_request({"Authorization": "Bearer mF_9.B5f-4.1JqM"}, [url], rfc).carriers == {"vonage"}
    assert check_request({"Authorization": "bearer mF_9.B5f-4.1JqM"}, [url], rfc).carriers == {"vonage"}
    assert check_request({"Authorization": "Bearer mF_9.B5f-4.1Jq"}, [url], rfc).refusal


# --- the carrier pacer ----------------------------------------------------------------------------


class Listener:
    def __init__(self) -> None:
        self.finished: list[tuple[str, int]] = []
        self.started: list[str] = []

    def on_playout_started(self, epoch, response_id, sample_offset, rate):
        self.started.append(response_id)

    def on_playout_finished(self, epoch, response_id, played_samples, sample_offset, rate):
        self.finished.append((response_id, played_samples))


def _pacer(**settings) -> tuple[CarrierPacer, Outbox, Listener]:
    dialect = DIALECTS["twilio"]()
    dialect.parse(json.dumps(spec("twilio")["handshake"][-1]))
    outbox = Outbox(10_000)
    playout = CarrierPacer(24000, dialect, outbox, TelephonySettings(**settings), max_buffer_s=30)
    listener = Listener()
    playout.listener = listener
    return playout, outbox, listener


def _drain(outbox: Outbox) -> list[dict]:
    out = []
    while outbox._items:
        out.append(json.loads(outbox._items.popleft()[1]))
    return out


async def test_pacer_counts_only_confirmed_audio_and_ignores_marks_echoed_by_the_flush():
    playout, outbox, listener = _pacer(lead_ms=60, max_ahead_ms=200, mark_interval_ms=20)
    task = asyncio.create_task(playout.run())
    try:
        playout.write(0, "r1", np.full(24000, 0.3, np.float32))  # one second
        await wait_until(lambda: playout.counters.held_for_playout, 10, "the pacer to stop at max_ahead_ms")
        sent = _drain(outbox)
        media = [m for m in sent if m["event"] == "media"]
        marks = [m["mark"]["name"] for m in sent if m["event"] == "mark"]
        # Never far ahead of the caller: nothing is confirmed, so sending stopped at max_ahead_ms.
        assert 200 - 20 <= 20 * len(media) <= 200
        assert playout.counters.held_for_playout >= 1 and listener.started == ["r1"]
        for name in marks[:4]:  # the caller has heard 80 ms
            playout.on_mark(name)
        report: CutReport = playout.cut(1)
        assert report.response_id == "r1" and report.played_samples == 4 * 160
        flush = _drain(outbox)
        assert {"event": "clear", "streamSid": "MZ18ad3ab5a668481ce02b83e7395059f0"} in flush
        assert not any(m["event"] == "media" for m in flush[flush.index({"event": "clear", "streamSid":
                                                                         "MZ18ad3ab5a668481ce02b83e7395059f0"}):])
        for name in marks[4:]:  # Twilio echoes the discarded marks after a clear
            playout.on_mark(name)
        assert playout.counters.marks_after_clear == len(marks) - 4
        assert listener.finished == []  # r1 never finished playing
        assert playout.write(0, "r1", np.ones(240, np.float32)) is False  # a late producer of epoch 0
        await asyncio.sleep(0.1)
        assert not any(m["event"] == "media" for m in _drain(outbox))
    finally:
        task.cancel()


async def test_pacer_finishes_a_response_when_its_last_mark_comes_back():
    playout, outbox, listener = _pacer(lead_ms=100, mark_interval_ms=100)
    task = asyncio.create_task(playout.run())
    try:
        playout.write(0, "r1", np.full(2400, 0.3, np.float32))  # 100 ms
        playout.end_response(0, "r1")
        deadline = asyncio.get_running_loop().time() + 10
        while not any(m["event"] == "mark" for m in list(map(lambda i: json.loads(i[1]), outbox._items))):
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        sent = _drain(outbox)
        assert listener.finished == []  # sent is not heard
        for m in sent:
            if m["event"] == "mark":
                playout.on_mark(m["mark"]["name"])
        assert listener.finished and listener.finished[0][0] == "r1"
        assert listener.finished[0][1] >= 800 - 160  # 100 ms at 8 kHz, less the resampler's tail
    finally:
        task.cancel()


async def test_pacer_stops_trusting_a_carrier_that_never_echoes_marks():
    playout, outbox, listener = _pacer(lead_ms=20, mark_timeout_s=0.2, max_ahead_ms=200)
    task = asyncio.create_task(playout.run())
    try:
        playout.write(0, "r1", np.full(4800, 0.3, np.float32))
        playout.end_response(0, "r1")
        deadline = asyncio.get_running_loop().time() + 10
        while not listener.finished:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        assert playout.marks_trusted is False and playout.counters.marks_timed_out == 1
    finally:
        task.cancel()
