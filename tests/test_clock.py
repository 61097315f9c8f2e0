import numpy as np
import pytest

from lychee_rtc.session.clock import WindowClock

W = 6400
RATE = 16000


def ramp(start: int, n: int) -> np.ndarray:
    return (np.arange(start, start + n) % 1000 / 1000.0).astype(np.float32)


def test_exact_windows_from_arbitrary_chunks():
    clock = WindowClock(W, RATE, grace_s=0.1)
    out = []
    pos = 0
    for size in [320] * 25 + [123, 4000, 9000, 77]:
        out += clock.write(ramp(pos, size), now=0.0)
        pos += size
    assert [w.seq for w in out] == list(range(len(out)))
    assert all(w.samples.shape == (W,) and w.samples.dtype == np.float32 for w in out)
    np.testing.assert_array_equal(np.concatenate([w.samples for w in out]), ramp(0, len(out) * W))
    assert clock.counters.underruns == 0 and clock.counters.late_samples == 0


def test_deadline_fills_silence_and_late_samples_are_dropped():
    clock = WindowClock(W, RATE, grace_s=0.1)
    first = clock.write(ramp(0, 3200), now=0.0)  # half a window, then the uplink stalls
    assert first == []
    assert clock.poll(now=0.49) == []  # before 0.4 s + grace
    closed = clock.poll(now=0.51)
    assert len(closed) == 1 and closed[0].silence_filled == 3200
    np.testing.assert_array_equal(closed[0].samples[:3200], ramp(0, 3200))
    assert not np.any(closed[0].samples[3200:])
    # The stalled samples finally arrive: the part for the closed window is late, the rest is used.
    out = clock.write(ramp(3200, 3200 + W), now=0.52)
    assert clock.counters.late_samples == 3200
    assert len(out) == 1
    np.testing.assert_array_equal(out[0].samples, ramp(W, W))
    assert clock.counters.underruns == 1 and clock.counters.silence_samples == 3200


def test_gap_keeps_the_time_position_of_later_audio():
    clock = WindowClock(W, RATE, grace_s=0.1)
    out = clock.write(ramp(0, 1000), now=0.0)
    out += clock.gap(500, now=0.01)
    out += clock.write(ramp(1500, W - 1500), now=0.02)
    assert len(out) == 1
    expected = ramp(0, W)
    expected[1000:1500] = 0
    np.testing.assert_array_equal(out[0].samples, expected)
    assert clock.counters.gap_samples == 500


def test_long_stall_closes_every_due_window():
    clock = WindowClock(W, RATE, grace_s=0.0)
    clock.write(ramp(0, 10), now=0.0)
    out = clock.poll(now=2.0)  # five windows due
    assert [w.seq for w in out] == [0, 1, 2, 3, 4]
    assert clock.counters.underruns == 5


def test_gap_can_be_filled_with_concealment():
    from lychee_rtc.media.conceal import conceal

    clock = WindowClock(W, RATE, grace_s=0.1)
    clock.write(ramp(0, 1000), now=0.0)
    fill = conceal(np.ones(320, np.float32), 640, fade=320)
    assert fill[0] == 1.0 and np.all(np.diff(fill[:320]) < 0) and not np.any(fill[320:])
    out = clock.gap(640, now=0.01, fill=fill)
    out += clock.write(ramp(1640, W - 1640), now=0.02)
    np.testing.assert_array_equal(out[0].samples[1000:1640], fill)
    assert clock.counters.gap_samples == 640


def feed(clock, start_sample, n_windows, t_first, delay, poll=True):
    """Write 20 ms frames as a real uplink delivers them: frame j at its end time plus ``delay``."""
    out = []
    frame = 320
    for j in range(n_windows * W // frame):
        pos = start_sample + j * frame
        now = t_first + (pos + frame) / RATE + delay
        if poll:
            out += clock.poll(now - 0.001)
        out += clock.write(ramp(pos, frame), now=now)
    return out


def test_anchor_follows_an_uplink_that_falls_behind_and_catches_up():
    # The uplink's path gets 300 ms longer for good: one window is lost to it, not every window.
    clock = WindowClock(W, RATE, grace_s=0.12)
    out = feed(clock, 0, 5, 0.0, 0.0)
    out += feed(clock, 5 * W, 25, 0.0, 0.3)
    late_windows = [w.seq for w in out if w.silence_filled]
    assert len(late_windows) == 1
    # After that, every window is the uplink's own audio.
    tail = [w for w in out if w.seq > late_windows[0]]
    assert all(w.silence_filled == 0 for w in tail) and len(tail) >= 20
    assert clock.counters.anchor_shift_s > 0.25

    # The path gets short again: windows now complete long before their deadlines, and the anchor
    # moves back so a stall would be noticed within the grace period.
    feed(clock, 30 * W, 30, 0.0, 0.0)
    assert clock.counters.anchor_shift_s < 0.15
    assert clock.counters.underruns == 1
    assert clock.poll(61 * 0.4 + 0.3) != []  # a stall: the open window closes within about the grace


async def test_the_media_timeout_runs_from_the_end_of_a_hold():
    from lychee_rtc.session.window_input import WindowInput

    now = [100.0]
    uplink = WindowInput(WindowClock(6400, 16000, grace_s=0.1), forward=lambda w: None, now=lambda: now[0])
    uplink.audio(np.zeros(320, np.float32))
    assert uplink.last_audio_at == 100.0
    uplink.hold()
    now[0] = 160.0  # a minute on hold with nothing sent (a=inactive)
    uplink.release()
    assert uplink.last_audio_at == 160.0


# --- StreamClock: a socket's uplink, without timestamps ------------------------------------------------


def test_stream_clock_cuts_windows_as_fast_as_samples_come():
    from lychee_rtc.session.clock import StreamClock

    clock = StreamClock(6400, 16000, grace_s=0.12)
    windows = clock.write(np.ones(6400 * 10, np.float32), now=0.0)  # ten windows' worth at once
    assert [w.seq for w in windows] == list(range(10)) and all(w.silence_filled == 0 for w in windows)
    assert clock.counters.underruns == 0 and clock.counters.late_samples == 0


def test_stream_clock_fills_silence_only_when_the_rest_of_a_window_is_overdue_and_then_in_real_time():
    from lychee_rtc.session.clock import StreamClock

    clock = StreamClock(6400, 16000, grace_s=0.12)
    assert clock.write(np.ones(1600, np.float32), now=10.0) == []  # 100 ms of a 400 ms window
    # The other 300 ms would have come by 10.3 s in real time; with the grace, 10.42 s.
    assert clock.deadline() == pytest.approx(10.42)
    assert clock.poll(10.41) == []
    (filled,) = clock.poll(10.42)
    assert filled.silence_filled == 4800 and np.all(filled.samples[:1600] == 1) and np.all(filled.samples[1600:] == 0)
    # Silence goes on a window at a time, in real time.
    assert clock.poll(10.81) == [] and len(clock.poll(10.82)) == 1
    # The client speaks again: nothing is late, its samples start the open window.
    windows = clock.write(np.full(6400, 0.5, np.float32), now=11.0)
    assert len(windows) == 1 and windows[0].silence_filled == 0 and clock.counters.late_samples == 0


def test_stream_clock_waits_while_the_engine_still_has_the_sessions_input():
    from lychee_rtc.session.clock import StreamClock

    busy = {"value": True}
    clock = StreamClock(6400, 16000, grace_s=0.12, busy=lambda: busy["value"])
    clock.write(np.ones(100, np.float32), now=0.0)
    assert clock.poll(5.0) == []  # overdue, but input is only waiting: nothing is filled
    assert clock.deadline() > 5.0
    busy["value"] = False
    assert len(clock.poll(clock.deadline())) == 1
