
import numpy as np

from lychee_rtc.rtc.outbound import PacedAudioTrack
from lychee_rtc.media.playout import PlayoutBuffer


def tone(n: int, value: float = 0.5) -> np.ndarray:
    return np.full(n, value, np.float32)


def test_marks_ledger_and_bound():
    buf = PlayoutBuffer(epoch=0, in_rate=48000, out_rate=48000, max_samples=2000)
    buf.write("a", tone(1500))
    buf.end_response("a")
    buf.write("b", tone(1500, 0.25))  # overflows: the oldest 1000 samples go, end marker stays
    assert buf.depth_samples == 2000 and buf.counters.overflow_samples == 1000
    pcm, marks = buf.read(960)
    assert [(m.kind, m.response_id, m.offset) for m in marks] == [
        ("started", "a", 0), ("finished", "a", 500), ("started", "b", 500)]
    assert marks[1].played_samples == 500
    np.testing.assert_allclose(pcm[:500], 0.5)
    np.testing.assert_allclose(pcm[500:], 0.25)


def test_underrun_counted_only_inside_a_response():
    buf = PlayoutBuffer(epoch=0, in_rate=24000, out_rate=48000, max_samples=48000)
    pcm, marks = buf.read(960)
    assert not np.any(pcm) and buf.counters.underrun_samples == 0
    buf.write("a", tone(2400))
    for _ in range(6):  # 4800 resampled samples (less the filter delay, not flushed): runs dry
        buf.read(960)
    assert buf.counters.underrun_samples > 0


async def test_track_paces_continuous_frames_and_cut_drops_stale_writes():
    track = PacedAudioTrack(in_rate=24000, out_rate=48000)
    track.write(0, "a", tone(24000))
    frames = [await track.recv() for _ in range(5)]
    assert [f.pts for f in frames] == [0, 960, 1920, 2880, 3840]
    assert all(f.samples == 960 and f.sample_rate == 48000 for f in frames)
    report = track.cut(1)
    assert report.old_epoch == 0 and report.response_id == "a" and report.played_samples == 4800
    assert report.discarded_samples > 40000
    assert track.write(0, "a", tone(2400)) is False  # a late producer of the old epoch
    assert track.counters.stale_chunks == 1
    frame = await track.recv()
    assert frame.pts == 4800 and not np.any(frame.to_ndarray())
    track.stop()


async def test_g711_rate():
    track = PacedAudioTrack(in_rate=24000)
    track.use_codec("PCMU", 8000)
    assert track.out_rate == 8000 and track.codec_delay_s == 0.0  # G.711 codes each sample alone
    track.write(0, "a", tone(2400))
    frame = await track.recv()
    assert frame.sample_rate == 8000 and frame.samples == 160
    track.use_codec("opus", 48000)  # too late to change the clock once a frame is out
    assert track.out_rate == 8000 and track.codec_delay_s > 0
    track.stop()


def test_a_passthrough_chunk_longer_than_a_frame_is_not_standing_delay():
    """A loopback engine hands 20 ms chunks to a track sending 10 ms frames: the second half of a
    chunk is current audio, not a backlog; what queued beyond the last chunk, and stays, is."""
    from lychee_rtc.media.epoch_sink import STANDING_WINDOW_S
    from lychee_rtc.rtc.outbound import PacedAudioTrack

    track = PacedAudioTrack(in_rate=16000, live=True, frame_ms=10)
    chunk = np.full(320, 0.1, np.float32)  # 20 ms at 16 kHz
    window_frames = round(STANDING_WINDOW_S * 1000 / 10)

    def send_frames(count: int, refill: bool) -> None:  # trimmed, then a frame read, as the track does
        for k in range(count):
            if refill and k % 2 == 0:
                track.write(track.epoch, "r", chunk)
            track.trim_standing_delay(track.frame_samples)
            track.playout.read(track.frame_samples)

    send_frames(2 * window_frames, refill=True)  # a chunk per two frames: never a backlog
    assert track.counters.trimmed_samples == 0
    for _ in range(3):  # a burst after a stall: 60 ms more, and it stays
        track.write(track.epoch, "r", chunk)
    send_frames(window_frames, refill=True)
    trimmed = track.counters.trimmed_samples
    assert 2000 < trimmed <= 3 * 960  # most of the burst, taken once the window showed it stayed
    track.stop()


def test_two_packets_arriving_together_are_not_standing_delay():
    """After one late packet the next arrives with it: one frame of extra depth for one frame is jitter."""
    from lychee_rtc.rtc.outbound import PacedAudioTrack

    track = PacedAudioTrack(in_rate=16000, live=True, frame_ms=10)
    frame_audio = np.full(160, 0.1, np.float32)  # 10 ms at 16 kHz
    for k in range(200):
        # Every fourth packet is late and arrives with the next, just before its own frame leaves.
        for _ in range(2 if k % 4 == 3 else 0 if k % 4 == 0 and k else 1):
            track.write(track.epoch, "r", frame_audio)
        track.trim_standing_delay(track.frame_samples)
        track.playout.read(track.frame_samples)
    assert track.counters.trimmed_samples == 0
    track.stop()


async def test_a_stall_skips_its_slots_and_the_timestamps_jump_with_them():
    """A sender that stalled past catching up leaves the slots it missed unsent, and the next
    frame's pts is its slot's: the timestamps keep to the send clock, so a receiver sees a gap, not
    every later packet arriving late. A short delay is caught up by sending at once instead."""
    from lychee_rtc.rtc.outbound import MAX_CATCH_UP_S

    now = [100.0]
    track = PacedAudioTrack(in_rate=48000, out_rate=48000, clock=lambda: now[0])
    track.write(0, "a", tone(48000))

    async def frame_at(t: float):
        now[0] = t
        return await track.recv()

    assert (await frame_at(100.0)).pts == 0
    assert (await frame_at(100.020)).pts == 960
    # Late by less than the catch-up limit: the next frames go at once, back to back.
    late = 100.040 + MAX_CATCH_UP_S / 2
    assert [(await frame_at(late)).pts for _ in range(3)] == [1920, 2880, 3840]
    assert track.counters.stalls == 0
    # A stall of half a second from the slot at 100.100: the slots it took are skipped.
    frame = await frame_at(100.600)
    assert frame.pts == 28800 and track.counters.stalls == 1 and track.counters.skipped_frames == 25
    assert track.counters.frames == 6
    # The audio itself was not skipped: it goes on where it stopped.
    np.testing.assert_allclose(frame.to_ndarray()[0, :10] / 32767.0, 0.5, atol=1e-3)
    assert track.playout.depth_samples == 48000 - 6 * 960
    track.stop()
