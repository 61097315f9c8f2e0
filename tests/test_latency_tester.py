"""The latency tester page (/latency) in headless Chromium, and the impaired UDP path it is validated with.

The servers run as child processes (``lychee-rtc serve``), so their timing does not share an event
loop with Playwright or the relay. Nothing here asserts how fast anything is: the tests assert that
what the page measures is right (a delay added to real packets shows up as exactly that much more
latency; a response is never timed before the engine could have answered) and that the exports
carry the same numbers.
"""

from __future__ import annotations

import asyncio
import csv
import io
import json
import shutil
import statistics
import subprocess
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from conftest import speech_fixture, wait_until
from strict import unavailable

from lychee_rtc.bench.browser import CHROMIUM, CHROMIUM_FLAGS, PageRun, measure, run_page
from lychee_rtc.bench.impairment import (
    ImpairedPath,
    Impairment,
    PacketFate,
    PathSettings,
    UdpRelay,
    host_candidates,
    replace_candidates,
)
from lychee_rtc.bench.server_process import spawned_server
from lychee_rtc.config import load_settings

ADDED_DELAY_MS = 50.0


def heard(result: dict) -> list[float]:
    return [p["latency_ms"] for p in result["probes"] if p["latency_ms"] is not None]


async def test_the_page_measures_mouth_to_ear_and_exports_what_it_shows(tmp_path):
    exported: dict[str, str] = {}

    async def export(page) -> None:
        await page.wait_for_function("() => window.latencyTester.result !== null", timeout=300_000, polling=200)
        for button in ("#export-json", "#export-csv"):
            async with page.expect_download() as info:
                await page.click(button)
            download = await info.value
            target = tmp_path / download.suggested_filename
            await download.save_as(target)
            exported[button] = target.read_text()
        exported["summary-p50"] = await page.locator("#summary-p50").inner_text()
        exported["rows"] = str(await page.locator("#probe-rows tr").count())
        # Drawn, not only numbers: both charts have ink on them.
        for chart in ("#histogram", "#series"):
            inked = await page.locator(chart).evaluate(
                """(c) => { const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
                            let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; }""")
            assert inked > 100, f"{chart} is blank"

    async with spawned_server("loopback") as (url, _pid):
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/latency") as resp:
                assert resp.status == 200 and "latency tester" in await resp.text()
                assert "default-src 'self'" in resp.headers["Content-Security-Policy"]
            # The call page's latency panel links here and calls its own figure an estimate.
            async with http.get(f"{url}/") as resp:
                index = await resp.text()
                assert 'href="/latency"' in index and "Mouth-to-ear (estimate)" in index
        result = await run_page(url, PageRun(probes=12, interval_ms=300), during=export)

    assert result["mode"] == "loopback" and result["signaling"] == "offer" and result["sample_rate"] == 48000
    assert result["warmup_s"] == 1.5  # the page's default
    values = heard(result)
    # On a loaded machine the path itself loses some probes (the server cuts a standing backlog, the
    # browser's jitter buffer time-stretches over a chirp); the page must count those as lost.
    assert len(values) >= 4, result["summary"]
    assert all(0 < v < 4 * result["interval_ms"] for v in values), values  # 4 probe shapes take turns
    summary = result["summary"]
    assert summary["sent"] == 12 and summary["heard"] == len(values) and summary["lost"] == 12 - len(values)
    assert summary["p50_ms"] == pytest.approx(statistics.median(values), abs=0.01)
    assert summary["max_ms"] == max(values) and summary["min_ms"] == min(values)
    assert summary["p50_ms"] <= summary["p90_ms"] <= summary["p99_ms"] <= summary["max_ms"]
    # getStats context of each heard probe: the receive side was live when it was heard.
    for p in result["probes"]:
        if p["latency_ms"] is not None:
            assert p["packets_received"] > 0 and p["rtt_ms"] is not None and p["jitter_buffer_ms"] is not None, p

    assert json.loads(exported["#export-json"]) == result
    rows = list(csv.DictReader(io.StringIO(exported["#export-csv"])))
    assert [float(r["latency_ms"]) if r["latency_ms"] else None for r in rows] == [
        p["latency_ms"] for p in result["probes"]]
    assert exported["summary-p50"] == f"{summary['p50_ms']} ms" and exported["rows"] == "12"


async def test_a_known_added_delay_is_measured_to_within_2_ms():
    """The self-check delays every second probe 50 ms after the mouth point: neighbours differ by 50 ms.

    The delay line shifts the audio, not the packets, so the packet clock, the server's send clock
    and the browser's jitter buffer carry on unchanged and the whole 50 ms must reach the ear. (A
    delay step on the packets would not do: a jitter buffer absorbs a step and then re-sizes, and a
    new call lands on a new phase of the server's 20 ms and the browser's 10 ms clocks.)
    """
    async with spawned_server("loopback") as (url, _pid):
        result = await run_page(url, PageRun(probes=60, interval_ms=250, check_ms=ADDED_DELAY_MS))
    check = result["self_check"]
    assert check["added_ms"] == ADDED_DELAY_MS and check["triplets"] >= 3, check
    assert abs(check["median_difference_ms"] - ADDED_DELAY_MS) <= 2.0, check
    # The delayed probes are kept apart from the percentiles.
    plain = [p["latency_ms"] for p in result["probes"] if not p["added_delay_ms"] and p["latency_ms"] is not None]
    assert result["summary"]["heard"] == len(plain)


async def test_the_page_measures_through_an_impaired_udp_path():
    """Every packet of the call goes through the relay; each one to the browser is held at least 50 ms."""
    settings = PathSettings(down=Impairment(delay_ms=ADDED_DELAY_MS))
    async with spawned_server("loopback") as (url, _pid):
        result = await measure(url, PageRun(probes=8, interval_ms=300), path=settings)
    assert len(heard(result)) >= 2, result["summary"]
    assert result["page_url"] != url and result["path"]["settings"]["down"]["delay_ms"] == ADDED_DELAY_MS
    (call,) = result["path"]["calls"]
    assert call["up"]["packets"] > 100 and call["down"]["packets"] > 100, call
    assert call["up"]["dropped"] == 0 and call["down"]["dropped"] == 0
    assert call["down"]["delay_ms_min"] >= ADDED_DELAY_MS and call["up"]["delay_ms_min"] >= 0.0
    assert result["path"]["self_test"]["down"]["delay_ms_p50"] >= ADDED_DELAY_MS


async def test_the_plain_aiortc_relay_is_measured_the_same_way():
    """The baseline of the comparison answers the same offer and serves the same page."""
    from lychee_rtc.bench.aiortc_relay import spawned_relay

    async with spawned_relay() as (url, _pid):
        result = await measure(url, PageRun(probes=6, interval_ms=300), path=PathSettings())
    assert result["signaling"] == "offer" and len(heard(result)) >= 2, result["summary"]
    (call,) = result["path"]["calls"]
    assert call["down"]["packets"] > 100


async def test_the_levers_bench_puts_10_ms_packets_on_the_wire_both_ways():
    """A browser sends 10 ms packets when the answer asks for them, and the server sends 10 ms when told."""
    from lychee_rtc.bench.levers import LEVERS, levers_table, measure_levers

    default, both = LEVERS[0], next(lever for lever in LEVERS if lever.name == "10 ms packets both ways")
    rows = await measure_levers(PageRun(probes=4, interval_ms=300), rounds=1, levers=[default, both])
    by_name = {row["lever"]: row for row in rows}
    # The duration between two stats reports over the packets counted in it: a second or two, in
    # which a stall of a busy machine leaves packets unsent, so the bound only tells 10 from 20 ms.
    for name, ms in ((default.name, 20), (both.name, 10)):
        assert by_name[name]["uplink_packet_ms"] == pytest.approx(ms, rel=0.25), by_name[name]
        assert by_name[name]["downlink_packet_ms"] == pytest.approx(ms, rel=0.25), by_name[name]
    for row in rows:
        assert row["calls"] == 1 and row["heard"] >= 2 and row["server_cpu_percent"] > 0, row
    assert both.name in levers_table(rows)


async def test_the_matched_filter_finds_each_probe_at_its_frame():
    """latency-detect.js, as the page loads it, on audio made here: a probe's start to the sample.

    The page finds probes in segments the worklet records; this checks the finder itself with the
    page's own chirps placed at known frames in noise, two of them in one segment, plus a segment of
    noise alone and one holding a chirp the page never sends.
    """
    from playwright.async_api import async_playwright

    script = """async () => {
      const { findProbes } = await import("/static/latency-detect.js");
      const { chirp } = await import("/static/latency.js");
      const shapes = [[400, 3200], [3200, 400], [900, 2200], [2200, 900]].map(([a, b]) => chirp(a, b));
      let seed = 7;
      const noise = (n, level) => Float32Array.from({ length: n }, () => {
        seed = (seed * 1103515245 + 12345) % 2147483648;
        return level * (seed / 1073741824 - 1);
      });
      const place = (audio, sound, at, gain) => { sound.forEach((x, i) => { audio[at + i] += gain * x; }); };
      const two = noise(24000, 0.003);
      place(two, shapes[2], 3001, 0.5);
      place(two, shapes[0], 17401, 0.8);
      const other = noise(6000, 0.003);
      place(other, chirp(5000, 6000), 2000, 0.8);
      const strip = (found) => found.map(({ signature, frame }) => ({ signature, frame }));
      return {
        two: strip(findProbes(two, 1000000, shapes)),
        noise: strip(findProbes(noise(24000, 0.05), 5000, shapes)),
        other: strip(findProbes(other, 0, shapes)),
      };
    }"""
    async with spawned_server("loopback") as (url, _pid):
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS)
            try:
                page = await browser.new_page()
                await page.goto(f"{url}/latency")
                found = await page.evaluate(script)
            finally:
                await browser.close()
    assert found["two"] == [{"signature": 2, "frame": 1003001}, {"signature": 0, "frame": 1017401}], found
    assert found["noise"] == [] and found["other"] == [], found


async def test_server_parameter_measures_another_server():
    """The page comes from an echo server (chirps never come back from it); ?server= points at a loopback one."""
    async with spawned_server("echo") as (page_host, _), spawned_server("loopback") as (target, _):
        result = await run_page(page_host, PageRun(probes=6, interval_ms=300, server=target))
    assert result["server"] == target and len(heard(result)) >= 2, result["summary"]


async def test_stop_ends_the_run_with_what_was_measured():
    async def stop_after_three(page) -> None:
        await wait_until(lambda: page.evaluate("() => (window.latencyTester.progress?.heard ?? 0) >= 3"),
                         timeout=300, what="three probes heard")
        await page.click("#stop")

    async with spawned_server("loopback") as (url, _pid):
        result = await run_page(url, PageRun(probes=400, interval_ms=250), during=stop_after_three)
    assert result["stopped_early"] and 3 <= result["summary"]["sent"] < 400, result["summary"]
    assert result["summary"]["heard"] >= 3


async def test_whip_signaling_measures_the_same_way():
    async with spawned_server("loopback") as (url, _pid):
        result = await run_page(url, PageRun(probes=6, interval_ms=300, signaling="whip", warmup_s=0.5))
    assert result["signaling"] == "whip" and result["warmup_s"] == 0.5
    assert len(heard(result)) >= 2, result["summary"]


async def test_response_latency_is_timed_from_the_end_of_the_utterance():
    """The echo engine answers only after min_silence_ms of silence: no response can be measured earlier."""
    wav = speech_fixture("Hello there. This is a test of the echo engine, one two three.")
    min_silence_ms = load_settings("echo").engine.echo.min_silence_ms
    async with spawned_server("echo") as (url, _pid):
        result = await run_page(url, PageRun(mode="response", probes=2, interval_ms=300, utterance=wav))
    assert result["mode"] == "response" and result["utterance"]["speech_s"] > 1.0
    values = heard(result)
    assert len(values) == 2, result
    assert all(v >= min_silence_ms for v in values), (values, min_silence_ms)


# --- the impaired path itself (no browser) ----------------------------------------------------------

SDP = """v=0\r
o=- 1 2 IN IP4 0.0.0.0\r
s=-\r
t=0 0\r
a=group:BUNDLE 0 1\r
m=audio 9 UDP/TLS/RTP/SAVPF 111\r
c=IN IP4 0.0.0.0\r
a=mid:0\r
a=candidate:1 1 udp 2130706431 10.0.0.5 40000 typ host\r
a=candidate:2 1 udp 2130706431 abc.local 40001 typ host\r
a=candidate:3 1 udp 1694498815 1.2.3.4 40002 typ srflx raddr 10.0.0.5 rport 40000\r
a=end-of-candidates\r
m=application 9 UDP/DTLS/SCTP webrtc-datachannel\r
a=mid:1\r
a=candidate:1 1 udp 2130706431 10.0.0.5 40000 typ host\r
"""


def test_candidates_are_replaced_by_the_relay_in_every_media_section():
    assert host_candidates(SDP) == [("10.0.0.5", 40000), ("abc.local", 40001), ("10.0.0.5", 40000)]
    out = replace_candidates(SDP, "192.168.1.9", 5000)
    assert host_candidates(out) == [("192.168.1.9", 5000), ("192.168.1.9", 5000)]
    assert out.count("a=candidate:") == 2 and "srflx" not in out
    assert out.index("a=candidate:") < out.index("a=end-of-candidates") < out.index("m=application")


def test_packet_fate_is_seeded_and_keeps_the_delay_stream_apart_from_loss():
    lossy = PacketFate(Impairment(delay_ms=10, jitter_ms=40, loss=0.05), seed=7)
    again = PacketFate(Impairment(delay_ms=10, jitter_ms=40, loss=0.05), seed=7)
    a = [lossy() for _ in range(4000)]
    assert a == [again() for _ in range(4000)]
    dropped = sum(x is None for x in a)
    assert 0.04 < dropped / len(a) < 0.06
    assert all(0.010 <= x <= 0.050 for x in a if x is not None)


async def test_the_relay_holds_drops_and_reorders_real_packets_as_set():
    """Datagrams through the relay: the seeded ones are dropped, none arrives before its delay, jitter reorders."""
    settings = PathSettings(up=Impairment(delay_ms=30, jitter_ms=40, loss=0.1), seed=3)
    relay = UdpRelay("127.0.0.1", settings)
    await relay.start()
    loop = asyncio.get_running_loop()
    received: list[tuple[int, float]] = []

    class Sink(asyncio.DatagramProtocol):
        def datagram_received(self, data, addr):
            received.append((int.from_bytes(data[:4], "big"), loop.time()))

    server, _ = await loop.create_datagram_endpoint(Sink, local_addr=("127.0.0.1", 0))
    client, _ = await loop.create_datagram_endpoint(asyncio.DatagramProtocol, local_addr=("127.0.0.1", 0))
    relay.server_addr = server.get_extra_info("sockname")[:2]
    expected = PacketFate(settings.up, seed=settings.seed * 1000)  # the stream relay 0's uplink draws from
    fates = [expected() for _ in range(200)]
    sent_at: dict[int, float] = {}
    try:
        for i in range(200):
            sent_at[i] = loop.time()
            client.sendto(i.to_bytes(4, "big") + bytes(156), relay.client_facing)
            await asyncio.sleep(0.002)
        survivors = {i for i, f in enumerate(fates) if f is not None}
        await wait_until(lambda: len(received) >= len(survivors), timeout=30, what="the held packets")
    finally:
        relay.close()
        server.close()
        client.close()
    assert {i for i, _ in received} == survivors
    assert relay.up.packets == 200 and relay.up.dropped == 200 - len(survivors)
    assert all(t - sent_at[i] >= 0.030 for i, t in received)
    order = [i for i, _ in received]
    assert order != sorted(order), "40 ms of jitter on 2 ms spacing must reorder packets"
    assert relay.report()["up"]["delay_ms_min"] >= 30.0



# --- the page's arithmetic (web/latency-report.js, run in Node: no DOM in it) ------------------------

REPORT_CASES = """
import * as r from "./web/latency-report.js";
const p = (index, latency_ms, added_delay_ms, concealed_samples = 0) => ({index, latency_ms, added_delay_ms,
  concealed_samples, inserted_samples: 0, removed_samples: 0, jitter_buffer_target_ms: 40});
const probes = [
  p(0, 80, 0), p(1, 130.6, 50), p(2, 80.4, 0),  // steady: 50.4 over the neighbours' mean
  p(3, 150, 50), p(4, 100, 0),                   // the path's delay moved between 2 and 4
  p(5, 149.5, 50), p(6, 100, 0, 960),            // concealment between 4 and 6
  p(7, 150, 50), p(8, null, 0),
];
const stats = (o) => new Map(Object.entries(o).map(([id, s]) => [id, {id, ...s}]));
const first = stats({in: {type: "inbound-rtp", kind: "audio", jitterBufferDelay: 4.0, jitterBufferEmittedCount: 100000,
  jitterBufferTargetDelay: 3.0, packetsReceived: 500, packetsLost: 2, concealedSamples: 10, jitter: 0.004}});
const second = stats({in: {type: "inbound-rtp", kind: "audio", jitterBufferDelay: 4.0 + 0.06 * 48, jitterBufferEmittedCount: 100048,
  jitterBufferTargetDelay: 3.0 + 0.05 * 48, packetsReceived: 510, packetsLost: 3, concealedSamples: 10, jitter: 0.004}});
console.log(JSON.stringify({
  percentiles: [50, 90, 99].map((q) => r.percentile([10, 1, 4, 3, 2], q)),
  summary: r.summarize(probes),
  check: r.selfCheck(probes, 50),
  csv: r.toCsv({probes: probes.slice(0, 2)}),
  histogram: r.histogram([80, 80.4, 81, 83.9], 1),
  context: r.probeContext(second, r.inboundCounters(first), 12.34),
}));
"""


def test_the_page_arithmetic():
    node = shutil.which("node")
    if node is None:
        unavailable("Node.js is needed to run the page's pure modules")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([node, "--input-type=module", "-e", REPORT_CASES], cwd=root, capture_output=True,
                         text=True, check=True).stdout
    got = json.loads(out)
    assert got["percentiles"] == pytest.approx([float(np.percentile([10, 1, 4, 3, 2], q)) for q in (50, 90, 99)])
    assert got["summary"]["sent"] == 9 and got["summary"]["heard"] == 8 and got["summary"]["lost"] == 1
    assert got["summary"]["max_ms"] == 150 and got["summary"]["p50_ms"] == pytest.approx(115.3)
    # Only the triplet 0-1-2 is steady; 2-3-4 has a step, 4-5-6 concealment, 6-7-8 a lost probe.
    assert got["check"] == {"added_ms": 50, "triplets": 1, "disturbed_triplets": 2, "median_difference_ms": 50.4,
                            "differences_ms": [50.4]}
    rows = list(csv.DictReader(io.StringIO(got["csv"])))
    assert [r["latency_ms"] for r in rows] == ["80", "130.6"] and rows[1]["added_delay_ms"] == "50"
    assert got["histogram"] == {"start": 80, "binMs": 1, "counts": [2, 1, 0, 1]}
    # Jitter-buffer delay and target over the interval between two reports (60 and 50 ms per sample).
    ctx = got["context"]
    assert ctx["jitter_buffer_ms"] == 60.0 and ctx["jitter_buffer_target_ms"] == 50.0
    assert ctx["rtt_ms"] == 12.3 and ctx["packets_lost"] == 3 and ctx["network_jitter_ms"] == 4.0


async def test_the_aiortc_bench_goes_through_the_same_path():
    """``bench latency --through-path``: the lossy phase drops real packets both ways on the path."""
    from lychee_rtc.bench.latency import measure as measure_aiortc

    async with spawned_server("loopback") as (url, _pid), ImpairedPath(url, PathSettings(seed=5)) as path:
        report = await measure_aiortc(url, probes=4, interval_s=0.4, loss=0.2, jitter_ms=0.0, lossy_s=2.0,
                                      settle_s=0.8, codec=None, seed=5, path=path)
    assert report.phase("clean").found >= 2, report.phases
    (call,) = report.path["calls"]
    assert call["up"]["dropped"] > 0 and call["down"]["dropped"] > 0, call
    losses = [c["settings"]["up"]["loss"] for c in report.path["changes"]]
    assert 0.2 in losses and losses[-1] == 0.0, losses  # lossy phase on, then off again


async def test_the_path_self_test_reports_what_the_path_applies():
    from lychee_rtc.bench.impairment import self_test

    settings = PathSettings(up=Impairment(delay_ms=20, jitter_ms=10, loss=0.05), down=Impairment(delay_ms=50), seed=9)
    report = await self_test(settings, packets=300)
    up, down = report["up"], report["down"]
    fate = PacketFate(settings.up, seed=9 * 1000 + 2 * 16)  # the stream the self-test's relay draws from
    fate()  # the greeting that tells the relay where the client is
    dropped = sum(fate() is None for _ in range(300))
    assert up["received"] == 300 - dropped and down["received"] == 300  # the seeded drops, and only those
    assert up["delay_ms_p50"] >= 20 and down["delay_ms_p50"] >= 50 and down["delay_ms_mean"] >= 50
    assert up["reordered"] > 0 and report["settings"]["down"]["delay_ms"] == 50


async def test_a_rate_limited_path_queues_then_drops():
    """A 64 kbit/s bottleneck offered ten times that: packets leave one transmission time apart, the rest is tail-dropped."""
    from lychee_rtc.bench.impairment import MAX_QUEUE_S, self_test

    report = await self_test(PathSettings(up=Impairment(rate_kbps=64)), packets=300)
    up, down = report["up"], report["down"]
    assert down["received"] == 300 and down["reordered"] == 0  # the other way is not limited
    transmission_ms = 164 * 8 / 64  # 20.5 ms per 164-byte datagram
    # The queue builds up by a transmission time per packet until it holds MAX_QUEUE_S; past that, tail drop.
    assert up["delay_ms_max"] >= min(10 * transmission_ms, 1000 * MAX_QUEUE_S)
    assert 0 < up["received"] < 300 and up["reordered"] == 0
