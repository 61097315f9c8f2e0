"""``lychee-rtc bench slide``: a context slide against the 400 ms window deadline, and its cost.

For each C (``--sessions``) it opens C sessions on one runner with the profiles' slide geometry
(default: 8192 positions per slot, 6000 kept, 1500 dropped per slide; re-prefilled per window step:
256 positions on a GPU as in the profiles, 64 on a CPU as in the tiny CPU profile), lets them listen
(the cheap window) until five windows before a re-prefill starts, then makes every session speak
(the dearest window: ten decode steps) through the re-prefill's windows, the switch and five windows
past it, and listens again until the next one, for ``--slides`` slides. The sessions were opened
together, so their slides coincide: every session's re-prefill chunk lands in the same steps, the
worst case for a deadline.

Per window it records the step's wall time (synchronised on CUDA) and the process's CPU time, and
whether the step carried re-prefill work or a switch. The report gives, for windows in which every
session speaks: p50 / p95 / max of plain windows, of windows with a re-prefill chunk, and of
windows with the switch; the deadline misses (a step over 400 ms, by the wall clock and by the
process's CPU time) among all windows stepped; and per slide the time of its slide work (the
re-prefill chunks and the switch, timed on their own after each step's results, synchronised on
CUDA; wall and CPU), per session and per position re-prefilled, and the largest share of it in one
step. Random weights (speed does not depend on their values):
``--size tiny`` on a CPU, ``--size full`` (the released shapes) on a GPU, with CUDA graphs where
they exist. Exit status 1 if a context reset happened, fewer slides than asked were measured, or, on
a GPU, a window missed its deadline (on a CPU misses are reported, by the wall clock and by CPU time,
which the machine's other load inflates far less).

    lychee-rtc bench slide --size tiny --device cpu --sessions 1,4 --out bench-slide     # CPU check
    lychee-rtc bench slide --size full --sessions 1,4 --out bench-slide                  # on a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

DEADLINE_MS = 400.0


@dataclass
class Window:
    step_ms: float
    cpu_ms: float
    speaking: bool  # every session spoke in this window
    prefill: int  # positions re-prefilled in this step (all sessions)
    switches: int  # slides that took effect at its end
    slide_ms: float  # the step's slide work alone (re-prefill chunks, switch), synchronised on CUDA
    slide_cpu_ms: float


@dataclass
class Stats:
    windows: int
    p50: float | None
    p95: float | None
    max: float | None

    @classmethod
    def of(cls, xs: Sequence[float]) -> "Stats":
        if not xs:
            return cls(0, None, None, None)
        q = sorted(xs)
        return cls(len(q), round(q[len(q) // 2], 2), round(q[min(len(q) - 1, int(0.95 * len(q)))], 2),
                   round(q[-1], 2))


@dataclass
class Row:
    sessions: int
    slides: int  # slide events measured (each one slides every session)
    plain: Stats  # speaking windows without slide work
    prefill: Stats  # speaking windows with a re-prefill chunk
    switch: Stats  # speaking windows ending with the switch
    all_max_ms: float  # the slowest step of the run, fast-forward included
    all_max_cpu_ms: float
    deadline_misses: int  # steps over 400 ms wall, fast-forward included
    deadline_misses_cpu: int  # steps over 400 ms of process CPU time (what a CPU run under load can tell)
    context_resets: int
    slide_ms: float | None  # per slide event: the slide work of its windows, summed (wall)
    slide_cpu_ms: float | None  # the same in process CPU time
    per_session_ms: float | None  # slide_ms / sessions
    per_position_us: float | None  # slide_ms / positions re-prefilled
    slide_step_max_ms: float | None  # the largest share of one step (what a window's deadline sees)
    prefill_positions: int  # per slide event, all sessions
    peak_gib: float | None
    raw: list[Window] = field(default_factory=list)


def measure(model, tokenizer, sessions: int, *, max_seq: int, window: int | None, step: int | None, chunk: int,
            slides: int, graphs: str, seed: int = 0) -> Row:
    import numpy as np
    import torch

    from lychee_rtc.engine.base import Control, ControlKind, SessionOptions
    from lychee_rtc.engine.lychee.runner import LycheeRunner, RunnerSettings
    from lychee_rtc.engine.lychee.slot import Mode

    device = model.lm_head.weight.device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    runner = LycheeRunner(model, tokenizer, sessions, RunnerSettings(
        max_seq=max_seq, max_speech_tokens=10**6, max_text_tokens=10**6, context_window=window,
        context_slide_step=step, context_prefill_chunk=chunk, cuda_graphs=graphs))
    if not runner.policy.enabled:
        raise ValueError("the slide bench needs sliding on (context_window > 0)")
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    clock = {"ms": 0.0, "cpu": 0.0}
    advance = runner._advance_slides

    def timed_slides(states):  # the step's slide share, timed on its own (a bench-only wrapper)
        sync()
        c0, t0 = time.process_time(), time.perf_counter()
        advance(states)
        sync()
        clock["ms"], clock["cpu"] = (time.perf_counter() - t0) * 1000.0, (time.process_time() - c0) * 1000.0

    runner._advance_slides = timed_slides
    rng = np.random.default_rng(seed)
    audio = [(0.05 * rng.standard_normal(6400)).astype(np.float32) for _ in range(8)]
    for s in range(sessions):
        runner.open(s, SessionOptions(seed=seed + s))
    epochs = [0] * sessions
    out: list[Window] = []
    all_ms: list[float] = []
    all_cpu: list[float] = []
    events = 0
    since_switch = 99
    k = 0
    margin = 5  # windows of plain speaking before each re-prefill and after each switch (the baseline)
    limit = (slides + 1) * (max_seq // 10 + 10)
    with torch.no_grad():
        while events < slides and k < limit:
            first = runner.slots[0]
            plan = runner.policy.plan(first.prefix_len, first.prefix_len)
            assert plan is not None
            near = bool(runner.slides) or len(first.text) >= plan.start_at - 10 * margin or since_switch < margin
            for s in range(sessions):
                st = runner.slots[s]
                if near and st.mode is Mode.LISTENING:
                    runner.apply_controls(s, [Control(ControlKind.COMMIT, epochs[s])])
                elif not near and st.mode is Mode.SPEAKING:
                    epochs[s] += 1
                    runner.apply_controls(s, [Control(ControlKind.CANCEL, epochs[s])])
            speaking = all(runner.slots[s].mode is Mode.SPEAKING for s in range(sessions))
            items = [(s, audio[(k + s) % len(audio)], epochs[s]) for s in range(sessions)]
            sync()
            c0, t0 = time.process_time(), time.perf_counter()
            runner.step(items)
            sync()
            ms, cpu = (time.perf_counter() - t0) * 1000.0, (time.process_time() - c0) * 1000.0
            k += 1
            all_ms.append(ms)
            all_cpu.append(cpu)
            if k > 3:  # warm-up windows (allocator, lazy inits) are not counted as plain
                out.append(Window(round(ms, 3), round(cpu, 3), speaking, runner.slide_work, runner.slides_done,
                                  round(clock["ms"], 3), round(clock["cpu"], 3)))
            since_switch = 0 if runner.slides_done else since_switch + 1
            if runner.slides_done:
                events += 1
    resets = sum(runner.slots[s].context_resets for s in range(sessions))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    for s in range(sessions):
        runner.close(s)
    return summarise(sessions, out, all_ms, all_cpu, events, resets, peak)


def summarise(sessions: int, windows: list[Window], all_ms: list[float], all_cpu: list[float], events: int,
              resets: int, peak: float | None) -> Row:
    speaking = [w for w in windows if w.speaking]
    plain = [w for w in speaking if not w.prefill and not w.switches]
    prefill = [w for w in speaking if w.prefill and not w.switches]
    switch = [w for w in speaking if w.switches]
    work = [w for w in windows if w.prefill or w.switches]
    cost = cost_cpu = per_session = per_position = step_max = None
    positions = sum(w.prefill for w in work)
    if events:
        cost = round(sum(w.slide_ms for w in work) / events, 2)
        cost_cpu = round(sum(w.slide_cpu_ms for w in work) / events, 2)
        per_session = round(cost / sessions, 2)
        per_position = round(1000.0 * cost * events / positions, 2) if positions else None
        step_max = round(max(w.slide_ms for w in work), 2)
    return Row(sessions, events, Stats.of([w.step_ms for w in plain]), Stats.of([w.step_ms for w in prefill]),
               Stats.of([w.step_ms for w in switch]), round(max(all_ms), 2) if all_ms else 0.0,
               round(max(all_cpu), 2) if all_cpu else 0.0, sum(ms > DEADLINE_MS for ms in all_ms),
               sum(ms > DEADLINE_MS for ms in all_cpu), resets, cost, cost_cpu, per_session, per_position, step_max,
               positions // events if events else 0, None if peak is None else round(peak, 2), windows)


def format_table(rows: Sequence[Row]) -> str:
    def s3(s: Stats) -> str:
        return "-" if not s.windows else f"{s.p50} / {s.p95} / {s.max} ({s.windows})"

    lines = ["| C | slides | speaking, plain: ms p50 / p95 / max (n) | with re-prefill chunk | with switch "
             "| slowest step ms (CPU ms) | misses > 400 ms wall (CPU) | resets | per slide: ms (CPU ms) "
             "| per session ms | per position µs | largest share of a step ms | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| C{r.sessions} | {r.slides} | {s3(r.plain)} | {s3(r.prefill)} | {s3(r.switch)} "
                     f"| {r.all_max_ms} ({r.all_max_cpu_ms}) | {r.deadline_misses} ({r.deadline_misses_cpu}) "
                     f"| {r.context_resets} | {r.slide_ms} ({r.slide_cpu_ms}) | {r.per_session_ms} "
                     f"| {r.per_position_us} | {r.slide_step_max_ms} | {'-' if r.peak_gib is None else r.peak_gib} |")
    return "\n".join(lines)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slide", help="window step time around context slides and each slide's cost",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=["tiny", "full"], default="tiny", help="tiny test shapes or the released ones")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:N]")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="default bf16 on CUDA, fp32 on CPU")
    p.add_argument("--sessions", default="1,4", help="comma-separated session counts (default 1,4)")
    p.add_argument("--slides", type=int, default=2, help="slide events to measure per C (default 2)")
    p.add_argument("--max-seq", type=int, default=8192, help="positions per slot (default 8192, as the profiles)")
    p.add_argument("--window", type=int, default=6000, help="positions kept by a slide (default 6000)")
    p.add_argument("--step", type=int, default=1500, help="positions dropped per slide (default 1500)")
    p.add_argument("--chunk", type=int, default=None,
                   help="positions re-prefilled per window step (default 256 on CUDA as the profiles, 64 on a CPU)")
    p.add_argument("--graphs", choices=["auto", "on", "off"], default="auto", help="CUDA graphs (auto: on CUDA)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--out", help="folder for bench_slide.json and bench_slide.md")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from lychee_rtc.bench.gpu import build_lychee, environment

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    t0 = time.monotonic()
    model, tokenizer, _ = build_lychee(args.size, device, dtype)
    chunk = args.chunk or (256 if device.type == "cuda" else 64)
    setup: dict[str, Any] = {"size": args.size, "dtype": dtype_name, "max_seq": args.max_seq, "window": args.window,
                             "step": args.step, "chunk": chunk, "graphs": args.graphs,
                             "build_s": round(time.monotonic() - t0, 1)}
    try:
        import os

        setup["load_before"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    print(f"built the {args.size} model in {setup['build_s']} s on {device}", flush=True)
    rows: list[Row] = []
    env = environment(device)
    out = Path(args.out) if args.out else None
    for c in [int(x) for x in str(args.sessions).split(",") if x]:
        row = measure(model, tokenizer, c, max_seq=args.max_seq, window=args.window, step=args.step, chunk=chunk,
                      slides=args.slides, graphs=args.graphs)
        rows.append(row)
        print(format_table([row]), flush=True)
        if out is not None:  # a run cut short keeps what it measured
            write(out, env, setup, rows)
    print(format_table(rows))
    # On a GPU a missed deadline fails the run. On a CPU (a check of the code path; tiny numbers say
    # nothing about a GPU) misses are reported, by CPU time too, whose count the machine's other load
    # does not inflate as it does the wall clock's.
    cuda = device.type == "cuda"
    bad = [r for r in rows if (cuda and r.deadline_misses) or r.context_resets or r.slides < args.slides]
    for r in rows:
        if r in bad or r.deadline_misses:
            print(f"C{r.sessions}: {r.deadline_misses} deadline misses ({r.deadline_misses_cpu} by CPU time), "
                  f"{r.context_resets} context resets, {r.slides} of {args.slides} slides", file=sys.stderr)
    return 1 if bad else 0


def write(out: Path, env: dict, setup: dict, rows: Sequence[Row]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_slide.json").write_text(json.dumps(
        {"environment": env, "setup": setup, "rows": [asdict(r) for r in rows]}, indent=2))
    head = [f"# lychee-rtc bench slide ({env.get('gpu') or env.get('cpu')}, torch {env['torch']})", "",
            f"Command: `lychee-rtc {' '.join(env['argv'])}`", "",
            "Setup: " + ", ".join(f"{k} {v}" for k, v in setup.items()), ""]
    (out / "bench_slide.md").write_text("\n".join(head + [format_table(rows)]) + "\n")
