"""Our own linear echo estimate (media/echo_estimate.py) on its own: real speech (the espeak-ng
recordings of the barge-in bench) through a simulated room, and harder echo paths than a room alone:
a few decaying taps, a loudspeaker that clips, a level change and a path that changes mid-call."""

from __future__ import annotations

import numpy as np
from scipy.signal import lfilter

from lychee_rtc.bench.aec import AGENT_WAVS, CALLER_WAV, FIXTURES, at_level, read_wav
from lychee_rtc.bench.speakerphone import pink_noise, room_impulse_response
from lychee_rtc.media.caller_onset import caller_onset_in_evidence
from lychee_rtc.media.echo_estimate import CONVERGED, LinearEchoEstimate

RATE = 16000
FRAME = RATE // 100
LAG_S = 0.12


def agent(seconds: float) -> np.ndarray:
    x = np.concatenate([read_wav(FIXTURES / w, RATE) for w in AGENT_WAVS])
    x = np.tile(x, int(np.ceil(seconds * RATE / len(x))))[:int(seconds * RATE)]
    return at_level(x, 0.1)


def through(path: np.ndarray, x: np.ndarray, lag_s: float = LAG_S) -> np.ndarray:
    y = lfilter(path, [1.0], x)
    return np.concatenate([np.zeros(int(lag_s * RATE)), y])[:len(x)]


def few_taps() -> np.ndarray:
    """A handset on a desk: a direct path, three reflections, a decaying tail (40 ms)."""
    rng = np.random.default_rng(3)
    h = np.zeros(int(0.04 * RATE))
    h[[2, 41, 97, 230]] = [0.9, -0.45, 0.3, -0.2]
    h += 0.05 * rng.standard_normal(len(h)) * np.exp(-np.arange(len(h)) / (0.01 * RATE))
    return h


def run(estimate: LinearEchoEstimate, far: np.ndarray, mic: np.ndarray) -> list:
    return [estimate.process(far[i:i + FRAME], mic[i:i + FRAME]) for i in range(0, len(mic) - FRAME + 1, FRAME)]


def erle_db(frames: list, mic: np.ndarray, start_s: float, stop_s: float) -> float:
    a, b = int(start_s * 100), int(stop_s * 100)
    residual = np.concatenate([f.residual for f in frames[a:b]])
    return float(10 * np.log10(np.mean(mic[a * FRAME:b * FRAME] ** 2) / np.mean(residual.astype(np.float64) ** 2)))


def test_nothing_is_estimated_until_the_lag_is_known():
    estimate = LinearEchoEstimate(RATE, FRAME)
    assert estimate.process(np.ones(FRAME), np.ones(FRAME)) is None
    estimate.place(LAG_S)
    assert estimate.delay_s is not None and abs(estimate.delay_s - (LAG_S - 0.01)) < 1e-3
    estimate.place(LAG_S + 0.002)  # the search's 8 kHz wobble does not start it afresh
    assert estimate.counters.placements == 1
    estimate.place(LAG_S + 0.05)
    assert estimate.counters.placements == 2


def test_a_room_echo_is_learnt_within_a_second_and_a_caller_is_left_whole():
    far = agent(11.0)
    echo = through(room_impulse_response(RATE), far)
    noise = pink_noise(len(far)) * 0.1 * 10 ** (-25 / 20)
    caller = at_level(read_wav(FIXTURES / CALLER_WAV, RATE), 0.1)
    barge = 4 * RATE
    near = np.zeros(len(far))
    near[barge:barge + len(caller)] = caller[:len(far) - barge]
    mic = echo + noise + near
    estimate = LinearEchoEstimate(RATE, FRAME)
    estimate.place(LAG_S)
    frames = run(estimate, far, mic)
    assert erle_db(frames, echo + noise, 2.0, 4.0) > 10, "the room's echo taken out by 10 dB and more"
    assert next(i for i, f in enumerate(frames) if f.converged) < 150, "trusted within 1.5 s of speech"
    # The caller is not suppressed: the residual over the barge-in is the caller, within 1 dB.
    span = slice(barge, barge + int(0.5 * RATE))
    residual = np.concatenate([f.residual for f in frames])[span].astype(np.float64)
    assert abs(10 * np.log10(np.mean(residual ** 2) / np.mean(near[span] ** 2))) < 1.0
    # Where they began: the caller's first frames already show, quiet as they are under the echo ...
    evidence = [f.caller for f in frames]
    first = barge // FRAME
    levels = [f.residual_power for f in frames]
    assert caller_onset_in_evidence(evidence[:first + 6], levels[:first + 6]) <= first + 1
    # ... and the echo alone in the 300 ms before does not.
    assert not any(evidence[first - 30:first])
    # Beyond doubt (what confirms double talk without AEC3) within 50 ms of their first frame, never before.
    certain = [i for i, f in enumerate(frames) if f.certain]
    assert certain and first <= certain[0] <= first + 5
    # The filter did not learn from the caller: the echo after them is taken out as before.
    end = (barge + len(caller)) // FRAME
    assert end / 100 + 0.3 < 10.0
    assert erle_db(frames, echo + noise, end / 100 + 0.3, 11.0) > 10


def test_a_clipping_loudspeaker_a_level_change_and_a_new_path_are_rarely_taken_for_a_caller():
    far = agent(16.0)
    path = few_taps()
    moved = np.roll(path, 25) * 0.7  # the phone moved on the desk: later, weaker, other reflections
    moved[60:] += 0.3 * np.roll(path, 40)[60:]
    loud = np.tanh(2.5 * far) / 2.5  # the loudspeaker clips the agent's peaks
    change = 8 * RATE
    echo = np.concatenate([through(path, loud)[:change], through(moved, loud)[change:]])
    echo[4 * RATE:] *= 10 ** (-6 / 20)  # the caller turns the volume down
    mic = echo + pink_noise(len(far)) * 0.1 * 10 ** (-30 / 20)
    estimate = LinearEchoEstimate(RATE, FRAME)
    estimate.place(LAG_S)
    frames = run(estimate, far, mic)
    evidence = np.array([f.caller for f in frames])
    # No caller in any of it. The clipped peaks and the volume change show as one now and then ...
    steady = np.r_[evidence[:change // FRAME], evidence[change // FRAME + 150:]]
    assert steady.mean() < 0.03, f"an echo alone showed as the caller in {100 * steady.mean():.1f} % of frames"
    # ... but never beyond doubt: the clipped peaks stay under the line, and the new path and the level
    # change leave a residual that is the far end again (without that test, 46 frames after the change).
    assert not any(f.certain for f in frames)
    # ... a new path as one until it is learnt: the filter does not stay frozen on it (it would be
    # for good: the residual of an unknown path never falls), it learns the path again ...
    assert estimate.counters.retrains >= 1
    assert evidence[change // FRAME + 150:].mean() < 0.03
    assert estimate._misadjustment < CONVERGED
    assert erle_db(frames, mic, 13.0, 16.0) > 6  # ... as far as the clipping lets a linear estimate


def test_until_it_is_trusted_a_louder_echo_is_not_the_caller_and_the_filter_goes_on_learning():
    # The echo 5 dB over the room's noise (the filter is not trusted for its first second or so), placed
    # as the echo search places it (half a second of the far end behind it), and 0.3 s later the caller
    # turns the loudspeaker up 12 dB: the line stands far over what the echo reached until then.
    far = agent(8.0)
    echo = through(few_taps(), far) * 0.1
    echo[int(0.8 * RATE):] *= 10 ** (12 / 20)
    mic = echo + pink_noise(len(far)) * 0.1 * 10 ** (-25 / 20)
    estimate = LinearEchoEstimate(RATE, FRAME)
    placed = int(0.5 * RATE)
    run(estimate, far[:placed], mic[:placed])
    estimate.place(LAG_S)
    frames = run(estimate, far[placed:], mic[placed:])
    assert any(f.above_ceiling for f in frames), "the louder echo stood over the ceiling at first"
    assert not any(f.certain for f in frames), "... but it is the far end again, never the caller beyond doubt"
    # It is taken as the echo's new level within a second, and the filter learns it.
    assert not any(f.above_ceiling for f in frames[30 + 100:])
    assert any(f.converged for f in frames[-100:])


def test_the_onset_is_the_start_of_the_last_run_of_evidence_at_the_callers_level():
    loud, quiet = 1e-2, 1e-3
    assert caller_onset_in_evidence([False, True, False, True, True], [loud] * 5) == 3
    assert caller_onset_in_evidence([True, True], [quiet, loud]) == 0  # 10 dB under: their first syllable
    # 20 dB and more under the run's loudest: residual echo the filter cannot reach, not the caller.
    assert caller_onset_in_evidence([True, True, True, True], [1e-5, 1e-5, quiet, loud]) == 2
    assert caller_onset_in_evidence([True, False], [loud, loud]) == 2
    assert caller_onset_in_evidence([], []) == 0
