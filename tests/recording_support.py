"""Reading recordings back with an independent decoder (libsndfile, through soundfile), and lining
up signals for the recording tests."""

from __future__ import annotations

import io
import json
from typing import Any

import aiohttp
import numpy as np
import soundfile

from conftest import wait_until

REC_RATE = 48000
FRAME = REC_RATE // 50  # one 20 ms frame
BLOCK = FRAME // 4  # what last_sound_before reads in


def decode(data: bytes) -> np.ndarray:
    """Ogg/Opus bytes -> (samples, 2) float32 at 48 kHz, through libsndfile (not PyAV)."""
    audio, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    assert rate == REC_RATE and audio.shape[1] == 2, (rate, audio.shape)
    return audio


def sidecar(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def block_rms(x: np.ndarray, hop: int = FRAME // 4) -> np.ndarray:
    n = len(x) // hop
    return np.sqrt(np.mean(x[:n * hop].reshape(n, hop) ** 2, axis=1))


def waveform_lag_of(reference: np.ndarray, other: np.ndarray) -> int:
    """Samples by which ``other`` lags ``reference``, to the sample (for one codec's audio against
    another's decoding of the same PCM, where the waveforms still match)."""
    n = 1 << int(np.ceil(np.log2(len(reference) + len(other))))
    corr = np.fft.irfft(np.fft.rfft(other, n) * np.conj(np.fft.rfft(reference, n)), n)
    k = int(np.argmax(corr))
    return k if k < n // 2 else k - n


def lag_of(reference: np.ndarray, other: np.ndarray, hop: int = 48) -> int:
    """Samples by which ``other`` lags ``reference`` (1 ms envelope cross-correlation)."""
    a, b = block_rms(reference, hop), block_rms(other, hop)
    return waveform_lag_of(a - a.mean(), b - b.mean()) * hop


def correlation_at(reference: np.ndarray, other: np.ndarray, lag: int, hop: int = 480) -> float:
    """Normalised correlation of 10 ms envelopes with ``other`` shifted back by ``lag``."""
    if lag >= 0:
        other = other[lag:]
    else:
        reference = reference[-lag:]
    n = min(len(reference), len(other))
    a, b = block_rms(reference[:n], hop), block_rms(other[:n], hop)
    return float(np.corrcoef(a, b)[0, 1])


def last_sound_before(x: np.ndarray, end: int, threshold: float = 0.003, hop: int = BLOCK) -> int:
    """Sample just past the last ``hop`` block (5 ms at 48 kHz) above ``threshold`` RMS before ``end``."""
    rms = block_rms(x[:end], hop)
    loud = np.flatnonzero(rms > threshold)
    return int((loud[-1] + 1) * hop) if len(loud) else 0


async def fetch_recording(url: str, session_id: str, headers: dict[str, str]) -> tuple[np.ndarray, list[dict]]:
    """Wait for the recording to be finished, then GET its audio and sidecar over HTTP."""
    async with aiohttp.ClientSession() as http:
        async def finished() -> bool:
            async with http.get(f"{url}/v1/recordings", headers=headers) as resp:
                listed = {r["session_id"]: r for r in (await resp.json())["recordings"]}
            return listed.get(session_id, {}).get("status") == "complete"

        await wait_until(finished, 60, "the recording to be finished")
        async with http.get(f"{url}/v1/sessions/{session_id}/recording", headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            assert resp.headers["Content-Type"].startswith("audio/ogg")
            audio = decode(await resp.read())
        async with http.get(f"{url}/v1/sessions/{session_id}/recording/events", headers=headers) as resp:
            assert resp.status == 200
            events = sidecar(await resp.text())
    return audio, events
