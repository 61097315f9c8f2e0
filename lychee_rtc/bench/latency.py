"""``lychee-rtc bench latency``: mouth-to-ear delay through the server, measured with chirps.

An aiortc client (the same peer the tests use, with aiortc's own receive path on the downlink, as a
caller built on aiortc would have) sends chirps through a server running the loopback engine and
finds them in what comes back. Mouth = when the frame carrying the chirp's first sample was handed
to the client's WebRTC sender (plus the sample's place in the frame); ear = when the frame carrying
it came out of the client's receiving track (plus its place in the frame). With ``--loss`` the run has three phases: clean, a stretch with emulated uplink loss
(and optional jitter), and the time after it, so a buffer that keeps the delay a loss added shows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from lychee_rtc.bench.client import RATE, LinkImpairment, RtcClient
from lychee_rtc.bench.impairment import ImpairedPath, PathPhases, PathSettings
from lychee_rtc.bench.probes import (
    SIGNATURES,
    arrival_time,
    find_onsets,
    percentile,
    probe_for,
    send_time,
)
from lychee_rtc.bench.server_process import cpu_seconds, spawned_server

MAX_LATENCY_S = 1.5  # a chirp heard later than this (or than its signature's next use) is counted as lost


@dataclass
class PhaseStats:
    name: str
    probes: int
    found: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    latencies_ms: list[float] = field(default_factory=list)


@dataclass
class LatencyReport:
    url: str
    codec: str
    interval_s: float
    loss: float
    jitter_ms: float
    phases: list[PhaseStats]
    server_cpu_percent: float | None = None
    server_counters: dict[str, Any] | None = None
    path: dict[str, Any] | None = None  # --through-path: the impaired path's settings and what it did

    def phase(self, name: str) -> PhaseStats | None:
        return next((p for p in self.phases if p.name == name), None)


def _stats(name: str, latencies: list[float | None]) -> PhaseStats:
    found = [x for x in latencies if x is not None]
    return PhaseStats(name, len(latencies), len(found), percentile(found, 50), percentile(found, 90),
                      percentile(found, 99), [round(x, 2) for x in found])


def analyse(client: RtcClient, starts: list[int], interval_s: float) -> list[float | None]:
    """Latency (ms) of probe k, which started at uplink sample ``starts[k]`` (None if never heard)."""
    chunks = sorted((off, len(pcm), arrival) for off, pcm, arrival in client.received.chunks)
    signal = client.received.signal()
    heard: dict[int, list[float]] = {}
    for sig in range(len(SIGNATURES)):
        times = [arrival_time(onset, chunks) for onset in find_onsets(signal, probe_for(sig))]
        heard[sig] = sorted(t for t in times if t is not None)
    limit = min(MAX_LATENCY_S, 0.95 * len(SIGNATURES) * interval_s)
    out: list[float | None] = []
    for k, start in enumerate(starts):
        mouth = send_time(start, client.mic.send_times, client.mic.frame)
        match = None
        if mouth is not None:
            match = next((t for t in heard[k % len(SIGNATURES)] if mouth <= t <= mouth + limit), None)
        out.append(None if match is None else 1000.0 * (match - mouth))
    return out


def probe_schedule(count: int, spacing: int, lead: int) -> tuple[np.ndarray, list[int]]:
    """Audio with probe k at ``lead + k * spacing``, and those offsets."""
    offsets = [lead + k * spacing for k in range(count)]
    audio = np.zeros(lead + count * spacing, np.float32)
    for k, off in enumerate(offsets):
        probe = probe_for(k)
        audio[off:off + len(probe)] = probe
    return audio, offsets


async def run_probes(client: RtcClient, *, clean: int, lossy_s: float, settle_s: float, after: int,
                     interval_s: float, impairment: LinkImpairment | None) -> dict[str, list[float | None]]:
    spacing = int(interval_s * RATE)
    lossy = int(lossy_s / interval_s) if impairment else 0
    settle = int(settle_s / interval_s) if impairment else 0
    total = clean + lossy + settle + (after if impairment else 0)
    schedule, offsets = probe_schedule(total, spacing, lead=RATE)  # one second of silence first
    base = round(client.mic.feed(schedule) * RATE)
    starts = [base + off for off in offsets]
    # Wait for the mic to reach each phase boundary, then switch the impairment.
    t0 = time.monotonic() - base / RATE if client.mic._t0 is None else client.mic._t0

    async def at_probe(k: int) -> None:
        await asyncio.sleep(max(0.0, t0 + starts[k] / RATE - time.monotonic()))

    saved = (impairment.loss, impairment.jitter_ms) if impairment else (0.0, 0.0)
    if impairment:
        impairment.loss = impairment.jitter_ms = 0.0
        await at_probe(clean)
        impairment.loss, impairment.jitter_ms = saved
        await at_probe(clean + lossy)
        impairment.loss = impairment.jitter_ms = 0.0
    await asyncio.sleep(max(0.0, t0 + starts[-1] / RATE - time.monotonic()) + MAX_LATENCY_S)
    latencies = analyse(client, starts, interval_s)
    phases = {"clean": latencies[:clean]}
    if impairment:
        phases["lossy"] = latencies[clean:clean + lossy]
        phases["after_loss"] = latencies[clean + lossy + settle:]
    return phases


async def measure(url: str, *, probes: int, interval_s: float, loss: float, jitter_ms: float,
                  lossy_s: float, settle_s: float, codec: str | None, seed: int,
                  client_jitter_buffer: str = "aiortc", server_pid: int | None = None,
                  path: ImpairedPath | None = None) -> LatencyReport:
    client = RtcClient(path.url if path else url, codec=codec, jitter_buffer=client_jitter_buffer)
    await client.connect()
    impairment = None
    if path is not None:  # real packets impaired on their way, both ways, instead of inside the client
        impairment = PathPhases(path, loss, jitter_ms) if loss or jitter_ms else None
    elif loss or jitter_ms:
        impairment = LinkImpairment(loss, jitter_ms, seed)
        client.impair_uplink(impairment)
    cpu0, wall0 = (cpu_seconds(server_pid), time.monotonic()) if server_pid else (None, None)
    try:
        phases = await run_probes(client, clean=probes, lossy_s=lossy_s, settle_s=settle_s, after=probes,
                                  interval_s=interval_s, impairment=impairment)
        cpu = None
        if server_pid is not None:
            cpu = 100.0 * (cpu_seconds(server_pid) - cpu0) / (time.monotonic() - wall0)
        counters = None
        import aiohttp

        async with aiohttp.ClientSession() as http:
            async with http.get(f"{url}/v1/sessions/{client.session_id}", headers=client.auth_headers) as resp:
                if resp.status == 200:
                    counters = (await resp.json())["counters"]
    finally:
        await client.close()
    return LatencyReport(url, codec or "opus", interval_s, loss, jitter_ms,
                         [_stats(name, values) for name, values in phases.items()], cpu, counters,
                         path.report() if path else None)


def format_report(report: LatencyReport) -> str:
    where = "both ways on the impaired path" if report.path else "uplink, in the client"
    lines = [(f"mouth-to-ear through {report.url} ({report.codec}; loss {report.loss:.1%}, "
              f"jitter {report.jitter_ms:.0f} ms, {where})")]
    lines.append(f"{'phase':<12}{'found':>10}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}")
    for p in report.phases:
        fmt = lambda v: f"{v:10.1f}" if v is not None else f"{'-':>10}"
        lines.append(f"{p.name:<12}{p.found:>5}/{p.probes:<4}{fmt(p.p50_ms)}{fmt(p.p90_ms)}{fmt(p.p99_ms)}")
    if report.server_cpu_percent is not None:
        lines.append(f"server CPU: {report.server_cpu_percent:.1f} % of one core (one session)")
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> int:
    kwargs = dict(probes=args.probes, interval_s=args.interval, loss=args.loss, jitter_ms=args.jitter_ms,
                  lossy_s=args.loss_seconds, settle_s=args.settle_seconds, codec=args.codec, seed=args.seed,
                  client_jitter_buffer=args.client_jitter_buffer)
    async with contextlib.AsyncExitStack() as stack:
        if args.url:
            url, pid = args.url, None
        else:
            env = {"LYCHEE_RTC_RTC__JITTER_BUFFER": args.server_jitter_buffer}
            url, pid = await stack.enter_async_context(spawned_server(args.config, env))
        path = None
        if args.through_path:
            path = await stack.enter_async_context(ImpairedPath(url, PathSettings(seed=args.seed)))
        report = await measure(url, server_pid=pid, path=path, **kwargs)
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(report), f, indent=2)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("latency", help="mouth-to-ear latency with chirps against the loopback engine",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start one with --config)")
    p.add_argument("--config", default="loopback",
                   help="profile for the spawned server: a file or a shipped profile name (default: loopback)")
    p.add_argument("--server-jitter-buffer", choices=["lowlatency", "aiortc"], default="lowlatency",
                   help="inbound jitter buffer of the spawned server (to compare with aiortc's)")
    p.add_argument("--client-jitter-buffer", choices=["aiortc", "lowlatency"], default="aiortc",
                   help="the measuring client's receive path: aiortc's stock buffer (default, what an aiortc "
                        "caller has) or ours, to see the server's own share")
    p.add_argument("--probes", type=int, default=40, help="probes per phase (default 40)")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between probes")
    p.add_argument("--loss", type=float, default=0.0, help="uplink packet loss during the lossy phase (0.02 = 2 %%)")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="uplink jitter (uniform delay 0..N ms) when lossy")
    p.add_argument("--loss-seconds", type=float, default=10.0, help="length of the lossy phase")
    p.add_argument("--settle-seconds", type=float, default=3.0, help="probes ignored after the lossy phase")
    p.add_argument("--through-path", action="store_true",
                   help="impair real packets on a user-space UDP path (both ways, seeded) instead of dropping "
                        "them inside the client; the result's 'path' says what the path did")
    p.add_argument("--codec", choices=["opus", "PCMU", "PCMA"], default=None)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="also write the report as JSON here")
    p.set_defaults(func=_main)
