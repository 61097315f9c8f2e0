"""Audio as a WebSocket client sends and receives it: an encoding at a rate, in base64.

The OpenAI Realtime dialect knows ``audio/pcm`` (16-bit, 24 kHz only), ``audio/pcmu`` and
``audio/pcma`` (G.711 at 8 kHz); vLLM-Omni's duplex dialect names encodings (``pcm16``,
``pcm_f32le``, ``g711_ulaw``, ``g711_alaw``) and a sample rate. Both become one ``SocketAudioFormat``;
``InputDecoder`` and ``OutputEncoder`` convert between it and the session's float32 PCM, resampling
as needed, so a client may change formats between appends.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from typing import Literal

import numpy as np

from lychee_rtc.pcm import PcmResampler
from lychee_rtc.telephony.g711 import g711_decode, g711_encode, pcm16_decode, pcm16_encode

Encoding = Literal["pcm16", "pcm_f32le", "g711_ulaw", "g711_alaw"]
BYTES_PER_SAMPLE = {"pcm16": 2, "pcm_f32le": 4, "g711_ulaw": 1, "g711_alaw": 1}
MIN_RATE, MAX_RATE = 8000, 48000
# Resampling works through PyAV frames of at most this many seconds (a 15 MiB append is minutes).
RESAMPLE_SLICE_S = 1.0


class AudioFormatError(ValueError):
    """Audio that cannot be decoded as its format says, or a format this server has not."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class SocketAudioFormat:
    encoding: Encoding
    rate: int

    def __post_init__(self) -> None:
        if self.encoding not in BYTES_PER_SAMPLE:
            raise AudioFormatError("unsupported_audio_format", f"unknown audio encoding {self.encoding!r}")
        if self.encoding.startswith("g711") and self.rate != 8000:
            raise AudioFormatError("unsupported_audio_format", f"{self.encoding} is 8000 Hz, not {self.rate}")
        if not MIN_RATE <= self.rate <= MAX_RATE:
            raise AudioFormatError("unsupported_audio_format",
                                   f"sample rate {self.rate} Hz is outside {MIN_RATE}..{MAX_RATE}")

    @property
    def bytes_per_sample(self) -> int:
        return BYTES_PER_SAMPLE[self.encoding]

    def seconds(self, nbytes: int) -> float:
        return nbytes / (self.bytes_per_sample * self.rate)

    def decode(self, data: bytes) -> np.ndarray:
        """Bytes in this format -> float32 samples in [-1, 1]."""
        if len(data) % self.bytes_per_sample:
            raise AudioFormatError("bad_audio", f"{len(data)} bytes are not a whole number of {self.encoding} "
                                   "samples")
        if self.encoding == "pcm16":
            return pcm16_decode(data)
        if self.encoding == "pcm_f32le":
            samples = np.frombuffer(data, dtype="<f4").astype(np.float32)
            if not np.isfinite(samples).all():
                raise AudioFormatError("bad_audio", "pcm_f32le audio holds a sample that is not a finite number")
            return np.clip(samples, -1.0, 1.0)
        return g711_decode(data, "mulaw" if self.encoding == "g711_ulaw" else "alaw")

    def encode(self, samples: np.ndarray) -> bytes:
        if self.encoding == "pcm16":
            return pcm16_encode(samples)
        if self.encoding == "pcm_f32le":
            return np.clip(samples, -1.0, 1.0).astype("<f4").tobytes()
        return g711_encode(samples, "mulaw" if self.encoding == "g711_ulaw" else "alaw")


PCM16_24K = SocketAudioFormat("pcm16", 24000)
PCMU = SocketAudioFormat("g711_ulaw", 8000)
PCMA = SocketAudioFormat("g711_alaw", 8000)


def decode_base64(text: str) -> bytes:
    """Strict base64 (the whole string, standard alphabet, padded): a typed error otherwise."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise AudioFormatError("bad_audio", f"audio is not valid base64: {exc}") from None


def encode_base64(data: bytes) -> str:
    return binascii.b2a_base64(data, newline=False).decode("ascii")


class _Converter:
    """A rate change through a stateful resampler, rebuilt when the rate on one side changes."""

    def __init__(self) -> None:
        self._resampler: PcmResampler | None = None
        self._rates: tuple[int, int] | None = None

    def convert(self, samples: np.ndarray, in_rate: int, out_rate: int) -> np.ndarray:
        if in_rate == out_rate:
            return samples
        if self._rates != (in_rate, out_rate):
            self.close()
            self._resampler, self._rates = PcmResampler(in_rate, out_rate), (in_rate, out_rate)
        assert self._resampler is not None
        step = int(RESAMPLE_SLICE_S * in_rate)
        parts = [self._resampler.process(samples[i:i + step]) for i in range(0, len(samples), step)]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def close(self) -> None:
        if self._resampler is not None:
            self._resampler.close()
        self._resampler, self._rates = None, None


class InputDecoder(_Converter):
    """Appended audio -> the session's input rate."""

    def __init__(self, rate: int) -> None:
        super().__init__()
        self.rate = rate

    def decode(self, data: bytes, fmt: SocketAudioFormat) -> np.ndarray:
        return self.convert(fmt.decode(data), fmt.rate, self.rate)


class OutputEncoder(_Converter):
    """The session's output PCM -> the client's format."""

    def __init__(self, rate: int) -> None:
        super().__init__()
        self.rate = rate

    def encode(self, samples: np.ndarray, fmt: SocketAudioFormat) -> bytes:
        return fmt.encode(self.convert(samples, self.rate, fmt.rate))
