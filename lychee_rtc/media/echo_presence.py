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
delay search reaches), over the last 500 ms, at 8 kHz, both sides first differenced so the voice's
strong low harmonics do not smear the peak. An echo correlates at its lag (0.8 to 0.95 within the
first 100 ms of an echo 20 dB or more above the room's noise); the caller's own voice against the
agent's does not (at most 0.43 over 20 minutes of other voices against the agent's, docs/echo.md).
Echo is declared on the third update in a row above the threshold at the same lag, and given up
after ``RELEASE_S`` of agent speech without it.

The correlation is kept up to date block by block (``SlidingCorrelation``) rather than computed
afresh every 20 ms (three 8192-point transforms each time, most of the stage's own cost): each new
20 ms of microphone is correlated once, in the frequency domain, against spectra of the reference
already taken, and taken out again when it leaves the window. The sums equal the direct
correlation's (``echo_correlation``, which the tests hold it to).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

ANALYSIS_RATE = 8000
MAX_LAG_S = 0.512  # AEC3's delay search reaches about this far (docs/echo.md)
WINDOW_HOPS = 25  # the window correlated: 500 ms, a whole number of blocks (HOP_S)
REBUILD_HOPS = 250  # the running sums are recomputed exactly this often (5 s), so no rounding accumulates
HOP_S = 0.02  # an assessment every 20 ms of uplink, and the block the correlation is kept up to date by
RELEASE_CHECK_EVERY = 5  # ... and every 100 ms once echo is found
# A line that has shown no echo over this much agent speech is assessed only every COARSE_EVERY
# blocks (80 ms) until a correlation above DETECT comes, then every block again: an echo that begins
# later (the caller switches to speaker) is declared at most 60 ms later than on the finer hop.
COARSE_AFTER_S = 3.0
COARSE_EVERY = 4
DETECT = 0.55  # correlation that counts as echo ...
CONFIRM = 3  # ... in this many updates in a row ...
LAG_TOLERANCE_S = 0.002  # ... at the same lag
RELEASE_S = 10.0  # agent speech without echo that gives it up again (the caller took the phone off speaker)
# Below these the window is silence (an idle line, digital silence between words): no evidence either way.
MIC_FLOOR = 1e-9  # mean square of the differenced microphone, about -90 dBFS
REFERENCE_FLOOR = 1e-8


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
    cumulative = np.concatenate([[0.0], np.cumsum(np.square(reference))])
    reference_energy = cumulative[max_lag + w:w - 1:-1] - cumulative[max_lag::-1]  # lag 0..max_lag
    return normalised(c[max_lag::-1], mic_energy, reference_energy, w)


def normalised(products: np.ndarray, mic_energy: float, reference_energy: np.ndarray,
               w: int) -> tuple[float, int] | None:
    """``products[j]`` (lag 0..max_lag) over ``w`` samples of microphone whose energy is ``mic_energy``,
    normalised by the energy of the reference aligned at each lag: the best correlation and its lag;
    None where every aligned stretch of the reference is silent."""
    live = reference_energy > REFERENCE_FLOOR * w
    if not live.any():
        return None
    rho = np.where(live, products / np.sqrt(mic_energy * np.maximum(reference_energy, 1e-30)), 0.0)
    lag = int(np.argmax(rho))  # an echo is the reference itself, not its inverse
    return float(rho[lag]), lag


class SlidingCorrelation:
    """``echo_correlation`` of the last ``blocks`` blocks of ``block`` samples of microphone (lags
    0..``max_lag``), kept up to date as each block of microphone and reference comes.

    For the microphone's block ``b`` and the lags ``k * block + m`` (``m`` < ``block``), the products
    touch reference blocks ``b - k - 1`` and ``b - k``: the circular correlation, over ``2 * block``
    points, of the microphone's block (zero-padded) with those two reference blocks gives them all,
    none wrapped. So each reference block's spectrum (with the block before it) is taken once, when it
    comes, and serves every lag partition it falls in for as long as the window holds it; a new
    microphone block adds its products at every partition (one spectrum, a product per partition), the
    block leaving the window takes its own out, and only an assessment goes back to the time domain
    (one batch of small inverse transforms). The sums are kept in the frequency domain. The reference's
    energy at each lag moves with it: a block later, lag ``j + block`` has what lag ``j`` had, so only
    the newest ``block`` lags are summed afresh."""

    def __init__(self, block: int, blocks: int, max_lag: int) -> None:
        self.block, self.blocks, self.max_lag = block, blocks, max_lag
        self.window = block * blocks
        self.partitions = -(-(max_lag + 1) // block)
        bins = block + 1
        # Reference spectra, oldest first, each written twice (rows i and i + n) so that the newest n are
        # always one contiguous slice; n reaches back to what the block leaving the window needs.
        self._span = blocks + self.partitions
        self._spectra = np.zeros((2 * self._span, bins), np.complex128)
        self._mic_spectra = np.zeros((blocks, bins), np.complex128)  # conjugated, a ring
        self._sums = np.zeros((self.partitions, bins), np.complex128)  # partition k in row k
        self._term = np.empty_like(self._sums)
        self._frames = np.zeros((2, 2 * block))  # what push transforms
        self._count = 0  # blocks taken
        self._silent = 0  # reference blocks running that were all zero
        self.skipped = 0  # blocks with nothing to correlate (the reference's whole span silent)
        # The time domain: the window of microphone, and the reference it is correlated with (ending
        # where it ends, ``max_lag`` longer), and the reference's energy aligned at each lag.
        self.mic = np.zeros(self.window)
        self.reference = np.zeros(self.window + max_lag)
        self.reference_energy = np.zeros(max_lag + 1)

    def push(self, reference: np.ndarray, mic: np.ndarray) -> None:
        """One block of each, in lockstep."""
        n, w = self.block, self.window
        self.reference[:-n] = self.reference[n:]  # in place: no new arrays per block
        self.reference[-n:] = reference
        self.mic[:-n] = self.mic[n:]
        self.mic[-n:] = mic
        self._silent = 0 if np.any(reference) else self._silent + 1
        if self._silent > self._span:  # the agent silent a while (digital silence): every product is zero
            row = self._count % self._span
            self._spectra[row] = self._spectra[row + self._span] = 0.0  # this block's, and the one's before
            self.reference_energy[:] = 0.0
            self._mic_spectra[self._count % self.blocks] = 0.0  # ... and this block's ever will be
            self._sums[:] = 0.0
            self._count += 1
            self.skipped += 1
            return
        energy, ref = self.reference_energy, self.reference
        energy[n:] = energy[:-n].copy()
        # Lags 0..n-1 afresh: lag j spans reference[L - w - j : L - j].
        entering = np.square(ref[-w - n:-w][::-1])[:n - 1]  # ref[L - w - j] for j = 1..n-1
        leaving = np.square(ref[-n:][::-1])[:n - 1]  # ref[L - j] for j = 1..n-1
        energy[0] = float(np.dot(ref[-w:], ref[-w:]))
        energy[1:n] = energy[0] + np.cumsum(entering - leaving)

        # Both spectra in one call: the reference's last two blocks, the microphone's block zero-padded.
        self._frames[0] = ref[-2 * n:]
        self._frames[1, :n] = mic
        spectra = np.fft.rfft(self._frames, axis=1)
        row = self._count % self._span
        self._spectra[row] = self._spectra[row + self._span] = spectra[0]
        newest = row + self._span  # row newest - k holds reference block count - k
        slot = self._count % self.blocks
        gone = self._mic_spectra[slot].copy()
        np.conjugate(spectra[1], out=self._mic_spectra[slot])
        self._count += 1
        if self._count % REBUILD_HOPS == 0:
            self._rebuild(newest)
            return
        np.multiply(self._mic_spectra[slot], self._spectra[newest:newest - self.partitions:-1], out=self._term)
        self._sums += self._term
        old = newest - self.blocks
        np.multiply(gone, self._spectra[old:old - self.partitions:-1], out=self._term)
        self._sums -= self._term

    def _rebuild(self, newest: int) -> None:
        """The sums afresh from the window's blocks, exactly (rounding does not pile up over a call)."""
        self._sums[:] = 0.0
        for age in range(min(self.blocks, self._count)):
            slot = (self._count - 1 - age) % self.blocks
            at = newest - age
            self._sums += self._mic_spectra[slot] * self._spectra[at:at - self.partitions:-1]

    def products(self) -> np.ndarray:
        """Lag 0..``max_lag``: the sum over the window of mic[t] * reference[t - lag]."""
        n = self.block
        r = np.fft.irfft(self._sums, 2 * n, axis=1)
        return r[:, n:0:-1].reshape(-1)[:self.max_lag + 1]

    def best(self) -> tuple[float, int] | None:
        """As ``echo_correlation`` of the window."""
        mic_energy = float(np.dot(self.mic, self.mic))
        if mic_energy < MIC_FLOOR * self.window:
            return None
        return normalised(self.products(), mic_energy, self.reference_energy, self.window)


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
        self._hop = int(HOP_S * ANALYSIS_RATE)
        self._correlation = SlidingCorrelation(self._hop, WINDOW_HOPS, self._max_lag)
        # The block being filled, first differenced: reference in row 0, microphone in row 1.
        self._block = np.zeros((2, self._hop))
        self._last = np.zeros(2)  # the last decimated sample of each, for the first difference
        self._pending = 0  # samples of the block taken so far
        self._hops = 0
        self._streak: list[int] = []  # lags of the assessments in a row above DETECT
        self._quiet = 0  # samples of agent speech without echo since it was last found
        self._clear = 0  # samples of agent speech assessed with no correlation above DETECT, while no echo
        self.echo = False
        self.counters = EchoPresenceCounters()

    def update(self, reference: np.ndarray, mic: np.ndarray) -> bool:
        """Equal lengths of each; returns whether the line carries echo now."""
        x = self._decimate(np.stack([reference, mic], dtype=np.float64))
        while x.shape[1]:
            take = min(x.shape[1], self._hop - self._pending)
            self._take(x[:, :take])
            x = x[:, take:]
        return self.echo

    def _take(self, x: np.ndarray) -> None:
        """Reference and microphone (rows), up to the end of the block."""
        at, k = self._pending, x.shape[1]
        self._block[:, at] = x[:, 0] - self._last
        np.subtract(x[:, 1:], x[:, :-1], out=self._block[:, at + 1:at + k])
        self._last = x[:, -1].copy()
        self._pending += k
        if self._pending < self._hop:
            return
        self._pending = 0
        self._correlation.push(self._block[0], self._block[1])
        self._hops += 1
        # Once found, a slower look is enough to notice it going; a line long clear of it, a slower look
        # for it coming (back to every block once a correlation reaches DETECT).
        every = RELEASE_CHECK_EVERY if self.echo else \
            COARSE_EVERY if self._clear >= COARSE_AFTER_S * ANALYSIS_RATE and not self._streak else 1
        if self._hops % every == 0:
            self._assess(self._hop * every)

    def _decimate(self, x: np.ndarray) -> np.ndarray:
        """Both rows (reference, microphone) to the analysis rate, by the mean of each group of samples."""
        f = self._factor
        if f == 1:
            return x
        n = x.shape[1] // f * f
        if f == 2:  # the stage's 16 kHz: the same means, in one step instead of a reduction
            return (x[:, 0:n:2] + x[:, 1:n:2]) * 0.5
        return x[:, :n].reshape(2, -1, f).mean(axis=2)

    def _assess(self, span: int) -> None:
        reference = self._correlation.reference
        talking = float(np.dot(reference, reference)) > REFERENCE_FLOOR * len(reference)
        found = self._correlation.best() if talking else None
        if found is not None:
            self.counters.updates += 1
            self.counters.best = max(self.counters.best, found[0])
        if found is None or found[0] < DETECT:
            self._streak.clear()
            if not self.echo and talking:
                self._clear += span
            if self.echo and talking:  # the agent speaks and nothing comes back
                self._quiet += span
                if self._quiet >= RELEASE_S * ANALYSIS_RATE:
                    self.echo, self._quiet = False, 0
                    self.counters.releases += 1
            return
        rho, lag = found
        self._clear = 0
        if self._streak and abs(lag - self._streak[-1]) > LAG_TOLERANCE_S * ANALYSIS_RATE:
            self._streak.clear()
        self._streak.append(lag)
        if len(self._streak) >= CONFIRM or self.echo:
            self._quiet = 0
            self.counters.lag_ms = 1000.0 * lag / ANALYSIS_RATE
            if not self.echo:
                self.echo = True
                self.counters.detections += 1
