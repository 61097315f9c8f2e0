"""Latency probes: a short chirp injected into the uplink and found again in the downlink.

Pure functions of arrays and timestamps, so the method can be tested without a network.
"""

from __future__ import annotations

import numpy as np

RATE = 48000
FRAME = RATE // 50


def chirp(duration_s: float = 0.02, f0: float = 400.0, f1: float = 3200.0, amplitude: float = 0.6,
          rate: int = RATE) -> np.ndarray:
    """A Hann-windowed linear chirp: short, sharp autocorrelation, inside the 16 kHz path's band."""
    t = np.arange(int(duration_s * rate)) / rate
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t * t / (2 * duration_s))
    return (amplitude * np.hanning(len(t)) * np.sin(phase)).astype(np.float32)


# Consecutive probes use different chirps, so a late or lost probe is never mistaken for the next one.
SIGNATURES = ((400.0, 3200.0), (3200.0, 400.0), (900.0, 2200.0), (2200.0, 900.0))


def probe_for(index: int) -> np.ndarray:
    f0, f1 = SIGNATURES[index % len(SIGNATURES)]
    return chirp(f0=f0, f1=f1)


def matched_filter(signal: np.ndarray, probe: np.ndarray) -> np.ndarray:
    """Normalised cross-correlation of ``probe`` at every offset of ``signal`` (FFT based)."""
    n = len(signal) + len(probe) - 1
    size = 1 << (n - 1).bit_length()
    corr = np.fft.irfft(np.fft.rfft(signal, size) * np.conj(np.fft.rfft(probe, size)), size)[: len(signal)]
    energy = np.convolve(signal.astype(np.float64) ** 2, np.ones(len(probe)), mode="full")[len(probe) - 1:]
    energy = energy[: len(signal)]
    norm = np.sqrt(np.maximum(energy, 1e-12) * float(np.sum(probe.astype(np.float64) ** 2)))
    return corr / norm


# A detection must carry at least this share of the probe's RMS level (-30 dB). The normalised
# score ignores level, and Opus coding digital silence after a chirp can leave faint shapes of it
# 70 dB and more down, which score like a chirp; no probe comes back that quiet.
MIN_LEVEL = 0.03


def find_onsets(signal: np.ndarray, probe: np.ndarray, threshold: float = 0.6,
                min_level: float = MIN_LEVEL) -> list[int]:
    """Offsets where ``probe`` starts in ``signal`` (one per probe: local maxima above threshold, at
    no less than ``min_level`` of the probe's RMS level)."""
    score = matched_filter(signal, probe)
    onsets: list[int] = []
    i = 0
    n = len(probe)
    floor = min_level * float(np.sqrt(np.mean(probe.astype(np.float64) ** 2)))
    while i < len(score):
        if score[i] >= threshold:
            j = i + int(np.argmax(score[i:i + n]))
            segment = signal[j:j + n].astype(np.float64)
            if np.sqrt(np.mean(segment ** 2)) >= floor:
                onsets.append(j)
            i = j + n
        else:
            i += 1
    return onsets


def send_time(sample: int, frame_send_times: dict[int, float], frame: int = FRAME) -> float | None:
    """When ``sample`` of the uplink entered the WebRTC sender: its frame's hand-over plus its place in it.

    The same convention as ``arrival_time`` on the other end, so the difference is the path's delay.
    A physical microphone and loudspeaker would add their own buffering (e.g. half a capture
    buffer on average) to any system measured this way.
    """
    sent = frame_send_times.get(sample // frame)
    return None if sent is None else sent + (sample % frame) / RATE


def arrival_time(sample: int, chunks: list[tuple[int, int, float]]) -> float | None:
    """When ``sample`` of the downlink reached the listener: its frame's arrival plus its place in it."""
    for offset, length, arrival in chunks:
        if offset <= sample < offset + length:
            return arrival + (sample - offset) / RATE
    return None


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
