"""A caller on speakerphone: what the agent says comes back into the caller's microphone.

The room is a shoebox simulated by pyroomacoustics (image source method, the test extra): its
impulse response from the loudspeaker to the microphone, normalised to unit energy, so ``echo_db``
alone sets how loud the echo is against the caller's own speech. The loudspeaker plays the downlink
as it arrives; the microphone hears it ``delay_ms`` later (the phone's playout and capture buffers
and the air) through the room, plus the caller's speech and steady noise at ``snr_db`` below it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from lychee_rtc.bench.carrier import CarrierEmulator
from lychee_rtc.bench.client import FRAME, MicrophoneTrack, RtcClient

# A furnished office and a phone on the desk: moderately absorbent walls, the loudspeaker half a
# metre from the microphone (a desk unit), the caller a little further off.
ROOM_DIM_M = (5.0, 4.0, 3.0)
LOUDSPEAKER_M = (2.0, 2.0, 1.0)
MICROPHONE_M = (2.4, 2.3, 1.0)
ABSORPTION = 0.35
MAX_ORDER = 12
MAX_ECHO_BUFFER_S = 2.0


def room_impulse_response(rate: int) -> np.ndarray:
    """The loudspeaker-to-microphone impulse response of the room above, at ``rate``, unit energy."""
    import pyroomacoustics as pra

    room = pra.ShoeBox(list(ROOM_DIM_M), fs=rate, materials=pra.Material(ABSORPTION), max_order=MAX_ORDER)
    room.add_source(list(LOUDSPEAKER_M))
    room.add_microphone(list(MICROPHONE_M))
    room.compute_rir()
    rir = np.asarray(room.rir[0][0], dtype=np.float64)
    return (rir / np.sqrt(np.sum(rir ** 2))).astype(np.float32)


def pink_noise(n: int, seed: int = 7) -> np.ndarray:
    """Noise with a 1/f spectrum (a fan, traffic through a window), unit RMS."""
    rng = np.random.default_rng(seed)
    spectrum = np.fft.rfft(rng.standard_normal(n))
    f = np.arange(len(spectrum), dtype=np.float64)
    f[0] = 1.0
    x = np.fft.irfft(spectrum / np.sqrt(f), n)
    return (x / np.sqrt(np.mean(x ** 2))).astype(np.float32)


def rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x, dtype=np.float64)))) if len(x) else 0.0


@dataclass(frozen=True)
class RoomSetup:
    echo_db: float = 0.0  # echo level against the caller's speech (0: as loud; -10: 10 dB quieter)
    delay_ms: float = 120.0  # loudspeaker playout + microphone capture + air, on top of the network
    snr_db: float = 25.0  # the caller's speech over the room's noise
    speech_rms: float = 0.1  # the caller's speech level the echo and noise are set against


class EchoPath:
    """Loudspeaker to microphone: convolved with the room, delayed, scaled; streamed frame by frame."""

    def __init__(self, rir: np.ndarray, gain: float, delay: int) -> None:
        from scipy.signal import oaconvolve

        self._convolve = oaconvolve
        self.rir = rir
        self.gain = gain
        self._tail = np.zeros(len(rir) - 1, np.float32)
        self._fifo: deque[np.ndarray] = deque([np.zeros(delay, np.float32)])
        self._queued = delay
        self._limit = delay + int(MAX_ECHO_BUFFER_S * 48000)  # generous at any rate

    def hear(self, pcm: np.ndarray) -> None:
        """The loudspeaker plays ``pcm``."""
        y = self._convolve(pcm.astype(np.float32), self.rir).astype(np.float32)  # len(pcm) + len(rir) - 1
        y[:len(self._tail)] += self._tail  # the room still rings with what played before
        self._tail = y[len(pcm):].copy()
        self._fifo.append(self.gain * y[:len(pcm)])
        self._queued += len(pcm)
        while self._queued > self._limit:  # bounded: a stalled microphone does not grow it
            self._queued -= len(self._fifo.popleft())

    def take(self, n: int) -> np.ndarray:
        out = np.zeros(n, np.float32)
        pos = 0
        while pos < n and self._fifo:
            head = self._fifo[0]
            k = min(n - pos, len(head))
            out[pos:pos + k] = head[:k]
            pos += k
            self._queued -= k
            if k == len(head):
                self._fifo.popleft()
            else:
                self._fifo[0] = head[k:]
        return out


class SpeakerphoneMic(MicrophoneTrack):
    """The caller's microphone: their queued speech, the room's echo of the downlink, and noise."""

    def __init__(self, path: EchoPath, noise: np.ndarray) -> None:
        super().__init__()
        self.path = path
        self.noise = noise
        self._noise_pos = 0
        self.echo_energy = 0.0  # of the echo that reached the microphone, summed over frames

    def _take(self) -> np.ndarray:
        speech = super()._take()
        echo = self.path.take(FRAME)
        self.echo_energy += float(np.sum(np.square(echo, dtype=np.float64)))
        idx = (self._noise_pos + np.arange(FRAME)) % len(self.noise)
        self._noise_pos = (self._noise_pos + FRAME) % len(self.noise)
        return speech + echo + self.noise[idx]


def speakerphone_client(base_url: str, setup: RoomSetup, rate: int = 48000) -> RtcClient:
    """An ``RtcClient`` whose microphone hears what it receives through the room of ``setup``."""
    client = RtcClient(base_url)
    # The agent speaks at about the caller's level (the echo engine replays the caller), so the echo's
    # gain against the caller's speech is the gain of the path.
    path = EchoPath(room_impulse_response(rate), 10 ** (setup.echo_db / 20), int(setup.delay_ms * rate / 1000))
    noise = pink_noise(rate * 10) * setup.speech_rms * 10 ** (-setup.snr_db / 20)
    client.mic = SpeakerphoneMic(path, noise)
    client.on_audio.append(path.hear)
    return client


class CarrierSpeakerphone:
    """A phone on speaker behind a carrier: the carrier emulator's playout (what it has played of the
    server's audio, by its own play clock, cut where a flush cut it) goes through the room into the
    caller's uplink, which is sent every frame, with the caller's queued speech and noise."""

    def __init__(self, phone: CarrierEmulator, setup: RoomSetup) -> None:
        self.phone = phone
        self.rate = phone.rate
        self.frame = phone.rate * phone.frame_ms // 1000
        self.path = EchoPath(room_impulse_response(self.rate), 10 ** (setup.echo_db / 20),
                             int(setup.delay_ms * self.rate / 1000))
        self.noise = pink_noise(self.rate * 10) * setup.speech_rms * 10 ** (-setup.snr_db / 20)
        self.echo_energy = 0.0
        self._speech: deque[np.ndarray] = deque()
        self._t0: float | None = None
        self._rendered = 0  # loudspeaker samples rendered so far (from _t0)

    def say(self, samples: np.ndarray) -> None:
        """Queue the caller's speech (at the carrier's rate) behind what is queued."""
        self._speech.append(np.asarray(samples, np.float32))

    def _loudspeaker(self, until: float) -> np.ndarray:
        """What the carrier's playout played from the last call up to ``until``."""
        assert self._t0 is not None
        end = int(round((until - self._t0) * self.rate))
        out = np.zeros(max(0, end - self._rendered), np.float32)
        for a in self.phone.log.audio[-200:]:
            stop = a.play_start + len(a.samples) / self.rate
            if a.cut_at is not None:
                stop = min(stop, a.cut_at)
            first = int(round((a.play_start - self._t0) * self.rate))
            lo, hi = max(first, self._rendered), min(first + int(round((stop - a.play_start) * self.rate)), end)
            if lo < hi:
                out[lo - self._rendered:hi - self._rendered] = a.samples[lo - first:hi - first]
        self._rendered = max(self._rendered, end)
        return out

    def _speech_frame(self) -> np.ndarray:
        out = np.zeros(self.frame, np.float32)
        pos = 0
        while pos < self.frame and self._speech:
            head = self._speech[0]
            k = min(self.frame - pos, len(head))
            out[pos:pos + k] = head[:k]
            pos += k
            if k == len(head):
                self._speech.popleft()
            else:
                self._speech[0] = head[k:]
        return out

    async def run(self) -> None:
        """Send the microphone, frame by frame in real time, until the call's socket closes."""
        import asyncio
        import time

        self._t0 = time.monotonic()
        k = 0
        noise_pos = 0
        while not self.phone.closed.is_set():
            due = self._t0 + (k + 1) * self.frame / self.rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            played = self._loudspeaker(due)
            self.path.hear(played)
            echo = self.path.take(self.frame)
            self.echo_energy += float(np.sum(np.square(echo, dtype=np.float64)))
            idx = (noise_pos + np.arange(self.frame)) % len(self.noise)
            noise_pos = (noise_pos + self.frame) % len(self.noise)
            await self.phone.send_frame(np.clip(self._speech_frame() + echo + self.noise[idx], -1.0, 1.0))
            k += 1
