"""The steady send point of a passthrough track (rtc/send_phase.py), on arrival patterns made here."""

from __future__ import annotations

import pytest

from lychee_rtc.rtc.send_phase import SendPhase

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
