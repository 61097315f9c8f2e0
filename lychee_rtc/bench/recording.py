"""``lychee-rtc bench recording``: CPU and disk per recorded call-minute.

Each simulated call feeds one recorder what a real call does every 20 ms (caller audio at 16 kHz
as it enters the session, an agent frame at 48 kHz as it leaves, an event now and then) on a
simulated clock, as fast as the machine allows. The encoding, placement and file writes are the
real ones (``media.recording``); what a call-minute costs is the writer threads' own CPU time
(``time.thread_time``) divided by the call-minutes recorded, plus the event loop's share, the time
spent in the taps.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from lychee_rtc.config import RecordingSettings
from lychee_rtc.media.recording.store import RecordingStore

STEP_S = 0.02


class SimulatedClock:
    """Monotonic seconds that the bench advances (read by the writer threads too)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class RecordingCost:
    calls: int
    minutes: float
    cpu_s_per_call_minute: float  # the writer thread
    tap_ms_per_call_minute: float  # on the event loop
    bytes_per_call_minute: float
    dropped_items: int
    late_samples: int  # must be 0: the simulated clock ran ahead of a writer


def speech_like(rate: int, seconds: float, seed: int) -> np.ndarray:
    """Noise shaped like syllables (4 per second) with pauses: what Opus spends its bits on."""
    rng = np.random.default_rng(seed)
    n = int(rate * seconds)
    t = np.arange(n) / rate
    noise = np.cumsum(rng.standard_normal(n)).astype(np.float32)
    noise -= np.convolve(noise, np.ones(64) / 64, mode="same")  # keep the band, drop the drift
    syllables = np.sin(2 * np.pi * 4 * t) ** 2 * (np.sin(2 * np.pi * 0.2 * t + seed) > -0.3)
    out = noise * syllables
    return (0.3 * out / (np.max(np.abs(out)) + 1e-9)).astype(np.float32)


def bench(calls: int, minutes: float, bitrate: int, directory: Path) -> RecordingCost:
    clock = SimulatedClock()
    store = RecordingStore(RecordingSettings(directory=directory, bitrate=bitrate), clock=clock)
    recorders = [store.open(f"sess_bench{i}", None, {"transport": "bench"}) for i in range(calls)]
    caller = speech_like(16000, 10.0, 1)
    agent = speech_like(48000, 10.0, 2)
    steps = int(minutes * 60 / STEP_S)
    taps = 0.0
    clock.now += STEP_S  # the first caller chunk ends a step after t = 0, so it starts at 0
    for k in range(steps):
        c0 = (k * 320) % (len(caller) - 320)
        a0 = (k * 960) % (len(agent) - 960)
        started = time.perf_counter()
        for r in recorders:
            r.caller_audio(caller[c0:c0 + 320], 16000)
            r.agent_sent(agent[a0:a0 + 960], 48000, clock.now)
            if k % 50 == 0:
                r.event({"type": "turn.state", "seq": k, "state": "listening"})
        taps += time.perf_counter() - started
        clock.now += STEP_S
        # A live call is paced by real time; here the writers set the pace: the simulated clock
        # (which the writers write out by) must not run ahead of what they have taken in.
        while any(r.writer.queue.qsize() > 8 for r in recorders):
            time.sleep(0.001)
    for r in recorders:
        r.close("bench_done")
    for r in recorders:
        r.writer.join()
    cpu = sum(r.state.counters.cpu_s for r in recorders)
    call_minutes = calls * minutes
    size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
    return RecordingCost(calls, minutes, cpu / call_minutes, 1000.0 * taps / call_minutes, size / call_minutes,
                         sum(r.state.counters.items_dropped for r in recorders),
                         sum(r.state.counters.late_samples for r in recorders))


def format_table(rows: list[RecordingCost], bitrate: int) -> str:
    lines = [f"recording at {bitrate // 1000} kbit/s (both channels), simulated 20 ms steps",
             "calls  call-min  writer CPU s/call-min  CPU %/call  loop taps ms/call-min  KiB/call-min  dropped  late"]
    for r in rows:
        lines.append(f"{r.calls:5d}  {r.calls * r.minutes:8.1f}  {r.cpu_s_per_call_minute:21.3f}  "
                     f"{100 * r.cpu_s_per_call_minute / 60:10.2f}  {r.tap_ms_per_call_minute:21.1f}  "
                     f"{r.bytes_per_call_minute / 1024:12.0f}  {r.dropped_items:7d}  {r.late_samples:4d}")
    return "\n".join(lines)


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("recording", help="CPU and disk per recorded call-minute",
                             description="Records simulated calls (both channels and a sidecar) as fast as "
                                         "the machine allows; reports CPU and bytes per call-minute.")
    p.add_argument("--minutes", type=float, default=2.0, help="call-minutes per simulated call (default 2)")
    p.add_argument("--calls", default="1,4", help="comma-separated concurrent recordings (default 1,4)")
    p.add_argument("--bitrate", type=int, default=RecordingSettings().bitrate, help="bits per second, both channels")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = []
    for calls in [int(x) for x in str(args.calls).split(",") if x]:
        with tempfile.TemporaryDirectory(prefix="lychee-rec-bench-") as tmp:
            rows.append(bench(calls, args.minutes, args.bitrate, Path(tmp)))
    print(format_table(rows, args.bitrate))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lychee-rtc bench")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(["recording", *(argv or [])])
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
