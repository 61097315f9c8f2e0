"""The uplink processing stage (media/audio_processing.py, WebRTC's audio processing module) on its
own with real speech and a simulated room, and how calls configure it: defaults per ingress, the
native ``session.update``, the OpenAI surface's ``audio.input.noise_reduction``."""

from __future__ import annotations

import argparse
import json
import sys

import aiohttp
import numpy as np
import pytest
from aiortc import RTCPeerConnection, RTCSessionDescription
from conftest import running_server, synthesize
from telephony_support import EventStream, carrier, spec
from test_openai_realtime import AUTH, KEY, open_call
from test_telephony import phone_server

from lychee_rtc.bench import bargein
from lychee_rtc.bench import aec as aec_bench
from lychee_rtc.bench.aec import AGENT_WAVS, CALLER_WAV, FIXTURES, at_level, read_wav, resample
from lychee_rtc.bench.client import RtcClient
from lychee_rtc.bench.speakerphone import pink_noise, rms, room_impulse_response
from lychee_rtc.config import AudioProcessing
from lychee_rtc.media.audio_processing import (MAX_REFERENCE_S, ONSET_AHEAD_FRAMES, ONSET_LOOKBACK_FRAMES,
                                              AudioProcessingStage)
from lychee_rtc.media.caller_onset import OnsetWitness, caller_onset, find_onset, residual_onset, rising_into
from lychee_rtc.session.processing import ProcessingUnavailable
from lychee_rtc.session.protocol import validate_server_event

RATE = 16000
FRAME = RATE // 100


def agent_speech(seconds: float) -> np.ndarray:
    x = synthesize("The quick brown fox jumps over the lazy dog, and then it runs far away across the green "
                   "hills towards the river, where it rests until the evening comes.", rate=RATE)
    x = np.tile(x - np.mean(x), int(np.ceil(seconds * RATE / len(x))))[:int(seconds * RATE)]
    return (0.1 * x / rms(x)).astype(np.float32)


def test_the_stage_removes_a_room_echo_of_what_the_transport_sent():
    agent = agent_speech(8.0)
    sent = agent  # what left for the caller, frame by frame
    delay = int(0.15 * RATE)  # loudspeaker, air and the network: 150 ms after it left
    echo = np.convolve(agent, room_impulse_response(RATE))[:len(agent)]
    mic = np.concatenate([np.zeros(delay, np.float32), echo])[:len(agent)].astype(np.float32)
    stage = AudioProcessingStage(RATE, AudioProcessing(echo_cancellation=True, high_pass_filter=True))
    out = []
    for i in range(0, len(mic) - 2 * FRAME + 1, 2 * FRAME):  # 20 ms frames leave, 20 ms of uplink comes in
        stage.far_end(sent[i:i + 2 * FRAME], RATE)
        out.append(stage.process(mic[i:i + 2 * FRAME]))
    processed = np.concatenate(out)
    tail = slice(3 * RATE, len(processed))  # after the canceller has learnt the room
    erle = 10 * np.log10(np.mean(mic[tail] ** 2) / np.mean(processed[tail] ** 2))
    assert erle > 25, f"echo reduced by only {erle:.1f} dB"
    assert stage.counters.reference_frames == stage.counters.frames == len(processed) // FRAME
    # The echo was found at once and the engine heard the canceller from then on: an echo alone is
    # never taken for the caller talking over it.
    assert stage.counters.cancelled_frames > stage.counters.frames - 0.5 * RATE // FRAME
    assert stage.counters.double_talk_frames == 0
    assert stage.counters.onset_frames == 0 and len(stage.take_revision()) == 0
    stage.close()


def test_the_callers_onset_is_where_the_cancellers_output_rose_over_its_floor():
    floor, caller = 1e-6, 1e-4
    assert caller_onset([floor, 1.1 * floor, floor, 3 * floor, 10 * floor, caller, caller]) == 3
    assert caller_onset([caller, caller]) == 2  # nothing to stand over: no onset to reach back to
    assert caller_onset([caller, floor]) == 2  # the last frame was not the caller
    assert caller_onset([]) == 0


def test_the_callers_onset_may_be_where_the_estimates_residual_rose_over_what_the_echo_leaves():
    echo, caller = 1.0, 3.0  # the residual over what the linear estimate expects of the echo alone
    assert residual_onset([echo, caller, echo, caller, caller]) == 3
    assert residual_onset([caller, 1.5, caller]) == 2  # 2 dB over: the echo alone, as the estimate misses it
    assert residual_onset([caller, None, caller, caller]) == 2  # not trusted since placed: it does not say
    assert residual_onset([caller, echo]) == 2  # the last frame was not the caller
    assert residual_onset([]) == 0


def test_the_onset_comes_from_the_best_witness_and_says_which():
    quiet, loud = 1e-6, 1e-3  # AEC3's output: the echo taken down, the caller let through
    def frames(evidence, levels, over):
        return [OnsetWitness(e, level, o) for e, level, o in zip(evidence, levels, over)]
    # The estimate shows the caller in the last three frames: from there, placed by it.
    shown = frames([(False, quiet), (True, loud), (True, loud), (True, loud)], [quiet] * 3 + [loud], [1.0] * 4)
    assert find_onset(shown, 0) == (1, True)
    # It does not show them (no longer trusted); its residual rose a frame before AEC3's output did.
    rose = frames([None] * 4, [quiet, quiet, quiet, loud], [1.0, 1.0, 3.0, 3.0])
    assert find_onset(rose, 0) == (2, True)
    # ... and where it was never trusted, AEC3's output alone.
    assert find_onset(frames([None] * 4, [quiet, quiet, quiet, loud], [None] * 4), 0) == (3, False)
    assert find_onset(frames([None] * 2, [loud, quiet], [None] * 2), 0) == (2, False)  # the last frame was not them


def test_the_estimates_onset_reaches_back_to_where_the_caller_rose_and_no_further():
    def frames(levels_db, shown, over):
        return [OnsetWitness((s, 10 ** (level / 10)), 1e-6, o) for level, s, o in zip(levels_db, shown, over)]
    # A long run of evidence: the room's tail fading where the agent's voice dropped, then the caller rising to
    # the three frames that show them beyond doubt. They began at the quietest frame between the two (before,
    # the onset was the run beyond doubt, and the caller's first 40-100 ms were lost).
    tail_then_caller = [-30, -34, -38, -42, -36, -31, -27, -24, -21, -19, -17, -16]
    assert find_onset(frames(tail_then_caller, [True] * 12, [100.0] * 12), 3) == (4, True)
    # ... less frames 20 dB under the caller: the tail's last, not them.
    tail_then_caller = [-30, -38, -45, -52, -53, -20, -18, -17, -16, -16, -16, -16]
    assert find_onset(frames(tail_then_caller, [True] * 12, [100.0] * 12), 3) == (5, True)
    # Before the estimate's evidence (the last three frames) the caller's first frames stood 3-6 dB over what
    # it expects of the echo, rising frame to frame: up to three of them are the caller too.
    rising = [-45, -41, -38, -35, -31, -27, -24, -22]
    over = [1.0, 2.5, 2.5, 3.0, 4.0, 10.0, 10.0, 10.0]
    shown = [False] * 5 + [True] * 3
    assert find_onset(frames(rising, shown, over), 0) == (2, True)
    # ... not the echo's leftovers, a few dB over it too but not rising into the caller,
    assert find_onset(frames([-40, -41, -30, -28, -26, -27, -24, -22], shown, over), 0) == (5, True)
    # ... nor frames under the 3 dB, nor 20 dB under the caller.
    assert find_onset(frames(rising, shown, [1.0, 2.5, 2.5, 3.0, 1.5, 10.0, 10.0, 10.0]), 0) == (5, True)
    assert find_onset(frames([-60, -55, -50, -47, -40, -27, -24, -22], shown, over), 0) == (4, True)


def test_a_run_the_young_estimate_confirmed_reaches_back_only_over_where_the_line_rose():
    def power(levels_db):
        return [10 ** (level / 10) for level in levels_db]
    # The run at full voice began two frames before the frames the test looked at (from 4 on), the line rising
    # 4-24 dB a frame there: the caller's first syllable.
    assert rising_into(power([-60, -58, -34, -30, -25, -20, -18]), 4, 2) == 2
    # ... a rise that levelled off a frame before what the test looked at (their first vowel) counts too,
    assert rising_into(power([-33, -33, -29, -23, -23, -22, -21]), 4, 0) == 2
    # ... but not before the run, nor further back than three frames however long the rise,
    assert rising_into(power([-45, -40, -35, -30, -25, -20, -18]), 4, 3) == 3
    assert rising_into(power([-50, -45, -40, -35, -30, -25, -20, -18]), 6, 0) == 3
    # ... and not over a line the echo held at full voice before the caller, level or rising under 3 dB a frame,
    assert rising_into(power([-20, -21, -20, -19, -18, -14, -13]), 4, 0) == 4
    assert rising_into(power([-20, -21, -20, -18.5, -17, -14, -13]), 4, 0) == 4
    # ... even where the frame before the test's run stands 3 dB under it (it did not rise itself).
    assert rising_into(power([-33, -34, -33, -33.5, -29, -27]), 4, 0) == 4
    assert rising_into(power([-20, -16]), 1, 0) == 1  # nothing before the first frame to have risen over


def test_a_caller_over_an_echo_as_loud_is_handed_on_from_where_they_began():
    agent = agent_speech(6.0)
    delay = int(0.12 * RATE)
    echo = np.convolve(agent, room_impulse_response(RATE))[:len(agent)]
    echo = np.concatenate([np.zeros(delay, np.float32), echo])[:len(agent)].astype(np.float32)
    caller = at_level(read_wav(FIXTURES / CALLER_WAV, RATE), 0.1)  # another voice, as loud as the echo
    barge = 4 * RATE
    mic = echo.copy()
    mic[barge:barge + len(caller)] += caller[:len(mic) - barge]
    stage = AudioProcessingStage(RATE, AudioProcessing(echo_cancellation=True, high_pass_filter=True))
    heard = np.zeros(0, np.float32)
    revised_at, first, onset_frames = None, 0, 0
    for i in range(0, len(mic) - 2 * FRAME + 1, 2 * FRAME):
        stage.far_end(agent[i:i + 2 * FRAME], RATE)
        out = stage.process(mic[i:i + 2 * FRAME])
        revision = stage.take_revision()
        assert len(revision) <= ONSET_LOOKBACK_FRAMES * FRAME
        if len(revision):  # as the session's window clock applies it
            if revised_at is None:  # the barge-in (later ones: the caller goes on after a pause)
                revised_at, onset_frames = len(heard), stage.counters.onset_frames
                first = len(heard) - len(revision)  # where the frames handed on again begin
            heard[len(heard) - len(revision):] = revision
        heard = np.concatenate([heard, out])
    assert stage.counters.double_talk_frames > 0 and revised_at is not None
    assert barge < revised_at < barge + 0.3 * RATE, "double talk found within 300 ms of the barge-in"
    # The frames reached back to are the caller whole (the line less the linear echo estimate), not
    # AEC3's suppressed output, and they begin where the caller did (the line without the canceller is
    # delayed by its 128 samples, so the caller's first sample is in the frame from ``barge`` on): the
    # echo alone before is not handed on again.
    assert barge <= first <= barge + 2 * FRAME
    lag = 128  # the canceller's own, which the line without it is delayed by
    span = slice(first + FRAME, revised_at)
    assert onset_frames >= 3, "the caller's first frames, which AEC3 took down, are handed on again"
    said = mic - echo  # the caller
    level = 10 * np.log10(np.mean(heard[span] ** 2) / np.mean(said[span.start - lag:span.stop - lag] ** 2))
    assert abs(level) < 1.5, f"the onset came {level:.1f} dB off the caller's level"
    stage.close()


def _barge_in_over_first_words(echo_gain: float, barge: int | None, delay_s: float = 0.12) -> tuple[int | None, int]:
    """The agent's first words from 1 s on, on a speakerphone whose echo comes back ``delay_s`` later at
    ``echo_gain`` (the caller as loud as the agent; 0: no echo) with the room's noise 25 dB under the caller,
    and the caller barging in at ``barge`` (None: never): where the first revision was taken (None: never)
    and where what it handed on begins. The echo alone is never taken for the caller before the barge-in."""
    agent = np.concatenate([np.zeros(RATE, np.float32), agent_speech(3.0)])
    delay = int(delay_s * RATE)
    echo = echo_gain * np.convolve(agent, room_impulse_response(RATE))[:len(agent)]
    echo = np.concatenate([np.zeros(delay, np.float32), echo])[:len(agent)].astype(np.float32)
    caller = at_level(read_wav(FIXTURES / CALLER_WAV, RATE), 0.1)
    mic = echo + pink_noise(len(agent)) * 0.1 * 10 ** (-25 / 20)
    if barge is not None:
        mic[barge:barge + len(caller)] += caller[:len(mic) - barge]
    else:
        barge = len(mic)
    stage = AudioProcessingStage(RATE, AudioProcessing(echo_cancellation=True, high_pass_filter=True))
    revised_at, first = None, 0
    for i in range(0, len(mic) - 2 * FRAME + 1, 2 * FRAME):
        stage.far_end(agent[i:i + 2 * FRAME], RATE)
        stage.process(mic[i:i + 2 * FRAME])
        revision = stage.take_revision()
        if i < barge:
            assert stage.counters.double_talk_frames == 0, f"the echo alone taken for the caller at {i / RATE:.2f} s"
        elif len(revision) and revised_at is None:
            revised_at, first = i + 2 * FRAME, i - len(revision)
    stage.close()
    return revised_at, first


def test_a_caller_far_over_the_echo_in_the_agents_first_words_is_found_at_once_from_where_they_began():
    # The agent's first words on a speakerphone whose echo is 20 dB under the caller, the room's noise 5 dB
    # under the echo (the -20 dB speakerphone of bench bargein). 0.8 s in, the echo search has found the
    # echo but the linear estimate is not trusted yet (the echo barely over the noise), and AEC3, in its
    # first second, takes the caller down 20-35 dB for 150 ms: double talk came 180 ms after the caller
    # began and was handed on from 110 ms in. A line that far over anything the echo reached is the caller.
    barge = int(1.8 * RATE)
    revised_at, first = _barge_in_over_first_words(0.1, barge)
    assert revised_at is not None and revised_at - barge <= 0.1 * RATE, "double talk found within 100 ms"
    assert barge <= first <= barge + 2 * FRAME, "handed on from the caller's first frame"


@pytest.mark.parametrize("barge_s", [1.85, 1.9])
def test_a_caller_near_the_echos_level_in_the_agents_first_words_is_handed_on_from_where_they_began(barge_s):
    # As above with the echo 10 dB under the caller (the -10 dB speakerphone of bench bargein), 0.85-0.9 s
    # into the agent's first words: the linear estimate is trusted but young (it takes out 5-6 dB), the
    # caller's first frames stand only 3-7 dB over what it expects of the echo (under its 9 dB of evidence)
    # and it loses its trust as it learns from them, so the onset was where AEC3's output rose, 40-50 ms in.
    # It is where the estimate's residual first stood 3 dB over what it expects.
    barge = int(barge_s * RATE)
    revised_at, first = _barge_in_over_first_words(10 ** (-10 / 20), barge)
    assert revised_at is not None and revised_at - barge <= 0.2 * RATE, "double talk found within 200 ms"
    # Within a frame of their first (the residual's 3 dB may take in one frame of the echo before them).
    assert barge - FRAME <= first <= barge + 2 * FRAME, f"handed on from {(first - barge) / RATE * 1000:.0f} ms"


def test_a_caller_under_an_echo_as_loud_is_handed_on_from_before_the_canceller_let_them_through():
    # The echo as loud as the caller, 0.8 s into the agent's first words (the first barge-in of bench
    # bargein): the caller's first 30-40 ms are 10 dB and more under the echo, and the young linear
    # estimate (5-6 dB taken out) shows nothing of them, so the onset is where AEC3's output rose, after
    # those frames; handed on from there, 60 ms in, the engine's VAD started 64 ms late. The frames handed
    # on reach back ``ONSET_AHEAD_FRAMES`` before it.
    barge = int(1.8 * RATE)
    revised_at, first = _barge_in_over_first_words(1.0, barge)
    assert revised_at is not None and revised_at - barge <= 0.2 * RATE, "double talk found within 200 ms"
    assert barge - ONSET_AHEAD_FRAMES * FRAME <= first <= barge + 4 * FRAME, \
        f"handed on from {(first - barge) / RATE * 1000:.0f} ms"


@pytest.mark.parametrize("barge_s", [1.0, 1.3, 1.6])
def test_a_caller_over_the_agents_first_words_on_a_line_without_echo_is_handed_on_from_where_they_began(barge_s):
    # Most phone lines have no echo. For the agent's first 0.7 s on a call the echo may be on the line and not
    # found yet, so the engine hears AEC3's output, which took a caller down for as long: they were heard
    # 0.6-0.8 s late, their first words lost. At full voice and unlike the far end at every lag an echo
    # could have, three frames running, they are the caller.
    barge = int(barge_s * RATE)
    revised_at, first = _barge_in_over_first_words(0.0, barge)
    assert revised_at is not None and revised_at - barge <= 0.1 * RATE, "double talk found within 100 ms"
    assert barge - FRAME <= first <= barge + 2 * FRAME, f"handed on from {(first - barge) / RATE * 1000:.0f} ms"


def test_a_caller_over_a_faint_echo_found_as_they_begin_is_found_at_once():
    # The echo 20 dB under the caller, 5 dB over the room's noise: the search finds it about 0.5 s after the
    # agent's first sound, just after a caller barging in 0.45 s in began. The echo's ceiling was learnt only
    # from the frames after the filter was placed, the caller's among them (double talk came 130 ms after
    # they began, handed on from 50 ms in); it is now learnt from the line held since the echo could first
    # have reached it.
    barge = int(1.45 * RATE)
    revised_at, first = _barge_in_over_first_words(0.1, barge)
    assert revised_at is not None and revised_at - barge <= 0.1 * RATE, "double talk found within 100 ms"
    assert barge - FRAME <= first <= barge + 2 * FRAME, f"handed on from {(first - barge) / RATE * 1000:.0f} ms"


@pytest.mark.parametrize(("gain", "delay_s"), [(1.0, 0.12), (1.0, 0.4), (0.3, 0.4), (0.1, 0.2)])
def test_an_echo_not_found_yet_is_not_taken_for_the_caller(gain, delay_s):
    # The agent's first words with no caller, the echo as loud as the agent or under it, on a short or a long
    # path: loud on the line before the search finds it, but the far end at some lag.
    revised_at, _ = _barge_in_over_first_words(gain, None, delay_s)
    assert revised_at is None


def test_a_trimmed_reference_is_not_taken_for_the_caller_and_a_barge_in_after_it_still_is():
    # Mid-call the far end starts to come 200 ms ahead of the caller's playout (the phone plays each
    # frame at its time, as before): the reference queue stands that far ahead, and half a second later
    # is trimmed back, which moves the echo 170 ms further behind the reference at once. AEC3 lets the
    # echo through while it relearns the path, and its double-talk rule alone took that for the caller
    # (65 frames here); the linear estimate is kept in place across the trim and must agree.
    agent = agent_speech(10.0)
    delay = int(0.12 * RATE)
    echo = np.convolve(agent, room_impulse_response(RATE))[:len(agent)]
    echo = np.concatenate([np.zeros(delay, np.float32), echo])[:len(agent)].astype(np.float32)
    caller = at_level(read_wav(FIXTURES / CALLER_WAV, RATE), 0.1)
    ahead, jump_at, barge = int(0.2 * RATE), 5 * RATE, int(7.0 * RATE)
    mic = echo.copy()
    mic[barge:barge + len(caller)] += caller[:len(mic) - barge]
    stage = AudioProcessingStage(RATE, AudioProcessing(echo_cancellation=True, high_pass_filter=True))
    sent, confirmed_at = 0, None
    for i in range(0, len(mic) - 2 * FRAME + 1, 2 * FRAME):
        n = 2 * FRAME + (ahead if i == jump_at else 0)
        stage.far_end(agent[sent:sent + n], RATE)
        sent += n
        stage.process(mic[i:i + 2 * FRAME])
        if i < barge:
            assert stage.counters.double_talk_frames == 0, f"the echo alone taken for the caller at {i / RATE:.2f} s"
        elif confirmed_at is None and stage.counters.double_talk_frames:
            confirmed_at = i
    assert stage.counters.reference_trimmed_s > 0.1, "the reference queue was trimmed mid-call"
    assert stage.snapshot()["counters"]["reference_trimmed_s"] == stage.counters.reference_trimmed_s
    assert confirmed_at is not None and confirmed_at - barge < 0.3 * RATE, "the barge-in after it is still found"
    stage.close()


def test_without_a_reference_the_echo_canceller_leaves_speech_alone():
    # The caller speaks and nothing was played: no far end to cancel, the speech comes through.
    caller = agent_speech(4.0)
    stage = AudioProcessingStage(RATE, AudioProcessing(echo_cancellation=True))
    processed = np.concatenate([stage.process(caller[i:i + 480]) for i in range(0, len(caller), 480)])
    assert 0.5 < rms(processed[RATE:]) / rms(caller[RATE:len(processed)]) < 2.0


def test_lengths_are_kept_and_the_reference_is_bounded():
    stage = AudioProcessingStage(RATE, AudioProcessing(echo_cancellation=True, noise_suppression=True))
    chunk = np.full(250, 0.01, np.float32)  # not a multiple of 10 ms: the rest waits for the next chunk
    out = stage.process(chunk)
    assert len(out) == FRAME
    held, filled = stage.process_gap(np.zeros(333, np.float32))
    assert len(held) == 250 - FRAME and len(filled) == 333  # a gap keeps its place on the uplink exactly
    # The far end nobody's uplink consumes stays bounded, and an interruption takes it back.
    for _ in range(300):
        stage.far_end(np.full(960, 0.1, np.float32), 48000)
    assert len(stage._reference) <= MAX_REFERENCE_S * RATE
    assert stage.counters.reference_trimmed_s > 0
    stage.cut_far_end()
    assert len(stage._reference) == 0 and stage.counters.reference_cut_s > 0
    # Switched off: what it held comes out, and audio passes untouched from then on.
    stage.process(np.full(50, 0.01, np.float32))
    assert len(stage.configure(AudioProcessing())) == 50
    x = np.linspace(-0.5, 0.5, 77).astype(np.float32)
    assert np.array_equal(stage.process(x), x)
    stage.close()


async def test_browser_offers_start_without_and_change_it_with_session_update():
    async with running_server() as (url, _):
        client = RtcClient(url)
        await client.connect()
        try:
            created = (await client.wait_event("session.created"))["session"]["audio_processing"]
            assert created == {"echo_cancellation": False, "noise_suppression": False, "high_pass_filter": False,
                               "auto_gain_control": False, "sample_rate": 16000}
            client.send({"type": "session.update", "session": {"audio_processing": {"noise_suppression": True}}})
            updated = await client.wait_event("session.updated")
            assert updated["session"]["audio_processing"]["noise_suppression"] is True
            assert updated["session"]["audio_processing"]["echo_cancellation"] is False
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/v1/sessions/{client.session_id}", headers=client.auth_headers) as resp:
                    assert (await resp.json())["audio_processing"]["noise_suppression"] is True
            client.send({"type": "session.update", "event_id": "bad",
                         "session": {"audio_processing": {"echo_cancelation": True}}})
            error = await client.wait_event("error")
            assert error["error"]["code"] == "invalid_event" and error["error"]["event_id"] == "bad"
            for event in client.events:
                validate_server_event(event)
        finally:
            await client.close()


async def test_an_offer_may_ask_for_processing_and_whip_has_it_by_default():
    async with running_server() as (url, _):
        client = RtcClient(url)
        await client.connect(session={"audio_processing": {"echo_cancellation": True}})
        pc = RTCPeerConnection()
        try:
            created = (await client.wait_event("session.created"))["session"]["audio_processing"]
            assert created["echo_cancellation"] and not created["noise_suppression"]
            pc.addTransceiver("audio", direction="sendrecv")
            await pc.setLocalDescription(await pc.createOffer())
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{url}/whip", data=pc.localDescription.sdp,
                                     headers={"Content-Type": "application/sdp"}) as resp:
                    assert resp.status == 201
                    answer = await resp.text()
                await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
                async with http.get(f"{url}/v1/sessions") as resp:
                    sessions = (await resp.json())["sessions"]
            whip = [s for s in sessions if s["session_id"] != client.session_id]
            assert len(whip) == 1
            assert whip[0]["audio_processing"]["echo_cancellation"] and whip[0]["audio_processing"]["high_pass_filter"]
        finally:
            await pc.close()
            await client.close()


async def test_phone_calls_from_carriers_have_echo_cancellation_by_default():
    async with phone_server() as (url, _):
        phone = carrier(url, "twilio")
        await phone.connect()
        events = EventStream(url, spec("twilio")["call_id"])
        try:
            await events.connect()
            created = await events.wait("session.created")
            active = created["session"]["audio_processing"]
            assert active["echo_cancellation"] and active["high_pass_filter"] and not active["noise_suppression"]
        finally:
            await events.close()
            await phone.close()


async def test_openai_noise_reduction_sets_the_processing():
    async with running_server(server={"auth_token": KEY}) as (url, _):
        client, call_id = await open_call(url, AUTH, session={
            "type": "realtime", "audio": {"input": {"noise_reduction": {"type": "near_field"}}}})
        try:
            created = await client.wait_event("session.created")
            assert created["session"]["audio"]["input"]["noise_reduction"] == {"type": "near_field"}
            client.send({"type": "session.update",
                         "session": {"type": "realtime", "audio": {"input": {"noise_reduction": {"type": "far_field"}}}}})
            updated = await client.wait_event("session.updated")
            assert updated["session"]["audio"]["input"]["noise_reduction"] == {"type": "far_field"}
            assert "audio.input.noise_reduction" not in updated["lychee_rtc"]["ignored"]
            n = len(client.events)
            client.send({"type": "session.update",
                         "session": {"type": "realtime", "audio": {"input": {"noise_reduction": None}}}})
            off = await client.wait_event("session.updated", after=n)
            assert off["session"]["audio"]["input"]["noise_reduction"] is None
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/v1/sessions/{call_id}", headers=AUTH) as resp:
                    active = (await resp.json())["audio_processing"]
            assert not active["echo_cancellation"] and not active["noise_suppression"]
        finally:
            await client.close()


async def test_openai_sessions_report_the_noise_reduction_applied():
    """``noise_reduction`` says what runs: the echo canceller without noise suppression is not far_field."""
    phone_like = {"echo_cancellation": True, "high_pass_filter": True}
    async with running_server(server={"auth_token": KEY}, audio_processing={"webrtc": phone_like}) as (url, _):
        client, call_id = await open_call(url, AUTH, session={"type": "realtime"})
        try:
            created = await client.wait_event("session.created")
            assert created["session"]["audio"]["input"]["noise_reduction"] is None
            async with aiohttp.ClientSession() as http:
                async with http.get(f"{url}/v1/sessions/{call_id}", headers=AUTH) as resp:
                    active = (await resp.json())["audio_processing"]
            assert active["echo_cancellation"] and not active["noise_suppression"]
            n = len(client.events)
            client.send({"type": "session.update",  # noise suppression on top: now both, far_field
                         "session": {"type": "realtime", "audio": {"input": {"noise_reduction": {"type": "far_field"}}}}})
            updated = await client.wait_event("session.updated", after=n)
            assert updated["session"]["audio"]["input"]["noise_reduction"] == {"type": "far_field"}
            assert updated["lychee_rtc"]["ignored"] == []
        finally:
            await client.close()


async def test_without_the_aec_extra_calls_run_unprocessed_and_asking_for_it_is_refused(monkeypatch):
    # The default install has no livekit: its import fails as it would there.
    monkeypatch.setitem(sys.modules, "livekit", None)
    monkeypatch.setitem(sys.modules, "livekit.rtc", None)
    with pytest.raises(ProcessingUnavailable, match=r"lychee-rtc\[aec\]"):
        AudioProcessingStage(RATE, AudioProcessing(echo_cancellation=True))
    async with running_server() as (url, _):
        refused = RtcClient(url)
        with pytest.raises(RuntimeError, match="audio_processing_unavailable"):
            await refused.connect(session={"audio_processing": {"noise_suppression": True}})
        await refused.close()
        # A client secret whose every call would be refused is refused when it is minted.
        async with aiohttp.ClientSession() as http:
            for wanted, status in (({"type": "far_field"}, 400), ({"type": "near_field"}, 400), (None, 200)):
                session = {"type": "realtime", "audio": {"input": {"noise_reduction": wanted}}}
                async with http.post(f"{url}/v1/realtime/client_secrets", json={"session": session}) as resp:
                    body = await resp.json()
                    assert resp.status == status, body
                    if status == 400:
                        assert body["error"]["code"] == "audio_processing_unavailable"
                        assert body["error"]["param"] == "session.audio.input.noise_reduction"
                        assert "lychee-rtc[aec]" in body["error"]["message"]
        client = RtcClient(url)
        await client.connect()
        try:
            created = (await client.wait_event("session.created"))["session"]["audio_processing"]
            assert created["echo_cancellation"] is False
            client.send({"type": "session.update", "event_id": "ns",
                         "session": {"audio_processing": {"noise_suppression": True}}})
            error = await client.wait_event("error")
            assert error["error"]["code"] == "audio_processing_unavailable"
        finally:
            await client.close()
    async with phone_server() as (url, _):  # a phone leg would have had it: it says why not
        phone = carrier(url, "twilio")
        await phone.connect()
        events = EventStream(url, spec("twilio")["call_id"])
        try:
            await events.connect()
            active = (await events.wait("session.created"))["session"]["audio_processing"]
            assert not active["echo_cancellation"] and "aec" in active["unavailable"]
        finally:
            await events.close()
            await phone.close()


def test_prepared_module_calls_give_the_bindings_own_output_sample_for_sample():
    """``ApmFrames`` sends each request serialized once (``PreparedCall``); the same module fed through
    the binding's own methods, a fresh frame per call, gives the same samples."""
    from livekit.rtc import AudioFrame, AudioProcessingModule

    from lychee_rtc.media.apm_frames import ApmFrames, PreparedCall

    far = agent_speech(3.0)
    mic = np.convolve(far, room_impulse_response(RATE))[:len(far)] * 0.5 + np.float32(0.001) * np.sin(
        np.arange(len(far)) * 0.3)
    settings = dict(echo_cancellation=True, high_pass_filter=True)
    prepared = ApmFrames(AudioProcessingModule(**settings), AudioFrame, RATE, FRAME)
    assert isinstance(prepared._process_stream, PreparedCall)  # not the fallback to the binding's methods
    plain = AudioProcessingModule(**settings)

    def pcm(x: np.ndarray) -> bytearray:
        return bytearray((np.clip(x.astype(np.float32), -1.0, 1.0) * np.float32(32767.0)).astype(np.int16).tobytes())

    for i in range(0, len(far), FRAME):
        prepared.process_reverse(far[i:i + FRAME])
        prepared.set_stream_delay_zero()
        ours = prepared.process(mic[i:i + FRAME])
        plain.process_reverse_stream(AudioFrame(pcm(far[i:i + FRAME]), RATE, 1, FRAME))
        plain.set_stream_delay_ms(0)
        frame = AudioFrame(pcm(mic[i:i + FRAME]), RATE, 1, FRAME)
        plain.process_stream(frame)
        theirs = np.frombuffer(frame.data, np.int16).astype(np.float32) / 32768.0
        assert np.array_equal(ours, theirs), f"frame {i // FRAME}"


def test_an_estimate_that_predicts_an_echo_the_line_does_not_hold_is_not_taken_for_the_caller():
    # The bench's speakerphone on a WebRTC leg (the reference from a 48 kHz track) with the echo as loud as
    # the agent and 250 ms away: 3.75 s into the agent's speech, where the line went quiet after a pause in
    # the agent's voice, the linear estimate left a residual 6-11 dB over the line three frames running, and
    # it was taken for the caller beyond doubt: the engine heard the echo and the agent cut itself off.
    agent, caller = bargein.voices(48000)
    run = bargein.run_once(bargein.PHONE_LEG, 48000, 0.0, 250.0, 25.0, 5.07, agent, caller,
                           room_impulse_response(RATE))
    assert run.self_interruptions == 0, "the agent's own echo started the engine's VAD before the barge-in"
    assert run.start_s is not None and run.start_s < 0.0, "the barge-in itself is heard"


@pytest.mark.parametrize("leg_rate, delay_ms, at_s", [
    (48000, 250.0, 0.8),  # the search finds the echo 0.36 s after the agent's first sound: 704 ms late before
    (8000, 120.0, 0.4),  # 0.4 s into the agent's first words, the echo found just before the caller began
])
def test_a_caller_as_loud_as_the_echo_is_heard_while_the_estimate_is_young(leg_rate, delay_ms, at_s):
    # The echo as loud as the caller, the linear estimate placed but not trusted yet: it showed nothing, the line
    # stood at the echo's ceiling, not over it, and AEC3 took the caller down for 0.7 s (the first barge-in on a
    # 250 ms WebRTC path: the engine heard them 704 ms late, and its answer matched what they said 0.24).
    agent, caller = bargein.voices(leg_rate)
    rir = room_impulse_response(RATE)
    reference = bargein.run_once(None, leg_rate, None, delay_ms, None, at_s, agent, caller, rir)  # off, no echo
    run = bargein.run_once(bargein.PHONE_LEG, leg_rate, 0.0, delay_ms, 25.0, at_s, agent, caller, rir)
    assert reference.start_s is not None and run.start_s is not None, "the barge-in is heard"
    # Confirmed 110 ms after they began, the test having looked at the 100 ms before: handed on from the first
    # of those frames, 20-30 ms after the caller began, the engine heard both 64 ms late; from where the line
    # rose as they began (two or three frames before), within 40 ms.
    assert run.start_s - reference.start_s <= 0.040, f"{1000 * (run.start_s - reference.start_s):.0f} ms late"
    assert run.self_interruptions == 0
    assert run.answer_match is not None and run.answer_match > 0.8


@pytest.mark.parametrize("leg_rate, delay_ms, echo_db, at_s", [
    (48000, 400.0, 0.0, 11.467),  # a long run of evidence (the tail, then the caller): 96 ms late before
    (8000, 40.0, 0.0, 0.8),  # the caller's first frames under the evidence, rising: 64 ms late before
    (48000, 120.0, None, 0.7),  # the agent's first 0.7 s end with the caller talking, no echo: 64 ms late before
])
def test_a_barge_in_of_the_bench_is_heard_from_where_the_caller_began(leg_rate, delay_ms, echo_db, at_s):
    agent, caller = bargein.voices(leg_rate)
    rir = room_impulse_response(RATE)
    reference = bargein.run_once(None, leg_rate, None, delay_ms, None, at_s, agent, caller, rir)
    run = bargein.run_once(bargein.PHONE_LEG, leg_rate, echo_db, delay_ms, None if echo_db is None else 25.0, at_s,
                           agent, caller, rir)
    assert reference.start_s is not None and run.start_s is not None, "the barge-in is heard"
    assert run.start_s - reference.start_s <= 0.040, f"{1000 * (run.start_s - reference.start_s):.0f} ms late"
    assert run.self_interruptions == 0
    assert run.answer_match is not None and run.answer_match > 0.9


def test_a_young_estimate_over_a_faint_echo_does_not_take_the_room_for_the_caller():
    # The echo 20 dB under the caller (5-8 dB over the room's noise) on a 250 ms phone leg: the young estimate's
    # residual is mostly the noise, unlike the far end whoever speaks (0.25 at the echo's loudest), and asked
    # there it took the echo for the caller 0.9 s into the agent's speech: the agent cut itself off.
    agent, caller = bargein.voices(8000)
    run = bargein.run_once(bargein.PHONE_LEG, 8000, -20.0, 250.0, 25.0, 9.33, agent, caller,
                           room_impulse_response(RATE))
    assert run.self_interruptions == 0, "the agent's own echo started the engine's VAD before the barge-in"
    assert run.start_s is not None and run.start_s < 0.0, "the barge-in itself is heard"


def test_a_young_estimate_does_not_take_a_clipping_loudspeaker_for_the_caller(monkeypatch):
    # The bench's room with a loudspeaker that clips the agent's peaks (harder than the estimate's own harness),
    # the echo 10 dB under the caller, 40 ms, on a phone leg: the young filter learns the echo's linear part, and
    # the far end's odd harmonics it leaves are unlike the far end (0.21-0.25) but like its cube; taken for the
    # caller, the agent cut itself off half a second after the echo was found.
    heard = bargein.EchoPath.hear
    monkeypatch.setattr(bargein.EchoPath, "hear", lambda self, x: heard(self, (np.tanh(5 * x) / 5).astype(np.float32)))
    agent, caller = bargein.voices(8000)
    run = bargein.run_once(bargein.PHONE_LEG, 8000, -10.0, 40.0, 25.0, 2.93, agent, caller,
                           room_impulse_response(RATE))
    assert run.self_interruptions == 0, "the clipped echo started the engine's VAD before the barge-in"
    assert run.start_s is not None and run.start_s < 0.0, "the barge-in itself is heard"


@pytest.mark.parametrize("tx_rate", [48000, 8000])
def test_the_echos_tail_in_the_agents_pauses_is_not_taken_for_the_caller(tx_rate):
    # The speakerphone of bench aec without the room's noise: in the agent's pauses the room's tail beyond
    # the linear filter's reach is all of the line (-50 to -75 dBFS), over what the filter expects and unlike
    # the far end at one lag, and it was taken for the caller beyond doubt nine times a minute on each leg.
    agent = np.concatenate([read_wav(FIXTURES / w, RATE) for w in AGENT_WAVS])
    agent = at_level(np.tile(agent, 2)[:15 * RATE], 0.1)
    if tx_rate == 8000:  # a phone leg: both directions narrowband
        agent = resample(resample(agent, RATE, 8000), 8000, RATE)
    sent = resample(agent, RATE, tx_rate)
    delay = int(0.15 * RATE)
    echo = np.convolve(agent, room_impulse_response(RATE))[:len(agent)]
    mic = np.concatenate([np.zeros(delay, np.float32), echo])[:len(agent)].astype(np.float32)
    stage = AudioProcessingStage(RATE, AudioProcessing(echo_cancellation=True, high_pass_filter=True))
    stage.reference_continuous = tx_rate != 8000  # as the WebRTC track feeds it
    step = tx_rate // 50
    for k in range(len(mic) // (2 * FRAME)):
        stage.far_end(sent[k * step:(k + 1) * step], tx_rate)
        stage.process(mic[k * 2 * FRAME:(k + 1) * 2 * FRAME])
    assert stage.counters.double_talk_frames == 0, "the echo alone was taken for the caller"
    assert stage.counters.onset_frames == 0
    stage.close()


def test_bench_aec_gives_no_erle_for_a_block_the_echo_has_not_reached_yet():
    # Speech activity is widened by 50 ms, so on a long echo path the block before the echo's first sound counts
    # as the agent speaking: its ERLE was log10(0) (a RuntimeWarning, and convergence reported a block late).
    n = int(aec_bench.BLOCK_S * RATE)
    reference = np.concatenate([np.zeros(n), np.full(n, 0.1)]).astype(np.float32)
    processed = reference * np.float32(0.01)
    blocks = aec_bench.blocks_db(reference, processed, np.ones(len(reference), bool))
    assert [t for t, _ in blocks] == [aec_bench.BLOCK_S]
    assert blocks[0][1] == pytest.approx(40.0)


def test_bench_bargein_also_measures_a_line_with_echo_against_the_same_line_without_it(tmp_path):
    # The room's noise on a line with echo moves some of the VAD's starts by a chunk of its own: besides the
    # silent line, each barge-in on a line with echo is measured against the same line less the echo, the
    # processing off, run for run.
    out = tmp_path / "bargein.json"
    args = argparse.Namespace(leg="phone", echo_db="0", delay_ms=40.0, snr_db=25.0, noise_without_echo=False,
                              barge_ins=2, first_s=0.8, last_s=13.6, speech_rms=0.1, json=str(out))
    assert bargein._main(args) == 0
    configs = {c["name"]: c for c in json.loads(out.read_text())["configurations"]}
    silent, noisy = configs["off, no echo"]["runs"], configs["off, no echo, the room's noise"]["runs"]
    processed = configs["processing, echo 0 dB"]
    assert processed["late_same_line_ms"] == [round(1000 * (r["start_s"] - ref["start_s"]), 1)
                                              for r, ref in zip(processed["runs"], noisy)]
    assert processed["late_ms"] == [round(1000 * (r["start_s"] - ref["start_s"]), 1)
                                    for r, ref in zip(processed["runs"], silent)]
    assert processed["summary"]["within_40_ms_same_line"] == sum(x <= 40 for x in processed["late_same_line_ms"])
    assert configs["processing, no echo"]["late_same_line_ms"] == []  # a line without echo has no other
