"""Stateful mono resampling with PyAV (libswresample).

One ``PcmResampler`` per continuous stream: its filter state carries across calls so chunk
boundaries are inaudible, and a new stream (a new response, a new epoch) gets a new resampler so
no filter history from old audio can leak into it.
"""

from __future__ import annotations

import av
import numpy as np


class PcmResampler:
    def __init__(self, in_rate: int, out_rate: int) -> None:
        self.in_rate = in_rate
        self.out_rate = out_rate
        self._passthrough = in_rate == out_rate
        self._resampler = None if self._passthrough else av.AudioResampler(format="flt", layout="mono", rate=out_rate)
        self._pts = 0

    def process(self, pcm: np.ndarray) -> np.ndarray:
        pcm = np.ascontiguousarray(pcm, dtype=np.float32).reshape(-1)
        if self._passthrough or len(pcm) == 0:
            return pcm.copy()
        frame = av.AudioFrame.from_ndarray(pcm[None, :], format="flt", layout="mono")
        frame.sample_rate = self.in_rate
        frame.pts = self._pts
        self._pts += len(pcm)
        return self._collect(self._resampler.resample(frame))

    def flush(self) -> np.ndarray:
        """Drain the filter's delay line; the resampler cannot be used afterwards."""
        if self._passthrough or self._pts == 0:
            return np.zeros(0, dtype=np.float32)
        return self._collect(self._resampler.resample(None))

    @staticmethod
    def _collect(frames: list[av.AudioFrame]) -> np.ndarray:
        if not frames:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32, copy=False)


def frame_to_mono_float(frame: av.AudioFrame, resampler: av.AudioResampler) -> np.ndarray:
    """Decode-side helper: any av.AudioFrame through ``resampler`` (flt, mono, target rate)."""
    return PcmResampler._collect(resampler.resample(frame))
