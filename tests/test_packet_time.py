"""Packet time: 10 ms packets each way when the profile asks for them, 20 ms otherwise."""

from __future__ import annotations

import fractions

import aiohttp
import av
import numpy as np
import pytest
from aiortc import RTCRtpCodecParameters
from aiortc.codecs import get_encoder

from lychee_rtc.bench.client import RtcClient
from lychee_rtc.rtc.codec_threads import _limit
from lychee_rtc.rtc.outbound import PacedAudioTrack
from lychee_rtc.rtc.packet_time import EncoderHints, TrackFramedEncoder, with_ptime

from conftest import PATIENT_WINDOWS, running_server

ANSWER = "\r\n".join([
    "v=0", "o=- 1 1 IN IP4 0.0.0.0", "s=-", "t=0 0", "a=group:BUNDLE 0 1",
    "m=audio 9 UDP/TLS/RTP/SAVPF 111 0", "c=IN IP4 0.0.0.0", "a=mid:0", "a=rtpmap:111 opus/48000/2",
    "a=rtpmap:0 PCMU/8000", "a=ptime:20",
    "m=application 9 UDP/DTLS/SCTP webrtc-datachannel", "c=IN IP4 0.0.0.0", "a=mid:1", "a=sctp-port:5000", "",
])

OPUS = RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48000, channels=2, payloadType=111)
PCMU = RTCRtpCodecParameters(mimeType="audio/PCMU", clockRate=8000, channels=1, payloadType=0)


def test_with_ptime_sets_one_ptime_in_the_audio_section_only():
    out = with_ptime(ANSWER, 10)
    audio, application = out.split("m=application")
    assert audio.count("a=ptime:") == 1 and "a=ptime:10\r\n" in audio
    assert "a=ptime" not in application
    assert out.endswith("\r\n") and out.count("\r\n") == ANSWER.count("\r\n")


def frames(ms: int, count: int, rate: int = 48000):
    n = rate * ms // 1000
    t = np.arange(n * count) / rate
    pcm = (0.3 * np.sin(2 * np.pi * 440 * t) * 32767).astype(np.int16)
    for i in range(count):
        frame = av.AudioFrame.from_ndarray(pcm[None, i * n:(i + 1) * n], format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = rate, i * n, fractions.Fraction(1, rate)
        yield frame


@pytest.mark.parametrize("ms", [10, 20])
def test_opus_packets_carry_the_tracks_frame_length(ms):
    encoder = TrackFramedEncoder(_limit(get_encoder(OPUS)))
    decoder = av.CodecContext.create("libopus", "r")
    decoder.sample_rate, decoder.layout = 48000, "stereo"
    packets, timestamps = [], []
    for frame in frames(ms, 30):
        payloads, timestamp = encoder.encode(frame)
        packets += payloads
        if payloads:
            timestamps.append(timestamp)
    assert len(packets) >= 25
    decoded = [sum(f.samples for f in decoder.decode(av.Packet(p))) for p in packets]
    assert set(decoded) == {48 * ms}
    assert set(np.diff(timestamps)) == {48 * ms}  # RTP timestamps step by one packet


def codec_delay_samples(encoder: TrackFramedEncoder, hints: EncoderHints, ms: int = 10) -> int:
    """Where a chirp comes out of the encoder and a decoder, against where it went in (48 kHz);
    ``hints`` ride on the first frame, as the track sends them."""
    n, at = 48 * ms, 9600
    t = np.arange(960) / 48000
    chirp = np.hanning(960) * np.sin(2 * np.pi * (400 * t + 70000 * t * t))
    signal = np.zeros(48000)
    signal[at:at + 960] = 0.5 * chirp
    decoder = av.CodecContext.create("libopus", "r")
    decoder.sample_rate, decoder.layout, decoder.format = 48000, "mono", "flt"
    out = []
    for i in range(0, len(signal), n):
        frame = av.AudioFrame.from_ndarray((signal[None, i:i + n] * 32767).astype(np.int16), format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 48000, i, fractions.Fraction(1, 48000)
        if i == 0:
            frame.opaque = hints
        for payload in encoder.encode(frame)[0]:
            out += [f.to_ndarray().reshape(-1) for f in decoder.decode(av.Packet(payload))]
    decoded = np.concatenate(out)
    return int(np.argmax(np.correlate(decoded, chirp, "valid"))) - at


@pytest.mark.parametrize(("application", "delay_ms"), [(None, 6.5), ("voip", 6.5), ("lowdelay", 2.5)])
def test_the_tracks_opus_application_sets_the_codec_delay(application, delay_ms):
    encoder = TrackFramedEncoder(_limit(get_encoder(OPUS)))
    assert codec_delay_samples(encoder, EncoderHints(opus_application=application)) == 48 * delay_ms


async def test_the_track_hands_its_encoder_hints_on_the_first_frame_only():
    hints = EncoderHints(opus_application="lowdelay")
    track = PacedAudioTrack(in_rate=16000, encoder_hints=hints)
    first, second = await track.recv(), await track.recv()
    assert first.opaque is hints and second.opaque is None
    track.stop()


@pytest.mark.parametrize("ms", [10, 20])
def test_g711_packets_carry_the_tracks_frame_length(ms):
    encoder = TrackFramedEncoder(_limit(get_encoder(PCMU)))
    payloads = [p for frame in frames(ms, 10, rate=8000) for p in encoder.encode(frame)[0]]
    assert {len(p) for p in payloads} == {8 * ms}  # one byte per sample at 8 kHz


async def test_a_10_ms_profile_sends_and_asks_for_10_ms_packets(utterance):
    async with running_server(session=PATIENT_WINDOWS, rtc={"send_frame_ms": 10, "receive_ptime_ms": 10}) as (url, app):
        client = RtcClient(url)
        steps: list[int] = []
        await client.connect()
        try:
            assert client.mic.frame == 480  # the answer's a=ptime:10, honoured as libwebrtc does
            receiver = next(t.receiver for t in client.pc.getTransceivers() if t.kind == "audio")
            handle = receiver._handle_rtp_packet
            last: list[int] = []

            async def watch(packet, arrival_time_ms):
                if packet.payload_type != 101 and last:
                    steps.append((packet.timestamp - last[0]) % 2**32)
                last[:] = [packet.timestamp]
                await handle(packet, arrival_time_ms)

            receiver._handle_rtp_packet = watch
            client.mic.feed(np.zeros(48000 // 2, np.float32))
            client.mic.feed(utterance)
            await client.wait_event("response.done", timeout=60)
            assert len(steps) > 50
            assert np.median(steps) == 480  # 10 ms of 48 kHz per packet coming back
            sent = client.mic.sent_samples  # before the server's count is asked: the client sends on meanwhile
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/v1/sessions/{client.session_id}", headers=client.auth_headers) as resp:
                    counters = (await resp.json())["counters"]
            # 20 ms packets would make these about half the 10 ms packet counts.
            assert counters["inbound_frames"] > 0.8 * sent / 480
            assert counters["outbound_frames"] > 0.8 * len(steps)
        finally:
            await client.close()
