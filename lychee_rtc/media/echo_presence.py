"""Is the agent's voice coming back on the uplink? Echo found by correlation, for one session.

WebRTC's echo canceller (AEC3) starts every call assuming the echo may be as loud as what the agent
plays, and until it has found an echo path (or, seconds of agent speech later, concluded there is
none) its suppressor takes the caller's voice down by up to 40 dB whenever the agent speaks. A
barge-in is the caller speaking while the agent speaks, so on a line without echo (a handset, a
mobile phone, a softphone or a desk unit that cancels its own, i.e. most phone calls) it came
seconds late or never (docs/echo.md, docs/benchmarks.md). So the stage lets the engine hear the
canceller's output only where this finds the echo it is there for.

The test: the normalised cross-correlation of the caller's microphone with what the agent played
(the reference, as the canceller gets it), at every lag up to half a second (as far as AEC3's own
delay search reaches), over the last 512 ms, at 8 kHz, both sides first differenced so the voice's
strong low harmonics do not smear the peak. An echo correlates at its lag (0.8 to 0.95 within the
first 100 ms of an echo 20 dB or more above the room's noise); the caller's own voice against the
agent's does not (at most 0.43 over 20 minutes of other voices against the agent's, docs/echo.md). Echo is declared on the second update in a row
above the threshold at the same lag, and given up after ``RELEASE_S`` of agent speech without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ANALYSIS_RATE = 8000
MAX_LAG_S = 0.512  # AEC3's delay search reaches about this far (docs/echo.md)
WINDOW_S = 0.512  # with the lags, 8192 samples: one power-of-two FFT size
HOP_S = 0.02  # an assessment every 20 ms of uplink
RELEASE_CHECK_EVERY = 5  # ... and every 100 ms once echo is found
DETECT = 0.55  # correlation that counts as echo ...
CONFIRM = 3  # ... in this many updates in a row ...
LAG_TOLERANCE_S = 0.002  # ... at the same lag
RELEASE_S = 10.0  # agent speech without echo that gives it up again (the caller took the phone off speaker)
# Below these the window is silence (an idle line, digital silence between words): no evidence either way.
MIC_FLOOR = 1e-9  # mean square of the differenced microphone, about -90 dBFS
REFERENCE_FLOOR = 1e-8


def _first_difference(x: np.ndarray, previous: float) -> np.ndarray:
    return np.diff(np.concatenate([[previous], x]))


def echo_correlation(mic: np.ndarray, reference: np.ndarray, max_lag: int) -> tuple[float, int] | None:
    """The best normalised correlation of ``mic`` with ``reference`` delayed by 0..``max_lag`` samples,
    and that lag. ``reference`` ends where ``mic`` ends and is ``max_lag`` samples longer. None when
    the microphone or every aligned stretch of the reference is silent."""
    w, n = len(mic), len(reference)
    mic_energy = float(np.dot(mic, mic))
    if mic_energy < MIC_FLOOR * w:
        return None
    # c[j] = sum over p of mic[p] * reference[p + j]; no j in 0..max_lag wraps around, so a circular
    # correlation as long as the reference is exact. mic[p] stands at reference[p + max_lag].
    c = np.fft.irfft(np.conj(np.fft.rfft(mic, n)) * np.fft.rfft(reference), n)
    products = c[max_lag::-1]  # lag 0..max_lag
    cumulative = np.concatenate([[0.0], np.cumsum(np.square(reference))])
    starts = max_lag - np.arange(max_lag + 1)
    reference_energy = cumulative[starts + w] - cumulative[starts]
    live = reference_energy > REFERENCE_FLOOR * w
    if not live.any():
        return None
    rho = np.where(live, products / np.sqrt(mic_energy * np.maximum(reference_energy, 1e-30)), 0.0)
    lag = int(np.argmax(rho))  # an echo is the reference itself, not its inverse
    return float(rho[lag]), lag


@dataclass
class EchoPresenceCounters:
    updates: int = 0  # correlations computed (the window had sound on both sides)
    detections: int = 0  # times echo was declared
    releases: int = 0  # times it was given up
    best: float = 0.0  # the highest correlation seen
    lag_ms: float | None = None  # the echo's lag behind the reference where it was last found


class EchoPresence:
    """Fed the reference and the raw microphone in lockstep (equal lengths) at ``rate``."""

    def __init__(self, rate: int) -> None:
        if rate % ANALYSIS_RATE:
            raise ValueError(f"echo detection runs at multiples of {ANALYSIS_RATE} Hz, not {rate}")
        self._factor = rate // ANALYSIS_RATE
        self._max_lag = int(MAX_LAG_S * ANALYSIS_RATE)
        self._window = int(WINDOW_S * ANALYSIS_RATE)
        self._hop = int(HOP_S * ANALYSIS_RATE)
        self._mic = np.zeros(self._window)
        self._reference = np.zeros(self._window + self._max_lag)
        self._last = (0.0, 0.0)  # the last decimated sample of each, for the first difference
        self._due = self._hop  # samples until the next assessment
        self._hops = 0
        self._streak: list[int] = []  # lags of the assessments in a row above DETECT
        self._quiet = 0  # samples of agent speech without echo since it was last found
        self.echo = False
        self.counters = EchoPresenceCounters()

    def update(self, reference: np.ndarray, mic: np.ndarray) -> bool:
        """Equal lengths of each; returns whether the line carries echo now."""
        ref, m = self._decimate(reference), self._decimate(mic)
        if len(ref) == 0:
            return self.echo
        ref_d, mic_d = _first_difference(ref, self._last[0]), _first_difference(m, self._last[1])
        self._last = (float(ref[-1]), float(m[-1]))
        self._reference = np.concatenate([self._reference[len(ref_d):], ref_d])
        self._mic = np.concatenate([self._mic[len(mic_d):], mic_d])
        self._due -= len(ref)
        while self._due <= 0:
            self._due += self._hop
            self._hops += 1
            # Once found, a slower look is enough to notice it going.
            if not self.echo or self._hops % RELEASE_CHECK_EVERY == 0:
                self._assess(self._hop * (1 if not self.echo else RELEASE_CHECK_EVERY))
        return self.echo

    def _decimate(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, np.float64)
        if self._factor == 1:
            return x
        n = len(x) // self._factor * self._factor
        return x[:n].reshape(-1, self._factor).mean(axis=1)

    def _assess(self, span: int) -> None:
        talking = float(np.mean(np.square(self._reference))) > REFERENCE_FLOOR
        found = echo_correlation(self._mic, self._reference, self._max_lag) if talking else None
        if found is not None:
            self.counters.updates += 1
            self.counters.best = max(self.counters.best, found[0])
        if found is None or found[0] < DETECT:
            self._streak.clear()
            if self.echo and talking:  # the agent speaks and nothing comes back
                self._quiet += span
                if self._quiet >= RELEASE_S * ANALYSIS_RATE:
                    self.echo, self._quiet = False, 0
                    self.counters.releases += 1
            return
        rho, lag = found
        if self._streak and abs(lag - self._streak[-1]) > LAG_TOLERANCE_S * ANALYSIS_RATE:
            self._streak.clear()
        self._streak.append(lag)
        if len(self._streak) >= CONFIRM or self.echo:
            self._quiet = 0
            self.counters.lag_ms = 1000.0 * lag / ANALYSIS_RATE
            if not self.echo:
                self.echo = True
                self.counters.detections += 1
