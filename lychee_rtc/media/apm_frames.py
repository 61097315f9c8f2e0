"""One WebRTC audio processing module (the ``livekit`` package's) fed float 10 ms frames.

The module takes 16-bit PCM in a frame object whose buffer it processes in place, through one
foreign call per frame. Each direction of each module owns one frame and its buffer for the whole
call, and samples go in and out through a numpy view of that buffer: per 10 ms nothing is built but
the float output, where a fresh frame, ``bytes`` and ``bytearray`` per call cost about as much as
the call itself (docs/benchmarks.md, "Concurrent calls").

The conversion is the one the stage has always used: clipped to [-1, 1], scaled by 32767 and
truncated on the way in; divided by 32768 on the way out.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class ApmFrames:
    """``module`` (an ``AudioProcessingModule``) with reused frames of ``frame`` samples at ``rate``, mono."""

    def __init__(self, module: Any, frame_cls: Any, rate: int, frame: int) -> None:
        self.module = module
        self.frame = frame
        self._scaled = np.empty(frame, np.float32)
        self._capture, self._capture_pcm = _frame(frame_cls, rate, frame)
        self._render, self._render_pcm = _frame(frame_cls, rate, frame)

    def process(self, samples: np.ndarray) -> np.ndarray:
        """The uplink (near end): ``frame`` float samples in, the module's output as new float32 samples."""
        self._load(self._capture_pcm, samples)
        self.module.process_stream(self._capture)
        return self._capture_pcm.astype(np.float32) / 32768.0

    def process_reverse(self, samples: np.ndarray) -> None:
        """The far end (what the caller's loudspeaker played): ``frame`` float samples, for the canceller."""
        self._load(self._render_pcm, samples)
        self.module.process_reverse_stream(self._render)

    def _load(self, pcm: np.ndarray, samples: np.ndarray) -> None:
        # Into float32 first, as the clip of a float32 frame gives, then truncated to int16 on assignment.
        np.clip(samples, -1.0, 1.0, out=self._scaled)
        self._scaled *= 32767.0
        pcm[:] = self._scaled


def _frame(frame_cls: Any, rate: int, frame: int) -> tuple[Any, np.ndarray]:
    """A frame over a buffer of its own, and a writable int16 view of that buffer."""
    buffer = bytearray(frame * 2)
    return frame_cls(buffer, rate, 1, frame), np.frombuffer(buffer, np.int16)
