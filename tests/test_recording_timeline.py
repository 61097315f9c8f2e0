"""Placement on the recording's clock (pure): continuity through jitter, breaks, late anchors, cuts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lychee_rtc.media.recording.timeline import RATE, ChannelPlacer, MixBuffer, PlacementCounters

CHUNK = RATE // 50  # 20 ms at the recording's rate: no resampling in these tests


def _setup() -> tuple[MixBuffer, ChannelPlacer, PlacementCounters]:
    counters = PlacementCounters()
    buffer = MixBuffer(RATE * 4, counters)
    return buffer, ChannelPlacer(1, counters), counters


def _ramp(k: int) -> np.ndarray:
    return np.full(CHUNK, (k + 1) / 100, np.float32)


def test_jittered_stamps_keep_a_stream_contiguous():
    buffer, placer, counters = _setup()
    jitter = [0.0, 0.011, 0.004, 0.03, 0.0005, 0.019]
    for k, j in enumerate(jitter):
        placer.push(buffer, 0.5 + k * 0.02 + j, _ramp(k), RATE)
    placed = buffer.data[:, 1]
    start = round(0.5 * RATE)
    for k in range(len(jitter)):
        assert np.all(placed[start + k * CHUNK:start + (k + 1) * CHUNK] == _ramp(k)[0])
    assert counters.reanchors == 0 and counters.slides == 0


def test_a_late_first_stamp_slides_back_to_an_earlier_one():
    buffer, placer, counters = _setup()
    placer.push(buffer, 0.08, _ramp(0), RATE)  # delayed on its way in: 30 ms late
    placer.push(buffer, 0.07, _ramp(1), RATE)  # on time: its place is 0.07, not 0.1
    assert counters.slides == 1
    assert np.all(buffer.data[round(0.07 * RATE):round(0.09 * RATE), 1] == _ramp(1)[0])


def test_a_break_re_anchors_and_leaves_silence_between():
    buffer, placer, counters = _setup()
    placer.push(buffer, 0.0, _ramp(0), RATE)
    placer.push(buffer, 1.0, _ramp(1), RATE)  # the stream paused for most of a second
    assert counters.reanchors == 1
    assert np.all(buffer.data[CHUNK:RATE, 1] == 0.0)
    assert np.all(buffer.data[RATE:RATE + CHUNK, 1] == _ramp(1)[0])


def test_a_cut_erases_what_was_placed_after_it_and_nothing_before():
    buffer, placer, _ = _setup()
    for k in range(10):
        placer.push(buffer, k * 0.02, _ramp(k), RATE)
    placer.cut(buffer, 0.1)
    assert np.all(buffer.data[:round(0.1 * RATE), 1] > 0)
    assert np.all(buffer.data[round(0.1 * RATE):, 1] == 0.0)


def test_audio_whose_place_was_already_written_is_dropped_and_counted():
    buffer, placer, counters = _setup()
    buffer.take(RATE)  # one second written out
    placer.push(buffer, 0.99, _ramp(0), RATE)
    assert counters.late_samples == round(0.01 * RATE)
    assert np.all(buffer.data[:CHUNK // 2, 1] == _ramp(0)[0])


def test_other_rates_are_resampled_into_place():
    buffer, placer, _ = _setup()
    tone = np.sin(2 * np.pi * 300 * np.arange(8000) / 8000).astype(np.float32) * 0.5
    for k in range(0, 8000, 160):
        placer.push(buffer, 0.25 + k / 8000, tone[k:k + 160], 8000)
    placer.close(buffer)
    placed = buffer.data[:, 1]
    loud = np.flatnonzero(np.abs(placed) > 0.1)
    assert abs(loud[0] - round(0.25 * RATE)) < 100 and abs(loud[-1] - round(1.25 * RATE)) < 200


def test_a_run_of_chunks_is_resampled_at_once_into_the_place_each_chunk_would_take():
    """The writer resamples what came since its last look in one call: the same samples in the same
    places as chunk by chunk, and a slide in the middle leaves what came before it where it was."""
    tone = (np.sin(2 * np.pi * 300 * np.arange(16000) / 16000) * 0.5).astype(np.float32)

    def placed(flush_every_chunk: bool, slide_at: int | None = None) -> np.ndarray:
        buffer, placer, _ = _setup()
        for k in range(0, 16000, 320):
            at = 0.25 + k / 16000 - (0.01 if slide_at is not None and k >= slide_at else 0.0)
            placer.push(buffer, at, tone[k:k + 320], 16000)
            if flush_every_chunk:
                placer.flush(buffer)
        placer.close(buffer)
        return buffer.data[:, 1].copy()

    assert np.array_equal(placed(False), placed(True))
    slid, slid_each = placed(False, slide_at=8000), placed(True, slide_at=8000)
    assert np.array_equal(slid, slid_each)
    assert not np.array_equal(slid, placed(False))  # the slide did move the second half


def test_the_buffer_hands_out_the_timeline_in_order_across_many_turns():
    """Placed ahead in uneven chunks and taken in uneven blocks, 40 times its capacity: what is handed
    out is the timeline, sample for sample, with nothing left over from an earlier turn."""
    rng = np.random.default_rng(7)
    capacity = 1000
    timeline = rng.standard_normal((capacity * 40, 2)).astype(np.float32)
    timeline[::7] = 0.0  # never-placed samples must come out as silence, not an old turn's audio
    buffer = MixBuffer(capacity, PlacementCounters())
    placed_to, taken = 0, []
    while buffer.base < len(timeline):
        while placed_to < min(buffer.base + capacity, len(timeline)):
            n = min(int(rng.integers(1, 300)), buffer.base + capacity - placed_to, len(timeline) - placed_to)
            for channel in (0, 1):
                chunk = timeline[placed_to:placed_to + n, channel]
                if np.any(chunk):
                    buffer.place(channel, placed_to, chunk)
            placed_to += n
        taken.append(buffer.take(buffer.base + int(rng.integers(1, capacity))))
    assert np.array_equal(np.concatenate(taken)[:len(timeline)], timeline)


# --- the writer thread: a full disk and a full queue cost the recording, never the caller ---------------

@pytest.mark.allowed_logs(r"failed, the call goes on unrecorded")  # the full disk it fakes
def test_a_full_disk_fails_the_recording_and_the_writer_keeps_taking_items(tmp_path):
    import time

    from lychee_rtc.media.recording.writer import RecordingWriter

    done = []
    # /dev/full takes the open and refuses every write with ENOSPC: a disk that has filled up.
    writer = RecordingWriter(Path("/dev/full"), tmp_path / "events.jsonl", time.monotonic(), 32000, 50,
                             on_done=done.append)
    writer.start()
    t0 = time.monotonic()
    for k in range(400):  # eight seconds of frames, submitted at once: the writer must fail, not block
        writer.submit(("audio", 0, t0 - 10 + k * 0.02, np.zeros(960, np.float32), RATE))
    writer.finish(time.monotonic())
    writer.join(30)
    assert not writer.is_alive()
    assert done and done[0].status == "failed" and "No space" in (done[0].error or "")


def test_a_full_queue_drops_and_counts_instead_of_waiting(tmp_path):
    import time

    from lychee_rtc.media.recording.writer import RecordingWriter

    writer = RecordingWriter(tmp_path / "a.ogg", tmp_path / "e.jsonl", time.monotonic(), 32000, 50)
    # Not started: nothing takes items off the queue, as with a writer stuck on a slow disk.
    accepted = sum(writer.submit(("line", "{}")) for _ in range(80))
    assert accepted == 50 and writer.state.counters.items_dropped == 30


def test_the_configured_complexity_is_what_encodes_and_the_bitrate_holds(tmp_path):
    """``recording.complexity`` reaches libopus (0 and 10 encode the same audio differently), and at
    either the file keeps to the configured bitrate (constrained VBR)."""
    import time

    import soundfile

    from lychee_rtc.config import RecordingSettings
    from lychee_rtc.media.recording.store import RecordingStore

    seconds = 2.0
    voice = np.sin(2 * np.pi * 220 * np.arange(int(16000 * seconds)) / 16000) * np.linspace(0.1, 0.5, int(16000 * seconds))
    sizes = {}
    for complexity in (0, 10):
        clock = [1000.0]
        store = RecordingStore(RecordingSettings(directory=tmp_path / str(complexity), complexity=complexity),
                               clock=lambda: clock[0])
        recorder = store.open(f"sess_{complexity:04d}", None, {})
        for k in range(0, len(voice), 320):
            clock[0] += 0.02
            recorder.caller_audio(voice[k:k + 320].astype(np.float32), 16000)
        recorder.close("done")
        assert store.wait_idle(30)
        path = store.path(f"sess_{complexity:04d}", "audio.ogg")
        sizes[complexity] = path.read_bytes()
        audio, rate = soundfile.read(path, always_2d=True)
        assert rate == 48000 and abs(len(audio) / rate - seconds) < 0.1
    assert sizes[0] != sizes[10]
    for data in sizes.values():
        assert len(data) * 8 / seconds < 32000 * 1.3, len(data)
