"""``lychee-rtc bench load``: N concurrent calls, stepped up until the latency budget breaks.

Each step opens N aiortc calls against the server (by default a spawned loopback server), sends a
chirp every ``--interval`` seconds on each, and reports mouth-to-ear percentiles over all probes,
the server's own counters (window underruns, late uplink samples, windows dropped for overload,
playout underruns), client-side packet loss, and the server's CPU use. The answer is the largest N
whose p90 stays within ``--budget-ms`` with no probe lost.

The clients share one process and its cores with the server on a small machine, so at high N the
client side saturates too; the report says how much CPU the server itself used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass

import aiohttp

from lychee_rtc.bench.client import RATE, RtcClient
from lychee_rtc.bench.latency import analyse, probe_schedule
from lychee_rtc.bench.probes import percentile
from lychee_rtc.bench.server_process import cpu_seconds, spawned_server

COUNTERS = ("window_underruns", "window_late_samples", "window_gap_samples", "engine_windows_dropped",
            "playout_underrun_samples", "inbound_gaps")


@dataclass
class LoadStep:
    sessions: int
    probes: int
    found: int
    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    server_cpu_percent: float | None
    server_cpu_per_session: float | None
    counters: dict[str, int]
    within_budget: bool


async def _session_counters(url: str, session_ids: list[str]) -> dict[str, int]:
    totals = {k: 0 for k in COUNTERS}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/sessions") as resp:
            body = await resp.json()
    for s in body["sessions"]:
        if s["session_id"] in session_ids:
            for k in COUNTERS:
                totals[k] += int(s["counters"].get(k, 0))
    return totals


async def run_step(url: str, n: int, duration_s: float, interval_s: float, budget_ms: float,
                   server_pid: int | None) -> LoadStep:
    clients = [RtcClient(url) for _ in range(n)]
    try:
        await asyncio.gather(*(c.connect() for c in clients))
        spacing = int(interval_s * RATE)
        count = max(1, int(duration_s / interval_s))
        starts: list[list[int]] = []
        for i, c in enumerate(clients):
            # Stagger the sessions' probes so they do not all hit the same instant.
            schedule, offsets = probe_schedule(count, spacing, lead=RATE + int(i * spacing / n))
            base = round(c.mic.feed(schedule) * RATE)
            starts.append([base + off for off in offsets])
        cpu0, wall0 = (cpu_seconds(server_pid), time.monotonic()) if server_pid else (None, None)
        await asyncio.sleep(1.0 + count * interval_s + 1.5)
        cpu = None
        if server_pid is not None:
            cpu = 100.0 * (cpu_seconds(server_pid) - cpu0) / (time.monotonic() - wall0)
        counters = await _session_counters(url, [c.session_id for c in clients])
        latencies = [x for c, s in zip(clients, starts) for x in analyse(c, s, interval_s)]
    finally:
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)
    found = [x for x in latencies if x is not None]
    p90 = percentile(found, 90)
    ok = len(found) == len(latencies) and p90 is not None and p90 <= budget_ms
    return LoadStep(n, len(latencies), len(found), percentile(found, 50), p90, percentile(found, 99), cpu,
                    None if cpu is None else cpu / n, counters, ok)


async def measure(url: str, steps: list[int], duration_s: float, interval_s: float, budget_ms: float,
                  server_pid: int | None = None) -> list[LoadStep]:
    results = []
    for n in steps:
        step = await run_step(url, n, duration_s, interval_s, budget_ms, server_pid)
        results.append(step)
        print(format_step(step), flush=True)
        if not step.within_budget:
            break
        await asyncio.sleep(1.0)  # let the server release the slots
    return results


def format_step(s: LoadStep) -> str:
    fmt = lambda v: f"{v:7.1f}" if v is not None else f"{'-':>7}"
    cpu = "" if s.server_cpu_percent is None else f" cpu {s.server_cpu_percent:5.1f}% ({s.server_cpu_per_session:.1f}%/session)"
    return (f"N={s.sessions:<3} probes {s.found}/{s.probes} p50 {fmt(s.p50_ms)} p90 {fmt(s.p90_ms)} "
            f"p99 {fmt(s.p99_ms)} ms{cpu} underruns {s.counters['window_underruns']} "
            f"overload drops {s.counters['engine_windows_dropped']} playout underrun "
            f"{s.counters['playout_underrun_samples']} uplink gaps {s.counters['inbound_gaps']} "
            f"{'ok' if s.within_budget else 'OVER BUDGET'}")


async def _main(args: argparse.Namespace) -> int:
    steps = [int(x) for x in args.sessions.split(",")]
    if args.url:
        results = await measure(args.url, steps, args.duration, args.interval, args.budget_ms)
    else:
        env = {"LYCHEE_RTC_SESSION__MAX_SESSIONS": str(max(steps))}
        async with spawned_server(args.config, env) as (url, pid):
            results = await measure(url, steps, args.duration, args.interval, args.budget_ms, pid)
    good = [s.sessions for s in results if s.within_budget]
    print(f"largest N within p90 <= {args.budget_ms:.0f} ms: {max(good) if good else 'none'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(s) for s in results], f, indent=2)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("load", help="N concurrent calls; the largest N within a latency budget",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start one with --config)")
    p.add_argument("--config", default="loopback",
                   help="profile for the spawned server: a file or a shipped profile name (default: loopback)")
    p.add_argument("--sessions", default="1,2,4,8,12,16", help="comma-separated steps of N")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of probing per step")
    p.add_argument("--interval", type=float, default=0.5, help="seconds between probes per session")
    p.add_argument("--budget-ms", type=float, default=200.0, help="p90 mouth-to-ear budget")
    p.add_argument("--json", help="also write the steps as JSON here")
    p.set_defaults(func=_main)
