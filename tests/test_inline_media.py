"""The media path's per-packet work on the event loop: libopus (rtc/opus.py), the inline decoder into
the uplink (rtc/inbound.py), the inline encoder's audio level (rtc/inline_encoder.py)."""

from __future__ import annotations

import fractions

import av
import numpy as np
import pytest
from aiortc import rtp
from aiortc.rtcrtpparameters import RTCRtpCodecParameters

from lychee_rtc.engine.base import EngineCapabilities
from lychee_rtc.media.uplink import InboundCounters
from lychee_rtc.rtc import opus
from lychee_rtc.rtc.inbound import InboundAudio, InlineDecoder
from lychee_rtc.rtc.inline_encoder import audio_level_dbov

OPUS = RTCRtpCodecParameters(mimeType="audio/opus", clockRate=48000, channels=2, payloadType=111)
PCMU = RTCRtpCodecParameters(mimeType="audio/PCMU", clockRate=8000, channels=1, payloadType=0)


def tone(seconds: float, rate: int = 48000, freq: float = 440.0, level: float = 0.3) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (level * np.sin(2 * np.pi * freq * t) * 32767).astype(np.int16)


def packets(pcm: np.ndarray, ms: int = 20, application: str = "voip") -> list[bytes]:
    encoder = opus.OpusEncoder(48000, application, 64000)
    n = 48 * ms
    return [encoder.encode(pcm[i:i + n]) for i in range(0, len(pcm) - n + 1, n)]


def test_libopus_decodes_straight_to_the_engine_rate():
    sent = packets(tone(1.0))
    decoder = opus.OpusDecoder(16000)
    decoded = [decoder.decode(p) for p in sent]
    assert {len(d) for d in decoded} == {320}  # 20 ms at 16 kHz: no resampler in between
    audio = np.concatenate(decoded[5:])
    assert np.sqrt(np.mean(audio ** 2)) == pytest.approx(0.3 / np.sqrt(2), rel=0.05)
    spectrum = np.abs(np.fft.rfft(audio))
    assert abs(np.argmax(spectrum) * 16000 / len(audio) - 440) < 5


@pytest.mark.parametrize(("application", "delay_ms"), [("voip", 6.5), ("lowdelay", 2.5)])
def test_the_encoder_keeps_the_applications_codec_delay(application, delay_ms):
    t = np.arange(960) / 48000
    chirp = np.hanning(960) * np.sin(2 * np.pi * (400 * t + 70000 * t * t))
    signal = np.zeros(48000)
    signal[9600:10560] = 0.5 * chirp
    decoder = opus.OpusDecoder(48000)
    out = np.concatenate([decoder.decode(p) for p in packets((signal * 32767).astype(np.int16), 10, application)])
    delay = (int(np.argmax(np.correlate(out, chirp, "valid"))) - 9600) / 48
    assert delay == pytest.approx(delay_ms, abs=0.1)


def test_bad_packets_are_a_typed_error():
    decoder = opus.OpusDecoder(16000)
    with pytest.raises(opus.OpusError):
        decoder.decode(b"")  # libopus would conceal 120 ms for it
    with pytest.raises(opus.OpusError):
        decoder.decode(b"\xff\xff\xff")
    with pytest.raises(opus.OpusError):
        opus.OpusDecoder(44100)
    assert len(decoder.decode(packets(tone(0.1))[0])) == 320  # the decoder lives on


class Session:
    """Just what the inbound path talks to."""

    id = "test"
    closed = False
    capabilities = EngineCapabilities("test", 16000, 24000, 6400, 1)

    def __init__(self) -> None:
        self.audio: list[np.ndarray] = []
        self.gaps: list[int] = []

    def push_audio(self, samples, now=None):
        self.audio.append(samples)

    def push_gap(self, n, now=None, fill=None):
        assert fill is not None and len(fill) == n
        self.gaps.append(n)


def test_inline_decoding_places_packets_by_timestamp():
    session, counters = Session(), InboundCounters()
    decode = InlineDecoder(InboundAudio(session, counters))
    sent = packets(tone(0.6))
    for k, payload in enumerate(sent):
        if k in (10, 11):
            continue  # lost
        decode(OPUS, payload, k * 960)
    decode(OPUS, sent[5], 5 * 960)  # a late duplicate: dropped
    decode(OPUS, b"\xff\xff\xff", 30 * 960)  # undecodable: counted, the call goes on
    assert session.gaps == [640]  # the two lost packets, at 16 kHz
    assert [len(a) for a in session.audio] == [320] * (len(sent) - 2)  # every packet whole, none dropped to align
    assert counters.reordered_frames == 1 and counters.bad_frames == 1 and counters.gaps == 1
    # The sender switches to PCMU: a new stream, decoded by aiortc's decoder and resampled.
    ulaw = av.CodecContext.create("pcm_mulaw", "w")
    ulaw.sample_rate, ulaw.format, ulaw.layout = 8000, "s16", "mono"
    for k in range(5):
        frame = av.AudioFrame.from_ndarray(tone(0.02, 8000)[None, :], format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 8000, k * 160, fractions.Fraction(1, 8000)
        for packet in ulaw.encode(frame):
            decode(PCMU, bytes(packet), k * 160)
    assert counters.stream_breaks == 1
    assert sum(len(a) for a in session.audio) > (len(sent) - 2) * 320 + 3 * 320


def test_inline_decoding_stops_when_the_session_closed():
    session, counters = Session(), InboundCounters()
    decode = InlineDecoder(InboundAudio(session, counters))
    session.closed = True
    decode(OPUS, packets(tone(0.02))[0], 0)
    assert session.audio == [] and counters.frames == 0


def test_the_audio_level_is_aiortcs():
    rng = np.random.default_rng(3)
    for level in (0.0, 1e-6, 1e-3, 0.01, 0.3, 1.0):
        pcm = np.clip(rng.normal(0, level, 960) * 32767, -32768, 32767).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm[None, :], format="s16", layout="mono")
        frame.sample_rate = 48000
        assert audio_level_dbov(pcm) == rtp.compute_audio_level_dbov(frame)


async def test_the_inline_encoder_sounds_as_aiortcs_did():
    # Same level (aiortc upmixed mono to stereo at -3 dB) and the same tail after a cut to silence.
    import fractions

    from aiortc.codecs.opus import OpusDecoder as AiortcDecoder, OpusEncoder as AiortcEncoder
    from aiortc.jitterbuffer import JitterFrame
    from aiortc.rtcrtpsender import RTCEncodedFrame

    from lychee_rtc.pcm import FrameResampler
    from lychee_rtc.rtc.inline_encoder import InlineEncoding
    from lychee_rtc.rtc.packet_time import PcmFrame

    rng = np.random.default_rng(5)
    t = np.arange(48000) / 48000
    speechy = 0.3 * np.sin(2 * np.pi * 180 * t) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t)) + rng.normal(0, 0.05, len(t))
    pcm = (np.concatenate([speechy, np.zeros(24000)]) * 32767).astype(np.int16)
    frames = [pcm[i:i + 960] for i in range(0, len(pcm), 960)]

    class Track:
        def __init__(self):
            self.n = 0

        async def next_pcm(self):
            self.n += 1
            return PcmFrame(frames[self.n - 1], (self.n - 1) * 960, 48000)

    inline = InlineEncoding(type("Sender", (), {"_enabled": True})(), Track(), RTCEncodedFrame)
    ours = [(await inline.next_encoded_frame(OPUS)).payloads[0] for _ in frames]
    theirs, encoder = [], AiortcEncoder()
    for i, f in enumerate(frames):
        frame = av.AudioFrame.from_ndarray(f[None, :], format="s16", layout="mono")
        frame.sample_rate, frame.pts, frame.time_base = 48000, i * 960, fractions.Fraction(1, 48000)
        theirs += encoder.encode(frame)[0]

    def heard(payloads):  # what an aiortc caller decodes, as mono
        decoder, resampler, out = AiortcDecoder(), FrameResampler("flt", "mono", 48000), []
        for i, p in enumerate(payloads):
            for frame in decoder.decode(JitterFrame(p, i * 960)):
                out += [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
        return np.concatenate(out)

    a, b = heard(ours), heard(theirs)
    level = lambda x: np.sqrt(np.mean(x[9600:38400] ** 2))
    assert 20 * np.log10(level(a) / level(b)) == pytest.approx(0.0, abs=0.5)
    assert np.abs(a[48000 + 480:]).max() < 2 * max(np.abs(b[48000 + 480:]).max(), 5e-4)
