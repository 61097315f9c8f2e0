"""G.711 mu-law and A-law, and 16-bit linear PCM, as pure numpy functions.

Carriers send and expect 8-bit G.711 (or raw 16-bit little-endian PCM) as bytes. Decoding is one
lookup in a 256-entry table; encoding is one lookup in a 65,536-entry table indexed by the 16-bit
sample, both built once from the companding rules of ITU-T G.711 (the segment/mantissa form of
the classic reference implementation).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

MULAW_BIAS = 0x84
MULAW_CLIP = 32635
ALAW_SEGMENT_ENDS = (0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF)


def _mulaw_decode_one(code: int) -> int:
    code = ~code & 0xFF
    exponent = (code >> 4) & 0x07
    magnitude = ((((code & 0x0F) << 3) + MULAW_BIAS) << exponent) - MULAW_BIAS
    return -magnitude if code & 0x80 else magnitude


def _mulaw_encode_one(sample: int) -> int:
    sign = 0x80 if sample < 0 else 0
    magnitude = min(-sample if sample < 0 else sample, MULAW_CLIP) + MULAW_BIAS
    exponent = max(0, magnitude.bit_length() - 8)
    mantissa = (magnitude >> (exponent + 3)) & 0x0F
    return ~(sign | (exponent << 4) | mantissa) & 0xFF


def _alaw_decode_one(code: int) -> int:
    code ^= 0x55
    value = (code & 0x0F) << 4
    segment = (code & 0x70) >> 4
    if segment == 0:
        value += 8
    else:
        value = (value + 0x108) << (segment - 1)
    return value if code & 0x80 else -value


def _alaw_encode_one(sample: int) -> int:
    value = sample >> 3  # A-law works on 13 bits
    if value >= 0:
        mask = 0xD5
    else:
        mask = 0x55
        value = -value - 1
    segment = next((i for i, end in enumerate(ALAW_SEGMENT_ENDS) if value <= end), 8)
    if segment >= 8:
        return 0x7F ^ mask
    code = segment << 4
    code |= (value >> 1 if segment < 2 else value >> segment) & 0x0F
    return code ^ mask


@lru_cache(maxsize=None)
def _decode_table(law: str) -> np.ndarray:
    one = _mulaw_decode_one if law == "mulaw" else _alaw_decode_one
    return np.array([one(c) for c in range(256)], dtype=np.int16)


@lru_cache(maxsize=None)
def _encode_table(law: str) -> np.ndarray:
    """Indexed by the 16-bit sample viewed as unsigned (so -1 is at 65535)."""
    one = _mulaw_encode_one if law == "mulaw" else _alaw_encode_one
    samples = np.arange(65536, dtype=np.int64)
    samples[samples >= 32768] -= 65536
    return np.array([one(int(s)) for s in samples], dtype=np.uint8)


def _check_law(law: str) -> None:
    if law not in ("mulaw", "alaw"):
        raise ValueError(f"unknown G.711 law {law!r} (mulaw or alaw)")


def g711_decode(data: bytes, law: str = "mulaw") -> np.ndarray:
    """G.711 bytes -> float32 samples in [-1, 1)."""
    _check_law(law)
    codes = np.frombuffer(data, dtype=np.uint8)
    return _decode_table(law)[codes].astype(np.float32) / 32768.0


def g711_encode(samples: np.ndarray, law: str = "mulaw") -> bytes:
    """Float samples in [-1, 1] -> G.711 bytes (one per sample)."""
    _check_law(law)
    pcm16 = float_to_pcm16(samples)
    return _encode_table(law)[pcm16.view(np.uint16)].tobytes()


def float_to_pcm16(samples: np.ndarray) -> np.ndarray:
    return np.round(np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0) * 32767.0).astype(np.int16)


def pcm16_decode(data: bytes) -> np.ndarray:
    """16-bit little-endian PCM bytes -> float32 samples (an odd trailing byte is an error)."""
    if len(data) % 2:
        raise ValueError(f"16-bit PCM payload has an odd length ({len(data)} bytes)")
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def pcm16_encode(samples: np.ndarray) -> bytes:
    return float_to_pcm16(samples).astype("<i2").tobytes()
