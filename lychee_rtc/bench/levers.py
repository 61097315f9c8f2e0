"""``lychee-rtc bench levers``: what each latency lever does to mouth-to-ear in a browser.

Each lever is a server of its own (the loopback profile with one change, through the
``LYCHEE_RTC_*`` environment) or a page setting, and the plain aiortc relay runs beside them for
comparison. Calls go round-robin, one per lever per round, so a change in the machine's load
falls on every lever alike. Each call lands on a new phase of the browser's and the server's
packet clocks, which alone moves one call's figure by up to about a packet, so a lever is judged
by the median over its calls of each call's p50, not by one call.

Per lever the summary holds the calls' p50s, Chromium's jitter-buffer delay and target, the packet
time and RTP bit rate each way (the page's ``transport``) and the server's CPU per second of call
(``/proc/<pid>/stat`` of the spawned server around each call; Linux only).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import statistics
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lychee_rtc.bench.browser import CHROMIUM, PageRun, measure
from lychee_rtc.bench.server_process import spawned_server

PTIME_10 = {"LYCHEE_RTC_RTC__RECEIVE_PTIME_MS": "10"}
SEND_10 = {"LYCHEE_RTC_RTC__SEND_FRAME_MS": "10"}
WINDOW_10 = {"LYCHEE_RTC_ENGINE__ECHO__LOOPBACK_WINDOW_MS": "10"}
LOWDELAY = {"LYCHEE_RTC_RTC__OPUS_APPLICATION": "lowdelay"}
STEADY = {"LYCHEE_RTC_RTC__PASSTHROUGH_PACING": "steady"}


@dataclass(frozen=True)
class Lever:
    name: str
    env: dict[str, str] = field(default_factory=dict)  # the server's profile changes
    jitter_buffer_target_ms: float | None = None  # the page's receiver hint
    relay: bool = False  # the plain aiortc relay instead of a lychee-rtc server


LEVERS = [
    Lever("20 ms packets both ways (the default)"),
    Lever("server sends 10 ms packets", SEND_10),
    Lever("browser sends 10 ms packets (a=ptime:10)", PTIME_10),
    Lever("10 ms packets both ways", {**SEND_10, **PTIME_10}),
    Lever("10 ms both ways, 10 ms loopback window", {**SEND_10, **PTIME_10, **WINDOW_10}),
    Lever("Opus lowdelay (CELT only) on what the server sends", LOWDELAY),
    Lever("10 ms both ways, 10 ms loopback window, Opus lowdelay", {**SEND_10, **PTIME_10, **WINDOW_10, **LOWDELAY}),
    Lever("steady send point (20 ms packets)", STEADY),
    Lever("10 ms both ways, 10 ms loopback window, Opus lowdelay, steady send point",
          {**SEND_10, **PTIME_10, **WINDOW_10, **LOWDELAY, **STEADY}),
    Lever("10 ms both ways, sent on the server's clock (no lead)", {**SEND_10, **PTIME_10,
                                                                   "LYCHEE_RTC_RTC__PASSTHROUGH_LEAD_MS": "0"}),
    Lever("20 ms, sent on the server's clock (no lead)", {"LYCHEE_RTC_RTC__PASSTHROUGH_LEAD_MS": "0"}),
    Lever("jitterBufferTarget 0 on the page", jitter_buffer_target_ms=0.0),
    Lever("plain aiortc relay", relay=True),
]


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU time of process ``pid`` so far (None where /proc has no such file)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 1) if values else None


def summarize_lever(lever: Lever, calls: list[dict]) -> dict[str, Any]:
    p50s = [c["summary"]["p50_ms"] for c in calls if c["summary"]["p50_ms"] is not None]
    heard = [p for c in calls for p in c["probes"] if p["latency_ms"] is not None]
    transports = [c.get("transport") or {} for c in calls]

    def way(direction: str, key: str) -> float | None:
        return _median([(t.get(direction) or {}).get(key) for t in transports])

    return {
        "lever": lever.name,
        "calls": len(calls),
        "call_p50s_ms": p50s,
        "median_p50_ms": _median(p50s),
        "best_p50_ms": min(p50s) if p50s else None,
        "worst_p50_ms": max(p50s) if p50s else None,
        "heard": sum(c["summary"]["heard"] for c in calls),
        "sent": sum(c["summary"]["sent"] for c in calls),
        "jitter_buffer_ms": _median([p["jitter_buffer_ms"] for p in heard]),
        "jitter_buffer_target_ms": _median([p["jitter_buffer_target_ms"] for p in heard]),
        "uplink_packet_ms": way("sent", "packet_ms"),
        "downlink_packet_ms": way("received", "packet_ms"),
        "uplink_rtp_kbps": way("sent", "rtp_kbps"),
        "downlink_rtp_kbps": way("received", "rtp_kbps"),
        "server_cpu_percent": _median([c.get("server_cpu_percent") for c in calls]),
    }


async def measure_levers(run: PageRun, rounds: int, *, chromium: str = CHROMIUM,
                         levers: list[Lever] = LEVERS) -> list[dict[str, Any]]:
    from lychee_rtc.bench.aiortc_relay import spawned_relay

    calls: dict[str, list[dict]] = {lever.name: [] for lever in levers}
    async with AsyncExitStack() as stack:
        servers: dict[str, tuple[str, int]] = {}
        for lever in levers:
            spawn = spawned_relay() if lever.relay else spawned_server("loopback", env=lever.env)
            servers[lever.name] = await stack.enter_async_context(spawn)
        for _ in range(rounds):
            for lever in levers:
                url, pid = servers[lever.name]
                before = cpu_seconds(pid)
                started = os.times().elapsed
                result = await measure(url, replace(run, jitter_buffer_target_ms=lever.jitter_buffer_target_ms),
                                       chromium=chromium)
                after = cpu_seconds(pid)
                if before is not None and after is not None:
                    result["server_cpu_percent"] = round(100 * (after - before) / (os.times().elapsed - started), 1)
                calls[lever.name].append(result)
    return [summarize_lever(lever, calls[lever.name]) for lever in levers]


def levers_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| lever | median of call p50s (ms) | best / worst call p50 | heard | jitter buffer / target (ms) "
             "| packet ms up / down | RTP kbit/s up / down | server CPU % |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['lever']} | {r['median_p50_ms']} | {r['best_p50_ms']} / {r['worst_p50_ms']} "
                     f"| {r['heard']}/{r['sent']} | {r['jitter_buffer_ms']} / {r['jitter_buffer_target_ms']} "
                     f"| {r['uplink_packet_ms']} / {r['downlink_packet_ms']} "
                     f"| {r['uplink_rtp_kbps']} / {r['downlink_rtp_kbps']} | {r['server_cpu_percent']} |")
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> int:
    run = PageRun(probes=args.probes, interval_ms=args.interval_ms)
    levers = [lever for lever in LEVERS if not args.only or any(o.lower() in lever.name.lower() for o in args.only)]
    if not levers:
        print(f"no lever matches {args.only}; the levers are: " + "; ".join(lever.name for lever in LEVERS),
              file=sys.stderr)
        return 2
    rows = await measure_levers(run, args.rounds, chromium=args.chromium, levers=levers)
    table = levers_table(rows)
    text = json.dumps({"levers": rows, "rounds": args.rounds, "probes_per_call": run.probes,
                       "interval_ms": run.interval_ms, "table": table}, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(table, file=sys.stderr)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("levers", help="each latency lever against the default and the plain aiortc relay, "
                                      "in headless Chromium; prints a table",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="calls per lever, round-robin (default 6)")
    p.add_argument("--probes", type=int, default=12, help="probes per call (default 12)")
    p.add_argument("--interval-ms", type=float, default=300.0, help="between probes (default 300)")
    p.add_argument("--chromium", default=CHROMIUM, help=f"the Chromium executable (default {CHROMIUM})")
    p.add_argument("--only", action="append", default=[], metavar="TEXT",
                   help="measure only the levers whose name contains TEXT (repeatable; case-insensitive)")
    p.add_argument("--json", help="also write the result here")
    p.set_defaults(func=_main)
