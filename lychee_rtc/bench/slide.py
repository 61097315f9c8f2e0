"""``lychee-rtc bench slide``: context slides against the 400 ms window deadline, and their cost.

For each C (``--sessions``) it opens C sessions on one runner with the profiles' slide geometry
(default: 8192 positions per slot, the window and slide step derived from it as in the profiles,
1630 dropped per slide; the engine-wide re-prefill budget derived for C sessions), lets them listen
(the cheap window) until five windows before their first slide, then makes every session speak
(the dearest window: ten decode steps) through the re-prefills of the next slides, each switch and
five windows past the last, for ``--slides`` slides. The sessions were opened together, so their
slides coincide: every session's re-prefill runs in the same steps, the worst case for a deadline.

Per window it records the step's wall time (synchronised on CUDA) and the process's CPU time, and
the step's slide work: positions re-prefilled (and computed, with the padding of batched forwards),
slots staged and forwards, switches, and its time on its own (after the step's results,
synchronised on CUDA; wall and CPU). The report gives, for windows in which every session speaks:
p50 / p95 / max of the step, of its slide share and of the step without it, and of windows with a
switch; the deadline misses (a step over 400 ms, by the wall clock and by the process's CPU time)
among all windows stepped; the budget, the most positions a step computed and the dearest step's
cost against the budget's (slides are paced and budgeted by cost, ``slide_budget.py``), late slides and
fallbacks (the last resort); per slide, its work summed (wall and CPU), per session and per
position re-prefilled. Random weights (speed does not depend on their values): ``--size tiny`` on a
CPU, ``--size full`` (the released shapes) on a GPU, with CUDA graphs where they exist. Exit status
1 if a context reset or a late slide happened, fewer slides than asked were measured, a step
cost more than the budget, or, on a GPU, a window missed its deadline (on a CPU misses are
reported, by the wall clock and by CPU time, which the machine's other load inflates far less).

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
    computed: int  # the same with the padding of batched forwards
    pieces: int  # sessions that re-prefilled in this step
    forwards: int  # forwards they took
    switches: int  # slides that took effect at its end
    slide_ms: float  # the step's slide work alone (re-prefill forwards, switch), synchronised on CUDA
    slide_cpu_ms: float
    warmup: bool = False  # the first windows (allocator, lazy inits): counted in the work, not in step times


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
    sink: int  # the geometry: system prefix, conversation kept, positions dropped per slide
    window: int
    step: int
    budget: int  # positions re-prefilled per window step, all sessions together
    speaking: Stats  # speaking windows: step CPU ms
    speaking_wall: Stats  # the same, wall ms
    share: Stats  # their slide share, CPU ms
    share_wall: Stats  # the same, wall ms
    without: Stats  # their step less the slide share, CPU ms (what the step costs without slides)
    switch: Stats  # speaking windows ending with the switch, CPU ms
    all_max_ms: float  # the slowest step of the run, fast-forward included
    all_max_cpu_ms: float
    deadline_misses: int  # steps over 400 ms wall, fast-forward included
    deadline_misses_cpu: int  # steps over 400 ms of process CPU time (what a CPU run under load can tell)
    context_resets: int
    late: int  # slides that took effect after their slide point
    fallbacks: int  # last-resort resets of sliding slots
    most_positions: int  # the most positions one step re-prefilled
    most_computed: int  # the most one step computed, padding included
    # the dearest step's cost (``slide_budget.cost``) in % of the budget in cost: never above 100
    most_cost_pct: float
    batched_steps: int  # steps whose pieces of several sessions shared a forward
    slide_ms: float | None  # per slide event: the slide work of the run, summed (wall)
    slide_cpu_ms: float | None  # the same in process CPU time
    per_session_ms: float | None  # slide_ms / sessions
    per_position_us: float | None  # slide_ms / positions re-prefilled
    prefill_positions: int  # per slide event, all sessions
    peak_gib: float | None
    raw: list[Window] = field(default_factory=list)


def measure(model, tokenizer, sessions: int, *, max_seq: int, window: int | None, step: int | None,
            budget: int | None, slides: int, graphs: str, seed: int = 0) -> Row:
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
        context_slide_step=step, context_prefill_budget=budget, cuda_graphs=graphs))
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
    first = runner.slots[0]
    plan = runner.policy.plan(first.prefix_len, first.prefix_len, 10)
    assert plan is not None
    epochs = [0] * sessions
    out: list[Window] = []
    all_ms: list[float] = []
    all_cpu: list[float] = []
    stats = runner.slide_stats
    events = 0
    after = 0
    k = 0
    margin = 5  # windows of speaking before the first measured switch and after the last
    limit = (slides + 1) * (max_seq // 10 + 10)
    with torch.no_grad():
        while after < margin and k < limit:
            near = events > 0 or len(first.text) >= plan.swap_at - 10 * margin
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
            out.append(Window(round(ms, 3), round(cpu, 3), speaking, stats.positions, stats.computed, stats.pieces,
                              stats.forwards, stats.switches, round(clock["ms"], 3), round(clock["cpu"], 3), k <= 3))
            events += stats.switches > 0
            after += events >= slides
    resets = sum(runner.slots[s].context_resets for s in range(sessions))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    for s in range(sessions):
        runner.close(s)
    geometry = (first.prefix_len, runner.policy.kept(first.prefix_len, first.prefix_len), runner.policy.step)
    return summarise(sessions, geometry, out, all_ms, all_cpu, events, resets, peak, stats)


def summarise(sessions: int, geometry: tuple[int, int, int], windows: list[Window], all_ms: list[float],
              all_cpu: list[float], events: int, resets: int, peak: float | None, stats) -> Row:
    speaking = [w for w in windows if w.speaking and not w.warmup]
    switch = [w for w in speaking if w.switches]
    # The work of the measured slides: every window up to the last switch (the next slide's begins after it).
    last = max((i for i, w in enumerate(windows) if w.switches), default=-1)
    work = windows[:last + 1]
    cost = cost_cpu = per_session = per_position = None
    positions = sum(w.prefill for w in work)
    if events:
        cost = round(sum(w.slide_ms for w in work) / events, 2)
        cost_cpu = round(sum(w.slide_cpu_ms for w in work) / events, 2)
        per_session = round(cost / sessions, 2)
        per_position = round(1000.0 * cost * events / positions, 2) if positions else None
    return Row(sessions, events, *geometry, stats.budget, Stats.of([w.cpu_ms for w in speaking]),
               Stats.of([w.step_ms for w in speaking]), Stats.of([w.slide_cpu_ms for w in speaking]),
               Stats.of([w.slide_ms for w in speaking]), Stats.of([w.cpu_ms - w.slide_cpu_ms for w in speaking]),
               Stats.of([w.cpu_ms for w in switch]), round(max(all_ms), 2) if all_ms else 0.0,
               round(max(all_cpu), 2) if all_cpu else 0.0, sum(ms > DEADLINE_MS for ms in all_ms),
               sum(ms > DEADLINE_MS for ms in all_cpu), resets, stats.late, stats.fallbacks,
               max((w.prefill for w in windows), default=0), stats.most_computed,
               round(100.0 * stats.most_cost / stats.budget_cost, 1) if stats.budget_cost else 0.0,
               sum(w.forwards < w.pieces for w in windows), cost, cost_cpu, per_session, per_position,
               positions // events if events else 0, None if peak is None else round(peak, 2), windows)


def format_table(rows: Sequence[Row]) -> str:
    def s3(s: Stats) -> str:
        return "-" if not s.windows else f"{s.p50} / {s.p95} / {s.max} ({s.windows})"

    lines = ["| C | slides | budget / most computed in a step (dearest step, % of the budget's cost) | speaking step, CPU ms p50 / p95 / max (n) "
             "| its slide share, CPU ms | the step without it, CPU ms | with switch, CPU ms "
             "| speaking step, wall ms | slowest step ms (CPU ms) | misses > 400 ms wall (CPU) "
             "| late / fallbacks / resets | batched steps | per slide: ms (CPU ms) | per session ms "
             "| per position µs | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| C{r.sessions} | {r.slides} | {r.budget} / {r.most_computed} ({r.most_cost_pct} %) | {s3(r.speaking)} "
                     f"| {s3(r.share)} | {s3(r.without)} | {s3(r.switch)} | {s3(r.speaking_wall)} "
                     f"| {r.all_max_ms} ({r.all_max_cpu_ms}) | {r.deadline_misses} ({r.deadline_misses_cpu}) "
                     f"| {r.late} / {r.fallbacks} / {r.context_resets} | {r.batched_steps} "
                     f"| {r.slide_ms} ({r.slide_cpu_ms}) | {r.per_session_ms} | {r.per_position_us} "
                     f"| {'-' if r.peak_gib is None else r.peak_gib} |")
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
    p.add_argument("--window", type=int, default=None,
                   help="positions kept by a slide (default: derived from --max-seq, as in the profiles)")
    p.add_argument("--step", type=int, default=None,
                   help="positions dropped per slide (default: derived from --max-seq, as in the profiles)")
    p.add_argument("--budget", type=int, default=None,
                   help="positions re-prefilled per window step, all sessions together (default: derived for C)")
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
    setup: dict[str, Any] = {"size": args.size, "dtype": dtype_name, "max_seq": args.max_seq, "window": args.window,
                             "step": args.step, "budget": args.budget, "graphs": args.graphs,
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
        row = measure(model, tokenizer, c, max_seq=args.max_seq, window=args.window, step=args.step,
                      budget=args.budget, slides=args.slides, graphs=args.graphs)
        rows.append(row)
        print(format_table([row]), flush=True)
        if out is not None:  # a run cut short keeps what it measured
            write(out, env, setup, rows)
    print(format_table(rows))
    # On a GPU a missed deadline fails the run. On a CPU (a check of the code path; tiny numbers say
    # nothing about a GPU) misses are reported, by CPU time too, whose count the machine's other load
    # does not inflate as it does the wall clock's.
    cuda = device.type == "cuda"
    bad = [r for r in rows if (cuda and r.deadline_misses) or r.context_resets or r.late or r.slides < args.slides
           or r.most_cost_pct > 100.0]
    for r in rows:
        if r in bad or r.deadline_misses:
            print(f"C{r.sessions}: {r.deadline_misses} deadline misses ({r.deadline_misses_cpu} by CPU time), "
                  f"{r.context_resets} context resets, {r.late} late slides, {r.slides} of {args.slides} slides, "
                  f"the dearest step {r.most_cost_pct} % of the budget", file=sys.stderr)
    return 1 if bad else 0


def write(out: Path, env: dict, setup: dict, rows: Sequence[Row]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_slide.json").write_text(json.dumps(
        {"environment": env, "setup": setup, "rows": [asdict(r) for r in rows]}, indent=2))
    head = [f"# lychee-rtc bench slide ({env.get('gpu') or env.get('cpu')}, torch {env['torch']})", "",
            f"Command: `lychee-rtc {' '.join(env['argv'])}`", "",
            "Setup: " + ", ".join(f"{k} {v}" for k, v in setup.items()), ""]
    (out / "bench_slide.md").write_text("\n".join(head + [format_table(rows)]) + "\n")
