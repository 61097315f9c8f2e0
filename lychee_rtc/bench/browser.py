"""``lychee-rtc bench browser``: the latency tester page (``/latency``) in headless Chromium.

The same page a tester opens by hand runs in the system Chromium (driven by Playwright, with a fresh
profile) and its result is printed as the page exports it (JSON), so latency can go into CI. Mode
``loopback`` measures mouth-to-ear of the media path against the loopback profile; mode ``response``
plays a recorded utterance into the call and measures from its end to the first answer audio.

With ``--uplink-delay-ms``/``--downlink-delay-ms``/``--jitter-ms``/``--loss`` the browser reaches
the server through an impaired UDP path (lychee_rtc.bench.impairment): real packets held, jittered
and dropped on their way; its settings and counters are written into the result as ``path``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from lychee_rtc.bench.impairment import ImpairedPath, PathSettings, self_test
from lychee_rtc.bench.server_process import spawned_server

if TYPE_CHECKING:
    from playwright.async_api import Page

CHROMIUM = "/usr/bin/chromium"
# A quiet, reproducible browser: no network chatter of its own, no GPU, a fresh profile per run.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class PageFailed(RuntimeError):
    """The page reported an error, or a script error happened on it."""


@dataclass(frozen=True)
class PageRun:
    mode: str = "loopback"  # or "response"
    probes: int = 50
    interval_ms: float = 500.0
    signaling: str = "auto"  # "offer", "whip"
    jitter_buffer_target_ms: float | None = None
    utterance: Path | None = None  # response mode: a WAV file the page plays into the call
    threshold: float = 0.01  # response mode: RMS (5 ms) that counts as answer audio
    token: str = ""
    server: str = ""  # ?server=: another server than the one serving the page
    check_ms: float = 0.0  # self-check: every second probe delayed this much after the mouth point
    warmup_s: float | None = None  # connected → first probe (the page's default when None)

    def query(self) -> str:
        q: dict[str, Any] = {"mode": self.mode, "probes": self.probes, "interval_ms": self.interval_ms,
                             "signaling": self.signaling, "threshold": self.threshold}
        if self.jitter_buffer_target_ms is not None:
            q["jitter_buffer_target_ms"] = self.jitter_buffer_target_ms
        if self.server:
            q["server"] = self.server
        if self.check_ms:
            q["check_ms"] = self.check_ms
        if self.warmup_s is not None:
            q["warmup_s"] = self.warmup_s
        return urlencode(q)


async def run_page(page_url: str, run: PageRun, *, chromium: str = CHROMIUM, timeout_s: float | None = None,
                   during: Callable[[Page], Awaitable[None]] | None = None) -> dict:
    """Opens ``page_url``/latency in headless Chromium, runs it, returns the page's result JSON.

    ``during(page)``, if given, runs once the measurement has started (to change the path mid-run);
    it may read ``window.latencyTester.progress``.
    """
    if not os.access(chromium, os.X_OK):
        raise FileNotFoundError(f"{chromium} is not an executable Chromium (Debian package 'chromium')")
    if run.mode == "response" and run.utterance is None:
        raise ValueError("response mode needs --utterance (a recorded WAV to play into the call)")
    from playwright.async_api import async_playwright  # heavy; only this bench needs it

    if timeout_s is None:  # the run itself plus generous room for connecting and, per trial, answering
        per_probe = run.interval_ms / 1000 + (30 if run.mode == "response" else 0)
        timeout_s = 120 + run.probes * per_probe
    with tempfile.TemporaryDirectory(prefix="lychee-rtc-chromium-") as profile:
        async with async_playwright() as p:
            context = await p.chromium.launch_persistent_context(
                profile, executable_path=chromium, headless=True, args=CHROMIUM_FLAGS, timeout=60_000)
            try:
                page = await context.new_page()
                errors: list[str] = []
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                await page.goto(f"{page_url.rstrip('/')}/latency?{run.query()}")
                await page.wait_for_function("() => window.latencyTester !== undefined", timeout=30_000)
                if run.utterance is not None:
                    await page.set_input_files("#utterance-file", str(run.utterance))
                if run.token:
                    await page.fill("#token", run.token)
                await page.click("#start")  # a user gesture: the page's AudioContext may start
                if during is not None:
                    await during(page)
                await page.wait_for_function(
                    """() => ["done", "error"].includes(document.getElementById("state").dataset.state)
                             && !document.getElementById("start").disabled""",
                    timeout=timeout_s * 1000, polling=200)
                result, error = await page.evaluate("() => [window.latencyTester.result, window.latencyTester.error]")
                if error or errors or result is None:
                    raise PageFailed(error or "; ".join(errors) or "the page produced no result")
                return result
            finally:
                await context.close()


async def measure(url: str, run: PageRun, *, path: PathSettings | None = None, chromium: str = CHROMIUM) -> dict:
    """One run of the page against the server at ``url``, directly or through an impaired path."""
    async with AsyncExitStack() as stack:
        page_url = url
        relay = None
        check = None
        if path is not None:
            check = await self_test(path)  # what this path does to packets, before the call uses it
            relay = await stack.enter_async_context(ImpairedPath(url, path))
            page_url = relay.url
        result = await run_page(page_url, run, chromium=chromium)
        result["page_url"] = page_url
        if relay is not None:
            result["path"] = {**relay.report(), "self_test": check}
        return result


# The impairment table of docs/benchmarks.md: each condition applies both ways, seeded.
CONDITIONS: dict[str, dict[str, float]] = {
    "clean": {},
    "2 % loss": {"loss": 0.02},
    "5 % loss": {"loss": 0.05},
    "40 ms jitter": {"jitter_ms": 40.0},
}


async def compare(run: PageRun, *, seed: int = 1, chromium: str = CHROMIUM) -> list[dict]:
    """Every condition against lychee-rtc (loopback profile) and the plain aiortc relay, in one run.

    Both go through the impaired path in every row, the clean one included, so the relay's own
    cost is the same in each comparison.
    """
    from lychee_rtc.bench.aiortc_relay import spawned_relay

    rows = []
    async with spawned_server("loopback") as (lychee_url, _), spawned_relay() as (relay_url, _):
        for condition, impairment in CONDITIONS.items():
            for peer, url in (("lychee-rtc", lychee_url), ("aiortc relay", relay_url)):
                settings = PathSettings.symmetric(seed=seed, **impairment)
                result = await measure(url, run, path=settings, chromium=chromium)
                rows.append({"condition": condition, "peer": peer, "summary": result["summary"],
                             "path": result["path"], "user_agent": result["user_agent"]})
    return rows


def comparison_table(rows: list[dict]) -> str:
    lines = ["| condition | peer | p50 / p90 / p99 / max (ms) | heard |", "|---|---|---|---|"]
    for row in rows:
        s = row["summary"]
        lines.append(f"| {row['condition']} | {row['peer']} | {s['p50_ms']} / {s['p90_ms']} / {s['p99_ms']} / "
                     f"{s['max_ms']} | {s['heard']}/{s['sent']} |")
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> int:
    run = PageRun(mode=args.mode, probes=args.probes, interval_ms=args.interval_ms, signaling=args.signaling,
                  jitter_buffer_target_ms=args.jitter_buffer_target_ms,
                  utterance=Path(args.utterance) if args.utterance else None, threshold=args.threshold,
                  token=args.token or "", check_ms=args.self_check_ms, warmup_s=args.warmup_s)
    if args.compare:
        rows = await compare(run, seed=args.seed, chromium=args.chromium)
        table = comparison_table(rows)
        text = json.dumps({"runs": rows, "table": table}, indent=2)
        print(text)
        if args.json:
            Path(args.json).write_text(text + "\n")
        print(table, file=sys.stderr)
        return 0
    path = None
    if any((args.uplink_delay_ms, args.downlink_delay_ms, args.jitter_ms, args.loss, args.rate_kbps, args.through_path)):
        path = PathSettings.symmetric(delay_up_ms=args.uplink_delay_ms, delay_down_ms=args.downlink_delay_ms,
                                      jitter_ms=args.jitter_ms, loss=args.loss, rate_kbps=args.rate_kbps,
                                      seed=args.seed)
    if args.url:
        result = await measure(args.url, run, path=path, chromium=args.chromium)
    elif args.peer == "aiortc":
        from lychee_rtc.bench.aiortc_relay import spawned_relay

        async with spawned_relay() as (url, _pid):
            result = await measure(url, run, path=path, chromium=args.chromium)
        result["peer"] = "aiortc relay"
    else:
        config = args.config or ("loopback" if args.mode == "loopback" else "echo")
        async with spawned_server(config) as (url, _pid):
            result = await measure(url, run, path=path, chromium=args.chromium)
        result["server_config"] = config
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    s = result["summary"]
    print(f"{result['mode']}: p50 {s['p50_ms']} ms, p90 {s['p90_ms']} ms, p99 {s['p99_ms']} ms, max {s['max_ms']} ms "
          f"({s['heard']}/{s['sent']} heard)", file=sys.stderr)
    return 0


def main_sync(argv: list[str]) -> int:  # for tests and scripts that do not go through the CLI
    parser = argparse.ArgumentParser(prog="lychee-rtc bench")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(["browser", *argv])
    return asyncio.run(args.func(args))


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("browser", help="the /latency tester page in headless Chromium; prints its JSON",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start one with --config)")
    p.add_argument("--config", help="profile for the spawned server (default: loopback, or echo in response mode)")
    p.add_argument("--peer", choices=["lychee", "aiortc"], default="lychee",
                   help="what to spawn: a lychee-rtc server, or the plain aiortc relay (the baseline)")
    p.add_argument("--compare", action="store_true",
                   help="clean, 2 %% and 5 %% loss and 40 ms jitter, for lychee-rtc and the plain aiortc relay, "
                        "in one run through the impaired path; prints the runs and a table")
    p.add_argument("--mode", choices=["loopback", "response"], default="loopback")
    p.add_argument("--probes", type=int, default=50, help="probes (response mode: utterances) (default 50)")
    p.add_argument("--interval-ms", type=float, default=500.0, help="between probes (default 500)")
    p.add_argument("--warmup-s", type=float, default=None,
                   help="connected → first probe, while the jitter buffer settles (default: the page's, 1.5 s)")
    p.add_argument("--signaling", choices=["auto", "offer", "whip"], default="auto")
    p.add_argument("--jitter-buffer-target-ms", type=float, default=None,
                   help="RTCRtpReceiver.jitterBufferTarget on the page's incoming audio (default: the browser's)")
    p.add_argument("--utterance", help="response mode: a WAV file played into the call")
    p.add_argument("--threshold", type=float, default=0.01, help="response mode: answer RMS threshold (default 0.01)")
    p.add_argument("--token", help="the server key, if the server requires one")
    p.add_argument("--self-check-ms", type=float, default=0.0,
                   help="loopback mode: delay every second probe's audio by this much after the mouth point; "
                        "the result's self_check shows the measured difference (default off)")
    p.add_argument("--through-path", action="store_true",
                   help="go through the user-space UDP path even with no impairment (a baseline for one)")
    p.add_argument("--uplink-delay-ms", type=float, default=0.0, help="held on the way to the server")
    p.add_argument("--downlink-delay-ms", type=float, default=0.0, help="held on the way to the browser")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="extra delay, uniform 0..N ms per packet, each way")
    p.add_argument("--loss", type=float, default=0.0, help="packets dropped each way (0.02 = 2 %%)")
    p.add_argument("--rate-kbps", type=float, default=0.0,
                   help="a bottleneck each way: packets queue to leave at this rate (tail drop past 0.5 s)")
    p.add_argument("--seed", type=int, default=1, help="the impairment's random seed")
    p.add_argument("--chromium", default=CHROMIUM, help=f"the Chromium executable (default {CHROMIUM})")
    p.add_argument("--json", help="also write the result here")
    p.set_defaults(func=_main)
