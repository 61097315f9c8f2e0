"""The inbound path on its own: decoded frames in, 16 kHz samples and gaps out."""

from __future__ import annotations

import fractions

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError

from lychee_rtc.engine.base import EngineCapabilities
from lychee_rtc.media.uplink import InboundCounters
from lychee_rtc.rtc.inbound import consume_audio


class ScriptedTrack(MediaStreamTrack):
    """Plays a list of (pts, sample_rate, layout) frames, then ends."""

    kind = "audio"

    def __init__(self, frames):
        super().__init__()
        self._frames = list(frames)

    async def recv(self):
        if not self._frames:
            raise MediaStreamError
        pts, rate, layout = self._frames.pop(0)
        n = rate // 50
        channels = 2 if layout == "stereo" else 1
        data = (np.full((1, n * channels), 1000, np.int16))
        frame = av.AudioFrame.from_ndarray(data, format="s16", layout=layout)
        frame.sample_rate = rate
        frame.pts = pts
        frame.time_base = fractions.Fraction(1, rate)
        return frame


class RecordingSession:
    """Just what consume_audio talks to."""

    id = "test"
    closed = False
    capabilities = EngineCapabilities("test", 16000, 24000, 6400, 1)

    def __init__(self):
        self.samples = 0
        self.gaps: list[int] = []

    def push_audio(self, samples, now=None):
        self.samples += len(samples)

    def push_gap(self, n, now=None, fill=None):
        assert fill is None or len(fill) == n
        self.gaps.append(n)


async def test_loss_is_a_gap_but_huge_jumps_and_codec_switches_are_stream_breaks():
    opus = [(k * 960, 48000, "stereo") for k in range(10)]
    lost = [(k * 960, 48000, "stereo") for k in range(12, 20)]  # frames 10 and 11 lost
    backward = [((k - 5000) * 960 % 2**32, 48000, "stereo") for k in range(3)]  # a wrapped-around step back
    g711 = [(k * 160, 8000, "mono") for k in range(5)]  # the sender switched to PCMU
    session, counters = RecordingSession(), InboundCounters()
    await consume_audio(ScriptedTrack(opus + lost + backward + g711), session, counters)
    assert session.gaps == [640]  # the two lost frames, in 16 kHz samples; nothing else
    assert counters.stream_breaks == 2 and counters.gaps == 1
    assert counters.frames == 10 + 8 + 3 + 5
    # Every frame but the first (dropped to align windows to packets) became samples.
    assert 24 * 320 - 40 <= session.samples <= 25 * 320
