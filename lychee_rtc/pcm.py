"""PCM helpers shared by every layer (media, engines, vocoder, tools): resampling and WAV files.

Stateful mono resampling uses PyAV (libswresample). One ``PcmResampler`` per continuous stream:
its filter state carries across calls so chunk boundaries are inaudible, and a new stream (a new
response, a new epoch) gets a new resampler so no filter history from old audio can leak into it.
"""

from __future__ import annotations

import wave
from pathlib import Path

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
        return frames_to_array(self._resampler.resample(frame))

    def flush(self) -> np.ndarray:
        """Drain the filter's delay line; the resampler cannot be used afterwards."""
        if self._passthrough or self._pts == 0:
            return np.zeros(0, dtype=np.float32)
        return frames_to_array(self._resampler.resample(None))


def frames_to_array(frames: list[av.AudioFrame]) -> np.ndarray:
    """Mono float frames (as a ``flt``/``mono`` resampler yields them) as one float32 array."""
    if not frames:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in frames]).astype(np.float32, copy=False)


def write_wav(path: str | Path, samples: np.ndarray, rate: int) -> Path:
    """Mono float samples in [-1, 1] as a 16-bit PCM WAV file."""
    pcm = (np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0) * 32767).astype("<i2")
    path = Path(path)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path
