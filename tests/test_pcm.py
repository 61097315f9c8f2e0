"""The server's resamplers give what PyAV's own resampler gives, sample for sample."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np
import pytest

from lychee_rtc.pcm import FrameResampler, PcmResampler, frames_to_array

RATES = [(48000, 16000), (16000, 48000), (8000, 16000), (24000, 16000), (44100, 16000), (16000, 24000)]


def _frames(rate: int, sizes: list[int], seed: int) -> list[av.AudioFrame]:
    rng = np.random.default_rng(seed)
    frames, pts = [], 0
    for n in sizes:
        f = av.AudioFrame.from_ndarray(rng.normal(0, 0.2, (1, n)).astype(np.float32), format="flt", layout="mono")
        f.sample_rate, f.pts, f.time_base = rate, pts, Fraction(1, rate)
        pts += n
        frames.append(f)
    return frames


def _sizes(rate: int, seed: int) -> list[int]:
    """20 ms frames, then uneven ones down to a single sample (a jitter buffer's, a gap filler's)."""
    rng = np.random.default_rng(seed)
    return [rate // 50] * 20 + [int(n) for n in rng.integers(1, rate // 25, 60)] + [1, 2, 3] + [rate // 100] * 10


@pytest.mark.parametrize("source,target", RATES)
def test_each_frame_comes_out_as_from_pyav_resampler_and_nothing_is_left_behind(source, target):
    frames = _frames(source, _sizes(source, source + target), seed=target)
    ours = FrameResampler("flt", "mono", target)
    theirs = av.AudioResampler(format="flt", layout="mono", rate=target)
    for frame in frames:
        got = frames_to_array(ours.resample(frame))
        want = frames_to_array(theirs.resample(frame))
        # Frame by frame, not only in total: what a frame gives must leave with it (no frame held back).
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(frames_to_array(ours.resample(None)), frames_to_array(theirs.resample(None)))


def test_fixed_size_output_frames_are_all_handed_out():
    frames = _frames(48000, _sizes(48000, 7), seed=3)
    ours = FrameResampler("s16", "mono", 48000, frame_size=960)
    theirs = av.AudioResampler(format="s16", layout="mono", rate=48000, frame_size=960)
    for frame in frames:
        got, want = ours.resample(frame), theirs.resample(frame)
        assert [f.samples for f in got] == [f.samples for f in want]
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a.to_ndarray(), b.to_ndarray())


def test_pcm_resampler_streams_as_one_call_does():
    rng = np.random.default_rng(11)
    pcm = rng.normal(0, 0.2, 48000).astype(np.float32)
    whole = PcmResampler(48000, 16000)
    at_once = np.concatenate([whole.process(pcm), whole.flush()])
    chunked = PcmResampler(48000, 16000)
    cuts = np.sort(rng.choice(np.arange(1, len(pcm)), 200, replace=False))
    pieces = [chunked.process(p) for p in np.split(pcm, cuts)] + [chunked.flush()]
    streamed = np.concatenate(pieces)
    assert len(streamed) == len(at_once)
    np.testing.assert_allclose(streamed, at_once, atol=1e-6)
