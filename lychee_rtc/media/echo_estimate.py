"""Our own linear estimate of the echo, for finding the caller under it.

AEC3 (``media/audio_processing.py``) takes a caller who begins quietly under a louder echo down to its
echo floor, and the line's level does not show them either, so where the caller began was found
40-70 ms late. The livekit binding does not expose AEC3's linear filter, so the stage runs its own: a
partitioned-block frequency-domain adaptive filter (normalised LMS per frequency bin, gradient
constrained) on the far end it already holds, placed at the echo's lag as ``media/echo_presence.py``
finds it. Its residual ``e = mic - echo estimate`` keeps the caller whole (a linear filter does not
suppress), so a caller shows in it at once, however loud the echo, as residual above what the
filter leaves of an echo alone.

Evidence of the caller, per 10 ms frame: the residual's energy over what is expected of the echo
alone, ``misadjustment * echo estimate + noise``, where the misadjustment (residual over estimate
in frames without the caller) and the noise (the least residual, rising slowly) are tracked.
Adaptation stops while the caller is in evidence, so the caller does not de-train the filter (the
residual rule, not Geigel's: an echo may be louder than what the agent played). An echo path that
changes also raises the residual; that is told apart by the filter's own trend: evidence that lasts
``RETRAIN_FRAMES`` without the filter adapting is taken as a new path, and the filter adapts again
(with the evidence withdrawn) until the misadjustment is back down.

The caller beyond doubt (``FrameEstimate.certain``, which confirms double talk without waiting for AEC3):
a residual far over what the echo alone leaves and most of the line (not far over it: that is the filter
predicting an echo the line does not hold), three frames running, that does not correlate with the far end
at any lag near the echo's. A moved echo path or a level change is the far end
again and correlates; a clipping loudspeaker's residual and the room's tail stay under the line.

Until the filter is trusted, it shows no evidence; what it knows is how loud the echo gets against the
far end (its ceiling, ``_against_ceiling``), learnt from the line held since the echo could first have
reached it (``_learn_held_ceiling``), not from where the search found it: on a faint echo that is half a
second into the agent's first words, when a caller barging in may already be talking. A line far over that,
unlike the far end, is the caller beyond doubt too (AEC3, in its first second, takes even a caller 20 dB
over the echo down for 150 ms).
A caller as loud as the echo stands within 3 dB of that ceiling, not over it: there (``near_ceiling``), on an
echo well over the room's noise, the stage asks whether the young filter's residual is unlike the far end
(``young_likeness``).

Before the filter is placed, the line is kept as the residual, so that the stage can ask whether it is like
the far end at any lag (``line_likeness``): with the echo not found yet, a caller is not.

Pure numpy, one session's state, no I/O. Per 10 ms frame: two FFTs of 2 frames, and a batched pair
over the partitions for the gradient constraint.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

SPAN_S = 0.1  # the filter's reach behind the echo's lag: the room's early reflections and more
LEAD_S = 0.01  # ... and ahead of it: the lag is found at 8 kHz, a reflection may come first
STEP = 0.5  # normalised step per bin, once trusted
LEARNING_STEP = 1.0  # ... until then (placed afresh, a new path): faster, noisier
REGULARISATION = 0.2  # of the mean far-end power per bin, added to each bin's
MISADJUSTMENT_SMOOTHING = 0.9  # of the residual over the estimate, per frame without the caller
NOISE_RISE = 1.01  # the noise floor's rise per frame, 4 dB a second (it falls at once to a lower residual)
REFERENCE_FLOOR = 1e-7  # far end mean square below which the agent is silent (-70 dBFS)
CALLER_OVER_EXPECTED = 8.0  # residual over what the echo alone leaves: 9 dB is the caller
CONVERGED = 0.2  # misadjustment under which the estimate is trusted (7 dB of echo taken out)
STILL_CONVERGED = 0.4  # ... under which it stays trusted, once it was (4 dB)
# The caller beyond doubt, from the estimate alone (AEC3 may take them down 20-35 dB for a tenth of a
# second and more first): residual 15 dB over what the echo alone leaves and within 6 dB of the line
# (the caller is most of it: not the room's tail nor a clipping loudspeaker, which stay under it),
# three frames running, and the residual of the last 100 ms unlike the far end at every lag the filter
# reaches and 100 ms either side (an echo path that moved, or a level change, is the far end again).
CERTAIN_OVER_EXPECTED = 10 ** (15 / 10)
CERTAIN_OF_LINE = 10 ** (-6 / 10)
# ... and not over the line by more than 3 dB: a caller adds to the line what they add to the residual, so a
# residual far over the line is the estimate's own error, an echo it predicts that is not there. Traced on a
# 250 ms WebRTC path with the echo as loud (``bench bargein``): where the line went quiet after a pause in the
# agent's voice, the residual stood 6-11 dB over it three frames running, unlike the far end at any lag
# searched (0.38), and was taken for the caller: the agent cut itself off.
CERTAIN_OVER_LINE = 10 ** (3 / 10)
CERTAIN_FRAMES = 3
CERTAIN_WINDOW_FRAMES = 10
CERTAIN_SEARCH_S = 0.1
ECHO_LIKE = 0.4  # normalised correlation of the residual with the far end (first differenced): see docs/echo.md
RETRAIN_FRAMES = 50  # evidence this long with the filter frozen: the echo path changed
LAG_MOVE_S = 0.004  # the lag moving this much re-places the filter (and it learns afresh)
# Until the filter is trusted (its first half second or so), the echo's level is known if not its shape:
# the line over the loudest of the far end in the history (0.5 s), as high as it has stood since the
# filter was placed, is the echo's ceiling. A line 10 dB over it (three frames running, unlike the far end)
# is the caller beyond doubt; 3 dB over it is the caller in evidence (where they began), and not learnt from.
CEILING_LEARNT_FRAMES = 20  # frames of the far end since placed before the ceiling is known
# ... counted from where the echo could first have reached the line, not from where the search found it
# (0.3-0.5 s after the agent's first sound on a faint echo): placed, the filter learns the ceiling from the
# line held since then, so that a caller who begins over the agent's first words is not taken for the echo.
HELD_FRAMES = 100
HELD_OF_LOUDEST = 0.1  # ... from the frames where the far end's loudest was within 10 dB of what it is now
OVER_CEILING = 10.0
ABOVE_CEILING = 2.0
# ... but a caller as loud as the echo puts the line at most 3 dB over it, and on a long echo path the filter is
# still young when the agent's first words are barged into (250 ms: placed 0.36 s after the agent's first sound,
# 4-6 dB of echo taken out 0.4 s later, short of the 7 dB that trusts it; AEC3 took the caller down 0.7 s). There
# the young filter's residual answers (``FrameEstimate.near_ceiling``, asked by the stage): the line within 3 dB
# of the ceiling or over it, where the echo's ceiling stands 18 dB over the line's noise. Under that, the residual
# is mostly the room's noise, unlike the far end whoever speaks (the echo 20 dB under the caller: 0.25 at its
# loudest, and the agent cut itself off).
NEAR_CEILING = 10 ** (-3 / 10)
CEILING_OVER_NOISE = 10 ** (18 / 10)
# ... and only for the filter's first 1.2 s from where it was placed: a room's echo is trusted within about a
# second; a filter still not trusted then is not learning a linear echo (a loudspeaker that clips hard), and its
# residual, the distortion, is unlike the far end whoever speaks.
YOUNG_FRAMES = 120


@dataclass
class EstimateCounters:
    frames: int = 0  # frames filtered (the lag was known)
    adapted: int = 0  # ... of which the filter learnt from
    caller_frames: int = 0  # frames with the caller in evidence
    retrains: int = 0  # times the evidence was taken as a new echo path
    placements: int = 0  # times the filter was placed at a (new) lag


@dataclass(frozen=True)
class FrameEstimate:
    residual: np.ndarray  # mic minus the echo estimate
    residual_power: float  # mean square of it
    line_power: float  # ... of the microphone
    expected_power: float  # ... of what the echo alone would leave (misadjustment, noise)
    converged: bool  # the estimate takes out enough of the echo to be trusted
    certain: bool = False  # the caller beyond doubt (see CERTAIN_OVER_EXPECTED)
    strong_frames: int = 0  # frames running, this one included, with the residual that strong
    above_ceiling: bool = False  # not trusted yet, the line over what the echo alone has reached (the caller)
    near_ceiling: bool = False  # not trusted yet, the line near that, on an echo well over the noise (NEAR_CEILING)

    @property
    def caller(self) -> bool:
        """The caller is in evidence in this frame (only meaningful where ``converged``)."""
        return self.converged and self.residual_power > CALLER_OVER_EXPECTED * self.expected_power

    @property
    def evidence(self) -> tuple[bool, float] | None:
        """For where the caller began: whether this frame shows them and at what level; None where it
        cannot say (not trusted yet, and the line within what the echo alone reached)."""
        if self.converged:
            return self.caller, self.residual_power
        return (True, self.line_power) if self.above_ceiling else None


class LinearEchoEstimate:
    """Fed each 10 ms frame of the far end and the microphone in lockstep, at ``rate``."""

    def __init__(self, rate: int, frame: int, max_lag_s: float = 0.52) -> None:
        self.rate, self.frame = rate, frame
        self.partitions = int(np.ceil((SPAN_S + LEAD_S) * rate / frame))
        self._history = np.zeros(int(max_lag_s * rate) + 2 * frame, np.float64)  # the far end, newest last
        self._delay: int | None = None  # samples of bulk delay ahead of the filter
        self._residuals = np.zeros(CERTAIN_WINDOW_FRAMES * frame, np.float64)  # the last residual, newest last
        self.counters = EstimateCounters()
        # The far end's level per frame over the history (for its loudest), and per frame held, the line's
        # level, the far end's loudest in the history then and its own level, newest last.
        self._far_levels = np.zeros(len(self._history) // frame, np.float64)
        self._held: deque[tuple[float, float, float]] = deque(maxlen=HELD_FRAMES)
        self._reset()

    def _reset(self) -> None:
        bins = self.frame + 1
        self._weights = np.zeros((self.partitions, bins), np.complex128)
        self._spectra = np.zeros((self.partitions, bins), np.complex128)  # far end blocks, newest first
        self._misadjustment = 1.0
        self._left = self._taken = 0.0  # smoothed residual (over the noise) and estimate energies
        self._noise: float | None = None
        self._evidence_run = 0
        self._certain_run = 0
        self._retraining = False
        self._trusted = False  # converged once since placed
        self._ceiling = 0.0  # the line over the far end's loudest, as high as the echo alone took it
        self._ceiling_frames = 0  # frames of the far end it was learnt from
        self._above_run = 0  # frames running over it
        self._placed_frames = 0  # frames filtered since it was placed

    @property
    def trusted(self) -> bool:
        """Converged once since it was placed, and not learning a new path: what it expects of the echo
        alone is calibrated, even where the misadjustment has since risen over ``STILL_CONVERGED``."""
        return self._trusted and not self._retraining

    @property
    def delay_s(self) -> float | None:
        return None if self._delay is None else self._delay / self.rate

    def place(self, lag_s: float) -> None:
        """The echo follows the far end by ``lag_s`` (its strongest path); the filter starts ``LEAD_S``
        ahead of it. A move beyond ``LAG_MOVE_S`` starts the filter afresh."""
        delay = int(np.clip(round((lag_s - LEAD_S) * self.rate), 0, len(self._history) - 2 * self.frame))
        if self._delay is not None and abs(delay - self._delay) <= LAG_MOVE_S * self.rate:
            return
        self._delay = delay
        self.counters.placements += 1
        self._reset()
        self._learn_held_ceiling()

    def skip(self, far: np.ndarray) -> None:
        """Far end that reached the caller but not the canceller (a trimmed reference queue): it joins the
        history and the filter's delay grows by as much, so the echo path it learnt stays in place."""
        k = min(len(far), len(self._history))
        if k == 0:
            return
        self._history[:-k] = self._history[k:]
        self._history[-k:] = far[len(far) - k:]
        n = self.frame
        self._far_levels[:] = np.mean(np.square(self._history[len(self._history) % n:].reshape(-1, n)), axis=1)
        if self._delay is not None:
            self._delay += len(far)
            if self._delay > len(self._history) - 2 * self.frame:  # beyond its reach: placed afresh
                self._delay = None
                self._reset()

    def process(self, reference: np.ndarray, mic: np.ndarray) -> FrameEstimate | None:
        """One frame of each (``frame`` samples); None until the filter has been placed."""
        n = self.frame
        self._history[:-n] = self._history[n:]  # in place: the far end's 0.5 s is not copied anew per frame
        self._history[-n:] = reference
        far_level = float(np.dot(self._history[-n:], self._history[-n:])) / n
        self._far_levels[:-1] = self._far_levels[1:]
        self._far_levels[-1] = far_level
        d = np.asarray(mic, np.float64)
        line_power = float(np.dot(d, d)) / n
        loudest = float(self._far_levels.max())
        ratio = line_power / loudest if loudest >= REFERENCE_FLOOR else None
        self._held.append((line_power, loudest, far_level))
        if self._delay is None:
            self._residuals[:-n] = self._residuals[n:]  # nothing estimated: the residual is the line
            self._residuals[-n:] = d
            return None
        self.counters.frames += 1
        end = len(self._history) - self._delay
        block = self._history[end - 2 * n:end]
        spectrum = np.fft.rfft(block)
        self._spectra[1:] = self._spectra[:-1]  # in place: no array per frame
        self._spectra[0] = spectrum
        estimate = np.fft.irfft(np.sum(self._weights * self._spectra, axis=0), 2 * n)[n:]
        e = d - estimate
        residual_power = float(np.dot(e, e)) / n
        estimate_power = float(np.dot(estimate, estimate)) / n
        far_power = float(np.dot(block[n:], block[n:])) / n

        # The line's noise: the least residual, rising slowly (the agent's pauses are seldom silent).
        self._noise = residual_power if self._noise is None else min(self._noise * NOISE_RISE, residual_power)
        noise = self._noise if self._noise is not None else 0.0
        self._placed_frames += 1
        near = (not self._trusted and self._placed_frames <= YOUNG_FRAMES and ratio is not None
                and self._ceiling_frames >= CEILING_LEARNT_FRAMES and ratio > NEAR_CEILING * self._ceiling
                and self._ceiling * loudest > CEILING_OVER_NOISE * noise)
        expected = self._misadjustment * estimate_power + noise
        # Once trusted, it stays trusted while it takes out 4 dB: the misadjustment wanders above the
        # mark as the agent's voice moves on in its first second, and it is calibrated by it anyway.
        mark = STILL_CONVERGED if self._trusted and not self._retraining else CONVERGED
        converged = self._misadjustment < mark and estimate_power > noise
        self._trusted = self._trusted or converged
        caller = converged and residual_power > CALLER_OVER_EXPECTED * expected
        if caller and not self._retraining:
            self._evidence_run += 1
            if self._evidence_run >= RETRAIN_FRAMES:  # too long for a barge-in frozen: a new path
                self._retraining = True
                self.counters.retrains += 1
        else:
            self._evidence_run = 0
        if self._retraining and self._misadjustment < CONVERGED / 2:
            self._retraining = False
        above, over = self._against_ceiling(ratio, far_power)
        adapt = far_power >= REFERENCE_FLOOR and (not caller or self._retraining) and not above
        if caller and not self._retraining:
            self.counters.caller_frames += 1
        if adapt:
            self.counters.adapted += 1
            # Normalised by the far end's energy per bin over the filter's whole reach (what it learns from).
            power = np.sum(self._spectra.real ** 2 + self._spectra.imag ** 2, axis=0)
            # Bins the far end barely reaches (a narrowband leg's upper half) would take huge steps.
            norm = power + REGULARISATION * float(np.mean(power)) + 1e-9
            error = np.fft.rfft(np.concatenate([np.zeros(n), e]))
            step = STEP if self._trusted and not self._retraining else LEARNING_STEP
            gradient = np.conj(self._spectra) * (step * error / norm)
            g = np.fft.irfft(gradient, 2 * n, axis=1)
            g[:, n:] = 0.0  # the constraint: a linear, not circular, convolution is learnt
            self._weights += np.fft.rfft(g, axis=1)
            # Energy-weighted (loud frames count most): a ratio of smoothed energies, not of frames.
            a = MISADJUSTMENT_SMOOTHING
            self._left = a * self._left + (1 - a) * max(residual_power - noise, 0.0)
            self._taken = a * self._taken + (1 - a) * estimate_power
            self._misadjustment = min(self._left / max(self._taken, 1e-12), 1.0)
        self._residuals[:-n] = self._residuals[n:]
        self._residuals[-n:] = e
        strong = over or (converged and not self._retraining and residual_power > CERTAIN_OVER_EXPECTED * expected
                          and CERTAIN_OF_LINE * line_power < residual_power < CERTAIN_OVER_LINE * line_power)
        self._certain_run = self._certain_run + 1 if strong else 0
        certain = self._certain_run >= CERTAIN_FRAMES and self.echo_likeness() < ECHO_LIKE
        return FrameEstimate(e.astype(np.float32), residual_power, line_power, expected,
                             converged and not self._retraining, certain, self._certain_run, above, near)

    def _against_ceiling(self, ratio: float | None, far_power: float) -> tuple[bool, bool]:
        """Not trusted yet: whether the line, at ``ratio`` over the far end's loudest in the history (None:
        the far end is silent), stands ``ABOVE_CEILING`` and ``OVER_CEILING`` over the echo's ceiling (both
        False until it is known, and once the filter is trusted). Frames under the first raise the ceiling
        to theirs (the echo alone); a caller's do not. ``far_power``: the far end at the echo's lag."""
        if self._trusted or ratio is None:
            return False, False
        known = self._ceiling_frames >= CEILING_LEARNT_FRAMES
        above = known and ratio > ABOVE_CEILING * self._ceiling
        self._above_run = self._above_run + 1 if above else 0
        if self._above_run >= RETRAIN_FRAMES:  # too long for a barge-in: the echo is louder (the volume went up)
            above, self._above_run = False, 0
        if not above:
            self._ceiling = max(self._ceiling, ratio)
            self._ceiling_frames += far_power >= REFERENCE_FLOOR
        return above, known and ratio > OVER_CEILING * self._ceiling

    def _learn_held_ceiling(self) -> None:
        """Just placed: the line held since the far end at the new lag could reach it teaches the ceiling,
        frame by frame as if the filter had been placed then."""
        assert self._delay is not None
        lag = round(self._delay / self.frame)
        held = list(self._held)
        top = max((h[1] for h in held), default=0.0)
        for j in range(lag, len(held)):
            line, loudest, _ = held[j]
            # Not while the far end's history held only the agent's quiet first sound: the line's noise
            # over it would stand for an echo far louder than the agent.
            if loudest >= max(REFERENCE_FLOOR, HELD_OF_LOUDEST * top):
                self._against_ceiling(line / loudest, held[j - lag][2])

    def echo_likeness(self) -> float:
        """The highest normalised correlation of the residual's run of strong frames (at least
        ``CERTAIN_FRAMES``, at most ``CERTAIN_WINDOW_FRAMES``) with the far end, at every lag from
        ``CERTAIN_SEARCH_S`` ahead of the filter's reach to as far behind it."""
        if self._delay is None:
            return 1.0
        return self._likeness(self._certain_run, *self._around_echo())

    def young_likeness(self, frames: int) -> float:
        """As ``echo_likeness``, of the residual's last ``frames``, or the same against the far end cubed where
        that is higher: a young filter has learnt the echo's linear part only, and a loudspeaker that clips leaves
        the far end's odd harmonics in its residual, unlike the far end (0.21-0.25 over the bench's voices, the
        echo as loud or 10 dB under) but like its cube (0.29-0.48; a caller 0.07-0.24)."""
        if self._delay is None:
            return 1.0
        lags = self._around_echo()
        return max(self._likeness(frames, *lags), self._likeness(frames, *lags, cubed=True))

    def _around_echo(self) -> tuple[int, int]:
        """The nearest and farthest lags (samples) the likeness tests search, the filter placed."""
        assert self._delay is not None
        search = int(CERTAIN_SEARCH_S * self.rate)
        return max(self._delay - search, 0), self._delay + self.partitions * self.frame + search

    def line_likeness(self, frames: int) -> float:
        """Not placed yet (the echo not found): the highest normalised correlation of the line's last
        ``frames`` (at least ``CERTAIN_FRAMES``, at most ``CERTAIN_WINDOW_FRAMES``) with the far end at
        every lag the history holds, as ``echo_likeness``. 1.0 once placed."""
        if self._delay is not None:
            return 1.0
        return self._likeness(frames, 0, len(self._history))

    def _likeness(self, frames: int, nearest: int, farthest: int, cubed: bool = False) -> float:
        # Only the run of strong frames (up to the window): the echo's leftovers before it would dilute it.
        w = min(max(frames, CERTAIN_FRAMES), CERTAIN_WINDOW_FRAMES) * self.frame
        residuals = self._residuals[len(self._residuals) - w:]
        farthest = min(farthest, len(self._history) - w - 1)
        if farthest <= nearest:
            return 1.0
        # far[j] lines up with the residual's first sample at lag ``farthest - j``.
        # First differenced, as the echo search does: the voice's strong low harmonics would otherwise
        # correlate any two voices at some lag.
        far = self._history[len(self._history) - w - farthest - 1:len(self._history) - nearest]
        far = np.diff(far ** 3 if cubed else far)
        residual = np.diff(residuals, prepend=residuals[0])
        size = 1 << int(np.ceil(np.log2(len(far) + w)))
        c = np.fft.irfft(np.fft.rfft(far, size) * np.conj(np.fft.rfft(residual, size)), size)[:len(far) - w + 1]
        cumulative = np.concatenate([[0.0], np.cumsum(np.square(far))])
        energy = cumulative[w:] - cumulative[:-w]
        own = float(np.dot(residual, residual))
        rho = np.abs(c) / np.sqrt(np.maximum(energy, 1e-12) * max(own, 1e-12))
        return float(np.max(rho))

