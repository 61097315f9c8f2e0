"""Silero VAD (its ONNX model ships in ``engine/data/``, MIT licence beside it) with explicit per-stream state.

The model is stateless from onnxruntime's point of view: its recurrent state and the 64-sample
context are passed in and out, so one ``InferenceSession`` serves every slot and a stream's state
is a small value the slot owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

SAMPLE_RATE = 16000
CHUNK = 512  # 32 ms, the model's native step at 16 kHz
CONTEXT = 64


# Kept in the package rather than taken from the silero-vad wheel, which would pull in PyTorch.
MODEL_PATH = Path(__file__).resolve().parent / "data" / "silero_vad.onnx"


@dataclass
class VadStream:
    state: np.ndarray = field(default_factory=lambda: np.zeros((2, 1, 128), dtype=np.float32))
    context: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT, dtype=np.float32))
    pending: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))


class SileroVad:
    def __init__(self) -> None:
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1
        opts.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(MODEL_PATH), sess_options=opts, providers=["CPUExecutionProvider"])
        self._sr = np.array(SAMPLE_RATE, dtype=np.int64)

    def process(self, stream: VadStream, samples: np.ndarray) -> np.ndarray:
        """Speech probability for every complete 512-sample chunk; the remainder waits in ``stream``."""
        data = np.concatenate([stream.pending, np.asarray(samples, dtype=np.float32)])
        n = len(data) // CHUNK
        probs = np.empty(n, dtype=np.float32)
        for i in range(n):
            chunk = data[i * CHUNK:(i + 1) * CHUNK]
            x = np.concatenate([stream.context, chunk])[None, :]
            out, stream.state = self._session.run(None, {"input": x, "state": stream.state, "sr": self._sr})
            stream.context = chunk[-CONTEXT:].copy()
            probs[i] = float(out[0, 0])
        stream.pending = data[n * CHUNK:].copy()
        return probs
