
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
    track.set_output_rate(8000)
    track.write(0, "a", tone(2400))
    frame = await track.recv()
    assert frame.sample_rate == 8000 and frame.samples == 160
    track.stop()


def test_a_passthrough_chunk_longer_than_a_frame_is_not_standing_delay():
    """A loopback engine hands 20 ms chunks to a track sending 10 ms frames: the second half of a
    chunk is current audio, not a backlog; only what queued beyond the last chunk is."""
    from lychee_rtc.rtc.outbound import PacedAudioTrack

    track = PacedAudioTrack(in_rate=16000, live=True, frame_ms=10)
    chunk = np.full(320, 0.1, np.float32)  # 20 ms at 16 kHz
    track.write(track.epoch, "r", chunk)
    queued = track.playout.depth_samples  # 20 ms at 48 kHz, less the resampler's filter delay
    assert queued > 2 * track.frame_samples - 100
    track.trim_standing_delay(track.frame_samples)
    assert track.counters.trimmed_samples == 0 and track.playout.depth_samples == queued
    for _ in range(3):  # a burst after a stall: 60 ms more queued
        track.write(track.epoch, "r", chunk)
    track.trim_standing_delay(track.frame_samples)
    assert track.counters.trimmed_samples > 0
    assert track.playout.depth_samples == 960 + int(0.003 * 48000)  # the last chunk and the margin
    track.stop()
