"""The recording's two channels keep the caller's time: the codec's delay and the path's transit
(RTCP's round trip over two) come out of the stamps, and a longer path does not pull them apart."""

from __future__ import annotations

import math

import numpy as np

from lychee_rtc.media.recording.recorder import AGENT, CALLER, CallRecorder
from lychee_rtc.media.recording.timeline import RATE, ChannelPlacer, MixBuffer, PlacementCounters
from lychee_rtc.media.recording.writer import RecordingWriter
from lychee_rtc.media.transit import MAX_ROUND_TRIP_S, TransitEstimate

CHUNK = RATE // 50


def test_the_transit_is_half_the_median_of_recent_round_trips_and_bounded():
    estimate = TransitEstimate(history=3)
    assert estimate.way_in_s() == estimate.way_out_s() == 0.0  # no report yet: nothing taken out
    for rtt in (0.040, 0.400, 0.044):  # one report held up by a stall does not move the median
        estimate.observe(rtt, "rtcp_round_trip")
    assert math.isclose(estimate.way_in_s(), 0.022) and math.isclose(estimate.way_out_s(), 0.022)
    for bad in (float("nan"), float("inf"), -0.01):
        estimate.observe(bad, "rtcp_round_trip")
    assert estimate.reports == 3
    for _ in range(3):
        estimate.observe(30.0, "rtcp_round_trip")  # a stalled far end: bounded, and the old ones age out
    assert estimate.way_out_s() == MAX_ROUND_TRIP_S / 2


def test_a_far_end_buffer_is_all_on_the_way_out():
    estimate = TransitEstimate()
    estimate.observe(0.060, "carrier_mark_echo", out_share=1.0)
    assert estimate.way_in_s() == 0.0 and math.isclose(estimate.way_out_s(), 0.060)


def test_a_shift_moves_a_stream_without_breaking_it():
    counters = PlacementCounters()
    buffer = MixBuffer(RATE * 4, counters)
    placer = ChannelPlacer(1, counters)
    placer.push(buffer, 0.5, np.full(CHUNK, 0.1, np.float32), RATE)
    placer.shift(buffer, 0.03)  # stamps are 30 ms later from here on
    placer.push(buffer, 0.55, np.full(CHUNK, 0.2, np.float32), RATE)
    assert counters.reanchors == 0 and counters.slides == 0
    start = round(0.55 * RATE)
    assert np.all(buffer.data[start:start + CHUNK, 1] == np.float32(0.2))
    assert np.all(buffer.data[round(0.52 * RATE):start, 1] == 0.0)  # the 30 ms the stream moved by


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _recorder(tmp_path) -> tuple[CallRecorder, RecordingWriter, Clock]:
    clock = Clock()
    # The writer's thread is not started: what the taps hand it stays on its queue, in order.
    writer = RecordingWriter(tmp_path / "audio.ogg", tmp_path / "events.jsonl", clock(), 32000, 100, clock)
    return CallRecorder("s", writer, clock), writer, clock


def _items(writer: RecordingWriter) -> list[tuple]:
    out = []
    while not writer.queue.empty():
        out.append(writer.queue.get_nowait())
    return out


def test_the_stamps_take_out_half_the_round_trip_each_way(tmp_path):
    recorder, writer, clock = _recorder(tmp_path)
    recorder.codec_delay_s = 0.0065
    recorder.transit = TransitEstimate()
    pcm = np.zeros(960, np.float32)
    recorder.agent_sent(pcm, 48000, clock())
    assert _items(writer)[-1][2] == clock() + 0.0065  # no round trip yet: the codec's delay only
    recorder.transit.observe(0.080, "rtcp_round_trip")
    clock.now += 0.02
    recorder.caller_audio(np.zeros(320, np.float32), 16000)
    items = _items(writer)
    # Both channels move by the change before the first stamp that uses it, and the sidecar says so.
    assert [i[:2] for i in items[:2]] == [("shift", CALLER), ("shift", AGENT)]
    assert math.isclose(items[0][2], -0.040) and math.isclose(items[1][2], 0.040)
    assert '"recording.transit"' in items[2][1] and '"way_in_ms":40.0,"way_out_ms":40.0' in items[2][1]
    audio = items[3]
    assert audio[:2] == ("audio", CALLER)
    assert math.isclose(audio[2], clock() - 0.02 - 0.0065 - 0.040)  # said before it arrived
    recorder.agent_sent(pcm, 48000, clock())
    assert math.isclose(_items(writer)[-1][2], clock() + 0.0065 + 0.040)  # heard after it left
    recorder.transit.observe(0.0815, "rtcp_round_trip")  # a wobble under the step: no shift
    recorder.agent_sent(pcm, 48000, clock())
    assert [i[0] for i in _items(writer)] == ["audio"]
    recorder.close("done")
    assert writer.state.alignment == {"codec_delay_ms": 6.5, "transit_source": "rtcp_round_trip",
                                      "way_in_ms_last": 40.0, "way_in_ms_min": 40.0, "way_in_ms_max": 40.0,
                                      "way_out_ms_last": 40.0, "way_out_ms_min": 40.0, "way_out_ms_max": 40.0,
                                      "transit_changes": 1}


async def test_the_channels_stay_aligned_over_a_longer_path(tmp_path):
    """A real aiortc caller through a UDP relay that delays every packet (RTCP too) 40 ms each way:
    uncompensated the two channels would lie about 80 ms short of what the caller lived through."""
    from lychee_rtc.bench.recording_alignment import measure

    report = await measure("webrtc", 16, 0.5, tmp_path, lead_ms=0, delay_ms=40.0)
    assert report.found >= 14, report
    assert 35.0 <= report.compensation["way_out_ms_last"] <= 80.0, report.compensation
    assert report.compensation["transit_source"] == "rtcp_round_trip"
    # The chirps before the first round trip (1-3 s into the call, later if the first receiver
    # reports answer an older sender report) are off by the whole path; those of the second half
    # (5-9 s in) are judged, where the error is what the relay and both ends' loops add unevenly.
    later = report.errors_ms[len(report.errors_ms) // 2:]
    assert abs(float(np.median(later))) < 10.0, report


async def test_a_carriers_late_mark_echo_puts_its_playout_lag_on_the_way_out():
    """The carrier plays 300 ms behind the pacer's estimate of its buffer: its mark echo says so."""
    import asyncio
    import json
    import time

    from telephony_support import spec

    from lychee_rtc.config import TelephonySettings
    from lychee_rtc.telephony.carriers import DIALECTS
    from lychee_rtc.telephony.outbox import Outbox
    from lychee_rtc.telephony.pacer import MARK_SOURCE, CarrierPacer

    behind = [0.0]
    dialect = DIALECTS["twilio"]()
    dialect.parse(json.dumps(spec("twilio")["handshake"][-1]))
    outbox = Outbox(10_000)
    pacer = CarrierPacer(24000, dialect, outbox, TelephonySettings(lead_ms=100, mark_interval_ms=100),
                         max_buffer_s=30, clock=lambda: time.monotonic() + behind[0])
    task = asyncio.create_task(pacer.run())
    try:
        pacer.write(0, "r1", np.full(2400, 0.3, np.float32))  # 100 ms
        pacer.end_response(0, "r1")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while not (marks := [json.loads(item[1])["mark"]["name"] for item in outbox._items
                             if json.loads(item[1])["event"] == "mark"]):
            assert loop.time() < deadline, "the pacer sent no mark"
            await asyncio.sleep(0.01)
        assert pacer.transit.reports == 0
        behind[0] = 0.3  # the echo comes 300 ms after this moment's estimate of the play end
        pacer.on_mark(marks[-1])
        # The audio before the mark was to end at most 100 ms (its length) after now.
        assert pacer.transit.source == MARK_SOURCE
        assert pacer.transit.way_in_s() == 0.0 and 0.19 <= pacer.transit.way_out_s() <= 0.31
    finally:
        task.cancel()


class SentLog:
    """What the pacer tells a recording (its ``sent_tap``): (samples, rate, when heard)."""

    def __init__(self) -> None:
        self.sent: list[tuple[np.ndarray, int, float]] = []

    def agent_sent(self, pcm, rate, at) -> None:
        self.sent.append((np.array(pcm), rate, at))

    def agent_cut(self, at) -> None:
        pass


async def test_an_idle_carrier_is_recorded_as_silence_so_later_audio_keeps_its_time():
    import asyncio
    import json

    from telephony_support import spec

    from lychee_rtc.config import TelephonySettings
    from lychee_rtc.telephony.carriers import DIALECTS
    from lychee_rtc.telephony.outbox import Outbox
    from lychee_rtc.telephony.pacer import CarrierPacer

    dialect = DIALECTS["twilio"]()
    dialect.parse(json.dumps(spec("twilio")["handshake"][-1]))
    pacer = CarrierPacer(24000, dialect, Outbox(10_000), TelephonySettings(lead_ms=0), max_buffer_s=30)
    log = SentLog()
    pacer.sent_tap = log
    loop = asyncio.get_running_loop()

    async def until(condition, what: str) -> None:
        deadline = loop.time() + 10
        while not condition():
            assert loop.time() < deadline, what
            await asyncio.sleep(0.005)

    def loud() -> list[tuple[np.ndarray, int, float]]:
        return [e for e in log.sent if np.any(e[0] != 0)]

    task = asyncio.create_task(pacer.run())
    try:
        pacer.write(0, "r1", np.full(480, 0.3, np.float32))  # one 20 ms answer
        pacer.end_response(0, "r1")
        await until(lambda: loud() and not pacer._has_audio(), "the first answer was not sent")
        dry_at = pacer._carrier_until
        await until(lambda: pacer._clock() > dry_at + 0.06, "the clock stood still")  # idle 60 ms or more
        heard = len(loud())
        pacer.write(0, "r2", np.full(480, 0.3, np.float32))
        pacer.end_response(0, "r2")
        await until(lambda: len(loud()) > heard, "the answer after the idle was not sent")
        # What the recording is told is one stream without holes, on the pacer's clock: each piece
        # starts where the one before ended, and the idle (60 ms or more) is silence in it.
        for (pcm, rate, at), (_, _, next_at) in zip(log.sent, log.sent[1:]):
            assert math.isclose(at + len(pcm) / rate, next_at, abs_tol=1 / rate), [(len(e[0]), e[2]) for e in log.sent]
        idle = [e for e in log.sent if e[2] >= dry_at - 1e-9 and e[2] < loud()[heard][2]]
        assert sum(len(e[0]) for e in idle) / 8000 >= 0.06 and all(not np.any(e[0]) for e in idle)
    finally:
        task.cancel()
