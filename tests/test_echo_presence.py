"""The echo search (media/echo_presence.py) on its own: the running correlation against the direct one,
and the detector's documented properties on real speech (the espeak-ng recordings of the barge-in
bench) through a simulated room."""

from __future__ import annotations

import numpy as np
from scipy.signal import lfilter

from lychee_rtc.bench.aec import AGENT_WAVS, CALLER_WAV, FIXTURES, at_level, read_wav
from lychee_rtc.bench.speakerphone import pink_noise, room_impulse_response
from lychee_rtc.media.echo_presence import (ANALYSIS_RATE, MAX_LAG_S, REBUILD_HOPS, RELEASE_S, EchoPresence,
                                            SlidingCorrelation, echo_correlation)

RATE = 16000
FRAME = RATE // 100  # the stage's 10 ms frames
LAG_S = 0.12


def agent(seconds: float) -> np.ndarray:
    x = np.concatenate([read_wav(FIXTURES / w, RATE) for w in AGENT_WAVS])
    x = np.tile(x, int(np.ceil(seconds * RATE / len(x))))[:int(seconds * RATE)]
    return at_level(x, 0.1)


def echo_of(x: np.ndarray, gain: float, lag_s: float = LAG_S) -> np.ndarray:
    y = lfilter(room_impulse_response(RATE), [1.0], x) * gain
    return np.concatenate([np.zeros(int(lag_s * RATE)), y])[:len(x)]


def feed(presence: EchoPresence, reference: np.ndarray, mic: np.ndarray) -> list[bool]:
    """Whether echo was declared after each frame."""
    return [presence.update(reference[i:i + FRAME], mic[i:i + FRAME]) for i in range(0, len(mic), FRAME)]


def test_the_running_correlation_equals_the_direct_one():
    """Block by block, over more than one exact recomputation of the sums, through silences on either
    side (the far end's long enough for the sums to be skipped): the best correlation and its lag as
    the direct transform of the window finds them."""
    rng = np.random.default_rng(5)
    n = int((REBUILD_HOPS * 0.02 + 3.0) * RATE)
    reference = rng.normal(0, 0.1, n)
    mic = np.roll(reference, int(0.2 * RATE)) * 0.3 + rng.normal(0, 0.03, n)
    # The agent pauses long enough for the search to skip its sums, and speaks again while the
    # skipped blocks are still in reach of the window, and later after a longer pause.
    reference[2 * RATE:int(3.2 * RATE)] = 0.0
    reference[int(3.6 * RATE):int(5.3 * RATE)] = 0.0
    mic[5 * RATE:int(5.7 * RATE)] = 0.0  # digital silence on the uplink
    presence = EchoPresence(RATE)
    window = presence._correlation.window
    max_lag = int(MAX_LAG_S * ANALYSIS_RATE)
    # The analysis signals from scratch: decimated to 8 kHz (pair means) and first differenced.
    ref8 = np.diff(np.concatenate([[0.0], reference.reshape(-1, 2).mean(axis=1)]))
    mic8 = np.diff(np.concatenate([[0.0], mic.reshape(-1, 2).mean(axis=1)]))
    compared = silent = 0
    for i in range(0, n, 2 * FRAME):
        presence.update(reference[i:i + FRAME], mic[i:i + FRAME])
        presence.update(reference[i + FRAME:i + 2 * FRAME], mic[i + FRAME:i + 2 * FRAME])
        end = (i + 2 * FRAME) // 2
        if end < window + max_lag:
            continue
        direct = echo_correlation(mic8[end - window:end], ref8[end - window - max_lag:end], max_lag)
        running = presence._correlation.best()
        if direct is None:
            assert running is None
            silent += 1
            continue
        assert running is not None and abs(running[0] - direct[0]) < 1e-9
        if direct[0] > 1e-6:  # (no lag is best where every product is zero but rounding)
            assert running[1] == direct[1]
        compared += 1
    assert compared > REBUILD_HOPS and silent > 0 and presence._correlation.skipped > 0
    assert presence.echo and abs(presence.counters.lag_ms - 200.0) < 1.0


def test_the_running_products_equal_the_direct_ones_through_far_end_pauses_of_any_length():
    """Pauses of the far end shorter and longer than the span the sums are skipped after, speech coming
    back while skipped blocks are still in the window's reach: every product as the direct sum gives it."""
    block, blocks, max_lag = 160, 25, 4096
    window = block * blocks
    rng = np.random.default_rng(9)
    pauses = [(60, 110), (130, 185), (205, 282), (300, 420)]  # blocks of digital silence
    count = 480
    reference = rng.normal(0, 0.1, count * block)
    mic = rng.normal(0, 0.1, count * block)
    for a, b in pauses:
        reference[a * block:b * block] = 0.0
    correlation = SlidingCorrelation(block, blocks, max_lag)
    padded_reference = np.concatenate([np.zeros(window + max_lag), reference])
    padded_mic = np.concatenate([np.zeros(window), mic])
    lags = np.arange(0, max_lag + 1, 37)
    for k in range(count):
        correlation.push(reference[k * block:(k + 1) * block], mic[k * block:(k + 1) * block])
        end = (k + 1) * block
        m = padded_mic[end:end + window]
        r = padded_reference[end:end + window + max_lag]
        direct = np.array([np.dot(m, r[max_lag - j:max_lag - j + window]) for j in lags])
        assert np.max(np.abs(correlation.products()[lags] - direct)) < 1e-9, f"block {k}"
    assert correlation.skipped > 0


def test_an_echo_20_db_over_the_noise_is_found_within_160_ms_and_given_up_after_agent_speech_without_it():
    seconds = 25.0
    far = agent(seconds)
    n = len(far)
    noise = pink_noise(n) * 0.01  # the room, 20 dB under the agent's level
    echo = echo_of(far, 1.0)
    first = int(np.argmax(np.abs(echo) > 0.01))  # where the echo is first audible
    off = int(12 * RATE)  # the caller takes the phone off speaker
    mic = noise + np.where(np.arange(n) < off, echo, 0.0)
    presence = EchoPresence(RATE)
    states = feed(presence, far, mic)
    found_at = states.index(True) * FRAME
    assert found_at - first < 0.16 * RATE
    assert abs(presence.counters.lag_ms - 1000 * LAG_S) < 5.0
    released_at = next(k for k in range(len(states)) if k * FRAME > off and not states[k]) * FRAME
    # The agent speaks nearly all the time here: given up RELEASE_S (give or take its pauses) after.
    assert RELEASE_S * RATE <= released_at - off < (RELEASE_S + 2.0) * RATE
    assert presence.counters.detections == 1 and presence.counters.releases == 1


def test_another_voice_over_the_agent_is_not_taken_for_echo():
    seconds = 30.0
    far = agent(seconds)
    caller = read_wav(FIXTURES / CALLER_WAV, RATE)
    caller = at_level(np.tile(caller, int(np.ceil(seconds * RATE / len(caller))))[:len(far)], 0.1)
    mic = caller + pink_noise(len(far)) * 0.003
    presence = EchoPresence(RATE)
    assert not any(feed(presence, far, mic))
    assert presence.counters.updates > 1000
    assert presence.counters.best < 0.5
