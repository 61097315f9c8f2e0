"""``lychee-rtc bench long-call``: long conversations on the Lychee-FD engine, faster than real time.

The tiny random Lychee-FD (and, unless ``--no-vocoder``, the tiny Token2Wav) runs on the CPU behind
the real engine scheduler, with a small slot (``--max-seq``, default 512 positions) and a small
rolling window (``--window`` 200 kept, ``--step`` 100 dropped per slide; the re-prefill budget
derived as in the profiles unless ``--budget``), so a call slides every few seconds of conversation. One caller per session plays a support call on the 400 ms window grid:
a few seconds of speech (noise), then ``input_audio_buffer.commit`` (a COMMIT control); the model
answers until ``<tts_end>``; every third answer the caller cuts it (a CANCEL under a new epoch, as
the session sends for ``response.cancel``), and a model barge-in is answered the same way. A
caller pushes its next window as soon as the engine has stepped the last one, so the call runs as
fast as the engine does.

Every ``--sample-every`` seconds of call time it records the process's resident memory, the engine
step's thread CPU time (median and max over the interval: the worker thread's own CPU seconds, so
other load on the machine does not inflate it) and wall time, the slides, context resets and the
longest host token list of any slot; at the end, the slides that took effect late, the most
positions one step re-prefilled against the budget. The report gives start / end / max and a
linear-fit slope per hour over the second half of the call. The command exits non-zero if a context
reset, a late slide, an engine error or a dropped window happened, or a call did not reach its
length.

    lychee-rtc bench long-call --minutes 30 --out long-call      # one 30-minute call
    lychee-rtc bench long-call --minutes 30 --sessions 2 --no-vocoder
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

if TYPE_CHECKING:
    from lychee_rtc.engine.scheduler import EngineSlot

WINDOW_S = 0.4
WINDOW_SAMPLES = 6400


@dataclass
class CallTally:
    windows: int = 0
    responses: int = 0
    completed: int = 0  # ended by <tts_end>
    cancelled: int = 0  # cut by the caller
    barge_ins: int = 0  # the model's own
    context_resets: int = 0
    errors: dict[str, int] = field(default_factory=dict)


@dataclass
class Sample:
    call_s: float  # conversation time reached (the slowest session)
    wall_s: float
    rss_mb: float | None
    # Over the steps since the previous sample: steps with a speaking session / listening only.
    speak_cpu_ms_p50: float | None
    speak_cpu_ms_max: float | None
    listen_cpu_ms_p50: float | None
    listen_cpu_ms_max: float | None
    step_wall_ms_p50: float | None
    step_wall_ms_max: float | None
    slides: int  # all sessions, so far
    context_resets: int
    longest_tokens: int  # the longest text/speech/control list of any slot now
    load1: float | None = None  # the machine's 1-minute load average: what else was running


@dataclass
class Trend:
    start: float | None
    end: float | None
    max: float | None
    slope_per_hour: float | None


@dataclass
class LongCallReport:
    command: str
    setup: dict[str, Any]
    minutes: float
    sessions: int
    wall_s: float
    tallies: list[CallTally]
    windows_dropped: int
    slides: int
    slides_late: int  # slides that took effect after their slide point
    budget: int  # re-prefill positions per window step, all sessions together
    most_computed: int  # the most one step re-prefilled (padding of batched forwards included)
    rss_mb: Trend
    speak_cpu_ms_p50: Trend
    listen_cpu_ms_p50: Trend
    step_wall_ms_p50: Trend
    samples: list[Sample]

    @property
    def clean(self) -> bool:
        want = int(round(self.minutes * 60 / WINDOW_S))
        return (self.windows_dropped == 0 and self.slides_late == 0 and all(t.context_resets == 0 and not t.errors and t.windows == want
                                                  for t in self.tallies))


def rss_mb() -> float | None:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024.0, 1)
    except OSError:
        pass
    return None


def trend(samples: Sequence[Sample], key: str) -> Trend:
    values = [(s.call_s, getattr(s, key)) for s in samples if getattr(s, key) is not None]
    if not values:
        return Trend(None, None, None, None)
    end_t = values[-1][0]
    late = [(t, v) for t, v in values if t >= end_t / 2]
    slope = None
    if len(late) >= 3 and late[-1][0] > late[0][0]:
        t, v = np.array(late, dtype=np.float64).T
        slope = round(float(np.polyfit(t, v, 1)[0]) * 3600.0, 3)
    return Trend(values[0][1], values[-1][1], max(v for _, v in values), slope)


class StepClock:
    """Wraps a backend's ``step``: the worker thread's CPU time and the wall time of every step,
    apart for steps in which some session speaks (ten decode steps) and listening-only steps (one
    forward), whose costs differ by several times: their mix changes with the conversation."""

    def __init__(self, backend) -> None:
        from lychee_rtc.engine.lychee.slot import Mode

        self.steps: dict[str, list[tuple[float, float]]] = {"speak": [], "listen": []}
        inner = backend.step
        runner = backend.runner

        def step(windows):
            speaking = any(s is not None and s.mode is Mode.SPEAKING for s in runner.slots)
            c0, w0 = time.thread_time(), time.perf_counter()
            out = inner(windows)
            self.steps["speak" if speaking else "listen"].append(
                ((time.thread_time() - c0) * 1000.0, (time.perf_counter() - w0) * 1000.0))
            return out

        backend.step = step

    def take(self) -> dict[str, list[tuple[float, float]]]:
        out, self.steps = self.steps, {"speak": [], "listen": []}
        return out


async def caller(slot: "EngineSlot", windows: int, seed: int, tally: CallTally, progress: list[int]) -> None:
    """One conversation of ``windows`` windows on one engine slot, as a support call goes."""
    from lychee_rtc.engine.base import (
        BargeIn,
        Control,
        ControlKind,
        EngineError,
        ResponseDone,
        ResponseStarted,
        WindowTiming,
    )

    rng = np.random.default_rng(seed)
    epoch = 0
    user_left = int(rng.integers(5, 16))  # windows of the caller's next utterance
    answering = False
    cut_after: int | None = None  # windows of the answer after which the caller cuts it
    answered = 0
    for k in range(windows):
        speaking_user = user_left > 0 and not answering
        level = 0.1 if speaking_user else 0.005
        slot.push((level * rng.standard_normal(WINDOW_SAMPLES)).astype(np.float32), k, epoch)
        while True:
            ev = await slot.events.get()
            if ev is None:
                raise RuntimeError("the engine closed the slot")
            if isinstance(ev, WindowTiming):
                break
            if isinstance(ev, ResponseStarted):
                tally.responses += 1
                answering = True
                answered = 0
                cut_after = int(rng.integers(3, 9)) if tally.responses % 3 == 0 else None
            elif isinstance(ev, ResponseDone):
                answering = False
                if ev.status == "completed":
                    tally.completed += 1
                user_left = int(rng.integers(5, 16))
            elif isinstance(ev, BargeIn):
                tally.barge_ins += 1
                epoch += 1
                slot.control(Control(ControlKind.CANCEL, epoch))
                answering = False
                user_left = int(rng.integers(5, 16))
            elif isinstance(ev, EngineError):
                if ev.code == "context_reset":
                    tally.context_resets += 1
                else:
                    tally.errors[ev.code] = tally.errors.get(ev.code, 0) + 1
        tally.windows += 1
        progress[0] = k + 1
        if answering:
            answered += 1
            if cut_after is not None and answered >= cut_after:
                epoch += 1  # the caller cuts the answer (response.cancel)
                slot.control(Control(ControlKind.CANCEL, epoch))
                tally.cancelled += 1
                answering = False
                user_left = int(rng.integers(5, 16))
        elif speaking_user:
            user_left -= 1
            if user_left == 0:
                slot.control(Control(ControlKind.COMMIT, epoch))  # end of the caller's turn


async def long_call(*, minutes: float, sessions: int, max_seq: int, window: int, step: int, budget: int | None,
                    vocoder: bool, sample_every_s: float, seed: int = 0, threads: int | None = 1,
                    progress: bool = True, command: str = "") -> LongCallReport:
    import torch

    from lychee_rtc.engine.lychee.backend import build_lychee_backend
    from lychee_rtc.engine.lychee.tiny import TinySpec, write_tiny_checkpoint

    if threads is not None:
        torch.set_num_threads(threads)
    windows = int(round(minutes * 60 / WINDOW_S))
    with tempfile.TemporaryDirectory(prefix="lychee-long-call-") as tmp:
        root = write_tiny_checkpoint(Path(tmp) / "tiny", seed=seed, spec=TinySpec(decision_bias=4.0))
        options: dict[str, Any] = {
            "model_root": str(root), "device": "cpu", "dtype": "fp32", "max_seq": max_seq, "progress": False,
            "torch_threads": threads, "seed": seed, "strict_codec_range": True, "context_window": window,
            "context_slide_step": step, "context_prefill_budget": budget}
        if vocoder:
            from lychee_rtc.vocoder.token2wav.tiny import write_tiny_vocoder

            options["token2wav"] = write_tiny_vocoder(Path(tmp), seed=seed)
        backend = build_lychee_backend(options, sessions)
        context = backend.capabilities.context
        assert context is not None
        setup = {"model": "tiny random Lychee-FD (CPU, fp32)", "vocoder": "tiny Token2Wav" if vocoder else None,
                 "max_seq": max_seq, "sink": context.sink_positions, "window": context.window_positions,
                 "slide_step": context.slide_positions, "prefill_budget": backend.runner.policy.budget,
                 "torch_threads": threads,
                 "cpus": os.cpu_count(), "load_before": round(os.getloadavg()[0], 2)}
        return await _run_calls(backend, setup, sessions, windows, minutes, sample_every_s, seed, progress, command)


async def _run_calls(backend, setup: dict[str, Any], sessions: int, windows: int, minutes: float,
                     sample_every_s: float, seed: int, progress: bool, command: str) -> LongCallReport:
    from lychee_rtc.engine.base import SessionOptions
    from lychee_rtc.engine.scheduler import Engine

    runner = backend.runner
    clock = StepClock(backend)
    engine = Engine(backend, max_pending_windows=3)
    await engine.start()
    tallies = [CallTally() for _ in range(sessions)]
    progress_k = [[0] for _ in range(sessions)]
    samples: list[Sample] = []
    t0 = time.monotonic()

    def sample() -> None:
        steps = clock.take()
        states = [s for s in runner.slots if s is not None]
        speak = [c for c, _ in steps["speak"]]
        listen = [c for c, _ in steps["listen"]]
        wall = [w for kind in steps.values() for _, w in kind]

        def q(xs: list[float], f) -> float | None:
            return round(f(xs), 2) if xs else None

        s = Sample(call_s=round(min(p[0] for p in progress_k) * WINDOW_S, 1), wall_s=round(time.monotonic() - t0, 1),
                   rss_mb=rss_mb(), speak_cpu_ms_p50=q(speak, statistics.median), speak_cpu_ms_max=q(speak, max),
                   listen_cpu_ms_p50=q(listen, statistics.median), listen_cpu_ms_max=q(listen, max),
                   step_wall_ms_p50=q(wall, statistics.median), step_wall_ms_max=q(wall, max),
                   slides=sum(st.context_slides for st in states),
                   context_resets=sum(t.context_resets for t in tallies),
                   longest_tokens=max((len(st.text) for st in states), default=0), load1=round(os.getloadavg()[0], 2))
        samples.append(s)
        if progress:
            print(format_sample(s), flush=True)

    slots = [await engine.open(SessionOptions(seed=seed + i)) for i in range(sessions)]
    try:
        calls = asyncio.ensure_future(asyncio.gather(*(caller(slot, windows, seed + 17 * i, tallies[i], progress_k[i])
                                                       for i, slot in enumerate(slots))))
        sample()
        next_at = sample_every_s
        while not calls.done():
            await asyncio.wait([calls], timeout=0.2)
            if min(p[0] for p in progress_k) * WINDOW_S >= next_at and not calls.done():
                sample()
                next_at += sample_every_s
        await calls
        slides = sum(st.context_slides for st in runner.slots if st is not None)
        sample()
        dropped = sum(slot.counters.windows_dropped for slot in slots)
    finally:
        for slot in slots:
            await slot.close()
        await engine.stop()
    stats = runner.slide_stats
    return LongCallReport(command, setup, minutes, sessions, round(time.monotonic() - t0, 1), tallies, dropped,
                          slides, stats.late, stats.budget, stats.most_computed, trend(samples, "rss_mb"), trend(samples, "speak_cpu_ms_p50"),
                          trend(samples, "listen_cpu_ms_p50"), trend(samples, "step_wall_ms_p50"), samples)


def _f(v: Any) -> str:
    return "-" if v is None else str(v)


def format_sample(s: Sample) -> str:
    return (f"call {s.call_s:7.1f} s  wall {s.wall_s:6.1f} s  rss {_f(s.rss_mb):>7} MB  cpu ms p50/max speak "
            f"{_f(s.speak_cpu_ms_p50)}/{_f(s.speak_cpu_ms_max)} listen {_f(s.listen_cpu_ms_p50)}/"
            f"{_f(s.listen_cpu_ms_max)}  wall p50/max {_f(s.step_wall_ms_p50)}/{_f(s.step_wall_ms_max)} ms  "
            f"slides {s.slides}  resets {s.context_resets}  longest {s.longest_tokens}  load {_f(s.load1)}")


def format_markdown(r: LongCallReport) -> str:
    lines = [f"# Long call: {r.sessions} session(s) x {r.minutes:g} min of conversation in {r.wall_s:.0f} s", ""]
    if r.command:
        lines += [f"`{r.command}`", ""]
    lines += ["Setup: " + ", ".join(f"{k} {v}" for k, v in r.setup.items()), "",
              "| session | windows | responses | completed | cut by caller | model barge-ins | context resets "
              "| errors |", "|---|---|---|---|---|---|---|---|"]
    for i, t in enumerate(r.tallies):
        lines.append(f"| {i} | {t.windows} | {t.responses} | {t.completed} | {t.cancelled} | {t.barge_ins} "
                     f"| {t.context_resets} | {t.errors or '-'} |")
    lines += ["", f"Slides: {r.slides} ({r.slides_late} late); the most positions re-prefilled in one step: "
              f"{r.most_computed} of a budget of {r.budget}; windows dropped by the scheduler: {r.windows_dropped}.", "",
              "| series | start | end | max | slope per hour (2nd half) |", "|---|---|---|---|---|"]
    for name, tr in (("RSS MB", r.rss_mb), ("speaking step CPU ms p50", r.speak_cpu_ms_p50),
                     ("listening step CPU ms p50", r.listen_cpu_ms_p50), ("step wall ms p50", r.step_wall_ms_p50)):
        lines.append(f"| {name} | {_f(tr.start)} | {_f(tr.end)} | {_f(tr.max)} | {_f(tr.slope_per_hour)} |")
    lines += ["", "| call s | wall s | RSS MB | speaking step CPU ms p50 / max | listening step CPU ms p50 / max "
              "| step wall ms p50 / max | slides | resets | longest token list | load (1 min) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for s in r.samples:
        lines.append(f"| {s.call_s:.0f} | {s.wall_s:.0f} | {_f(s.rss_mb)} | {_f(s.speak_cpu_ms_p50)} / "
                     f"{_f(s.speak_cpu_ms_max)} | {_f(s.listen_cpu_ms_p50)} / {_f(s.listen_cpu_ms_max)} "
                     f"| {_f(s.step_wall_ms_p50)} / {_f(s.step_wall_ms_max)} | {s.slides} "
                     f"| {s.context_resets} | {s.longest_tokens} | {_f(s.load1)} |")
    return "\n".join(lines) + "\n"


def write_report(r: LongCallReport, out: str) -> tuple[str, str]:
    stem = out[:-5] if out.endswith(".json") else out[:-3] if out.endswith(".md") else out
    if os.path.dirname(stem):
        os.makedirs(os.path.dirname(stem), exist_ok=True)
    with open(stem + ".json", "w") as f:
        json.dump({**asdict(r), "clean": r.clean}, f, indent=2)
    with open(stem + ".md", "w") as f:
        f.write(format_markdown(r))
    return stem + ".json", stem + ".md"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("long-call", help="long conversations on the Lychee-FD engine (tiny, CPU), faster than "
                                         "real time",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0, help="conversation length (default 30)")
    p.add_argument("--sessions", type=int, default=1, help="concurrent conversations (default 1)")
    p.add_argument("--max-seq", type=int, default=512, help="positions per slot (default 512)")
    p.add_argument("--window", type=int, default=200, help="conversation positions a slide keeps (default 200)")
    p.add_argument("--step", type=int, default=100, help="positions dropped per slide (default 100)")
    p.add_argument("--budget", type=int, default=None,
                   help="positions re-prefilled per window step, all sessions together (default: derived)")
    p.add_argument("--no-vocoder", action="store_true", help="end at speech codes (no tiny Token2Wav)")
    p.add_argument("--sample-every", type=float, default=60.0, help="seconds of call time between samples")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the report here as STEM.json and STEM.md")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    command = "lychee-rtc " + " ".join(sys.argv[1:]) if "bench" in sys.argv[1:] else ""
    report = asyncio.run(long_call(minutes=args.minutes, sessions=args.sessions, max_seq=args.max_seq,
                                   window=args.window, step=args.step, budget=args.budget,
                                   vocoder=not args.no_vocoder, sample_every_s=args.sample_every, seed=args.seed,
                                   threads=args.threads, command=command))
    print(format_markdown(report))
    if args.out:
        for path in write_report(report, args.out):
            print(f"wrote {path}")
    return 0 if report.clean else 1
