"""The steady send point of a passthrough track (rtc/send_phase.py), on arrival patterns made here."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from lychee_rtc.rtc.outbound import PacedAudioTrack
from lychee_rtc.rtc.send_phase import ArrivalPhase, SendPhase

FRAME = 0.010


def feed(phase: SendPhase, readiness: list[float], start: float = 0.0) -> float:
    """One frame per 10 ms; ``readiness[k]`` is when frame k's audio was there, from its slot."""
    now = start
    for k, ready in enumerate(readiness):
        now = start + k * FRAME + ready
        phase.observe(now, ready)
    return now


def test_nothing_seen_yet_sends_as_early_as_the_lead_allows():
    assert SendPhase(max_lead_s=0.015, max_hold_s=FRAME).offset() == -0.015


def test_the_send_point_is_just_after_the_latest_regular_arrival():
    """Every fourth packet 6 ms late (a browser handing over audio in pairs): all frames wait for that."""
    phase = SendPhase(max_lead_s=0.015, max_hold_s=FRAME)
    feed(phase, [0.002 if k % 4 == 3 else -0.004 for k in range(100)])
    assert phase.offset() == pytest.approx(0.002 + phase.margin_s)


def test_a_rare_late_packet_does_not_move_it():
    """One packet in 300 late (a loss, filled in by the next packet) is left to the receiver."""
    phase = SendPhase(max_lead_s=0.015, max_hold_s=FRAME)
    feed(phase, [0.009 if k == 50 else -0.004 for k in range(300)])
    assert phase.offset() == pytest.approx(-0.004 + phase.margin_s)


def test_it_stays_within_the_lead_and_one_frame_of_hold():
    early, late = SendPhase(max_lead_s=0.015, max_hold_s=FRAME), SendPhase(max_lead_s=0.015, max_hold_s=FRAME)
    feed(early, [-0.100] * 50)
    feed(late, [0.050] * 50)
    assert early.offset() == -0.015 and late.offset() == FRAME


def test_old_arrivals_leave_the_window():
    """A second of late arrivals, then a regular pattern for longer than the window: only that counts."""
    phase = SendPhase(max_lead_s=0.015, max_hold_s=FRAME, window_s=1.0, quantile=0.95)
    now = feed(phase, [0.006] * 100)
    assert phase.offset() == pytest.approx(0.007)
    feed(phase, [-0.005] * 120, start=now + FRAME)
    assert phase.offset() == pytest.approx(-0.004)
    assert len(phase._sorted) <= 101  # bounded by the window


# --- arrival pacing: the send clock follows a call whose audio comes before the lead ----------------

def test_a_run_of_early_arrivals_moves_the_clock_by_the_least_wait():
    arrival = ArrivalPhase(frames=4)
    assert [arrival.observe(w) for w in (0.003, 0.002, 0.004)] == [0.0, 0.0, 0.0]
    assert arrival.observe(0.0025) == pytest.approx(0.002 + arrival.margin_s)
    assert arrival.observe(0.003) == 0.0  # a new run begins


def test_a_frame_that_went_at_once_or_was_queued_breaks_the_run():
    """Only a steady early arrival moves it: not a burst, a backlog or a frame of silence."""
    arrival = ArrivalPhase(frames=3)
    for breaker in (0.0, -0.001, None):
        assert [arrival.observe(0.002), arrival.observe(0.002), arrival.observe(breaker)] == [0.0, 0.0, 0.0]
    assert [arrival.observe(0.002) for _ in range(3)][-1] > 0.0


async def test_a_track_whose_audio_comes_early_stops_waiting_for_the_lead():
    """A real paced track on a clock of its own: each frame's audio arrives 2 ms before the lead lets it
    leave. The first frames wait for their send point (a timer: the clock has to be moved on); once
    the run is seen, the rest leave as their audio arrives, each after the one before."""
    now = [100.0]
    track = PacedAudioTrack(in_rate=48000, out_rate=48000, clock=lambda: now[0], live=True, live_lead_s=0.015)
    frame = track.frame_samples

    async def settle(task: asyncio.Task) -> bool:
        for _ in range(50):  # a frame that does not wait is sent within a few loop turns
            if task.done():
                return True
            await asyncio.sleep(0)
        return task.done()

    first = asyncio.create_task(track.next_pcm())
    assert not await settle(first)  # no audio: silence at the slot's grace
    now[0] = 100.0 + 0.02
    await asyncio.wait_for(first, 5)
    waited, sent_at = [], []
    for k in range(1, 25):
        task = asyncio.create_task(track.next_pcm())
        await settle(task)
        due = track._due()
        # The caller's clock: frame k's audio comes 17 ms before the slot the track first gave it,
        # 2 ms before the lead lets it leave.
        now[0] = max(now[0], 100.0 + 0.02 * k - 0.017)
        track.write(track.epoch, "r", np.full(frame, 0.1, np.float32))
        if await settle(task):
            waited.append(False)
        else:
            waited.append(True)
            now[0] = due - 0.015
            await asyncio.wait_for(task, 5)
        sent_at.append(now[0])
    run = ArrivalPhase().frames  # the first frame went at once: its slot had passed when its audio came
    assert waited == [False] + [True] * run + [False] * (len(waited) - run - 1), waited
    assert all(b - a == pytest.approx(0.02, abs=1e-6) for a, b in zip(sent_at[12:], sent_at[13:]))
    track.stop()
