"""Per-window step time of the Lychee-FD runner at C1 / C2 / C4.

``lychee-rtc bench lychee-step`` runs the real runner (model, caches, sampling, state machine) on a
tiny random checkpoint on CPU; ``lychee-rtc bench gpu`` measures the full-size model with the
vocoder on a GPU, eager against CUDA graphs. For each concurrency C it measures two steady states:

* listen: every session listening -> one 10-position forward per window for the batch,
* speak: every session speaking -> 10 lockstep decode steps per window for the batch,

and reports per-window wall time (the scheduler's step time for the whole batch) and the real-time
factor RTF = step time / 400 ms. Decisions are biased to "keep" (see tiny.bias_decisions) and
speaking is started with a commit, so the states hold for the whole run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

if TYPE_CHECKING:  # torch and the model are imported when a benchmark runs, not by the CLI parser
    from lychee_rtc.engine.lychee.runner import LycheeRunner

WINDOW_MS = 400.0


@dataclass(frozen=True)
class StepStats:
    sessions: int
    mode: str  # "listen" | "speak"
    windows: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    max_ms: float

    @property
    def rtf(self) -> float:
        return self.mean_ms / WINDOW_MS


def bench_runner(runner: LycheeRunner, sessions: int, windows: int, warmup: int = 3,
                 sync: Callable[[], None] | None = None, seed: int = 0) -> list[StepStats]:
    """Measure listen-only and speak-only windows with ``sessions`` slots stepped as one batch."""
    import numpy as np

    from lychee_rtc.engine.base import Control, ControlKind, SessionOptions
    from lychee_rtc.engine.lychee.slot import Mode

    rng = np.random.default_rng(seed)
    audio = [(0.05 * rng.standard_normal(6400)).astype(np.float32) for _ in range(8)]
    out: list[StepStats] = []
    for mode in ("listen", "speak"):
        for s in range(sessions):
            if runner.slots[s] is not None:
                runner.close(s)
            runner.open(s, SessionOptions(seed=s))
        times: list[float] = []
        k = 0
        while len(times) < windows:
            if mode == "speak":
                for s in range(sessions):
                    if runner.slots[s].mode is Mode.LISTENING:
                        runner.apply_controls(s, [Control(ControlKind.COMMIT, 0)])
            modes = {runner.slots[s].mode for s in range(sessions)}
            items = [(s, audio[(k + s) % len(audio)], 0) for s in range(sessions)]
            if sync:
                sync()
            t0 = time.perf_counter()
            runner.step(items)
            if sync:
                sync()
            dt = (time.perf_counter() - t0) * 1000.0
            k += 1
            steady = modes == ({Mode.LISTENING} if mode == "listen" else {Mode.SPEAKING})
            if k > warmup and steady:
                times.append(dt)
            if k > warmup + 20 * windows:
                break  # a state that will not hold; report what was measured
        if times:
            q = sorted(times)
            out.append(StepStats(sessions, mode, len(times), statistics.fmean(times), q[len(q) // 2],
                                 q[min(len(q) - 1, int(0.95 * len(q)))], q[-1]))
    for s in range(sessions):
        if runner.slots[s] is not None:
            runner.close(s)
    return out


def format_table(stats: Sequence[StepStats]) -> str:
    lines = ["| C | state | windows | mean ms | p50 ms | p95 ms | max ms | RTF (mean/400 ms) |",
             "|---|---|---|---|---|---|---|---|"]
    for s in stats:
        lines.append(f"| C{s.sessions} | {s.mode} | {s.windows} | {s.mean_ms:.1f} | {s.p50_ms:.1f} | "
                     f"{s.p95_ms:.1f} | {s.max_ms:.1f} | {s.rtf:.3f} |")
    return "\n".join(lines)


def bench_tiny(concurrency: Sequence[int] = (1, 2, 4), windows: int = 20, threads: int | None = 1,
               max_seq: int = 2048) -> list[StepStats]:
    """The runner on a tiny random checkpoint (written to a temp folder), on CPU."""
    import torch

    from lychee_rtc.engine.lychee.checkpoint import load_model
    from lychee_rtc.engine.lychee.runner import LycheeRunner, RunnerSettings
    from lychee_rtc.engine.lychee.tiny import TinySpec, write_tiny_checkpoint
    from lychee_rtc.engine.lychee.tokenizer import Tokenizer

    if threads is not None:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="lychee-bench-") as tmp:
        root = write_tiny_checkpoint(Path(tmp) / "tiny", seed=0, spec=TinySpec(decision_bias=4.0))
        model = load_model(root, dtype="fp32", device="cpu", progress=False)
        tok = Tokenizer.from_dir(root)
    stats: list[StepStats] = []
    for c in concurrency:
        # max_speech_tokens high: a response must not end naturally in the middle of the run
        runner = LycheeRunner(model, tok, c, RunnerSettings(max_seq=max_seq, max_speech_tokens=10**6))
        with torch.no_grad():
            stats += bench_runner(runner, c, windows)
    return stats


def add_parser(bench_sub: argparse._SubParsersAction) -> None:
    p = bench_sub.add_parser("lychee-step", help="per-window step time of the Lychee-FD runner (tiny model, CPU)",
                             description="Per-window step time at C1/C2/C4 for the tiny random Lychee-FD on CPU. "
                                         "For the full-size model on a GPU see `lychee-rtc bench gpu`.")
    p.add_argument("--windows", type=int, default=20, help="measured windows per state (default 20)")
    p.add_argument("--concurrency", default="1,2,4", help="comma-separated session counts (default 1,2,4)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    conc = [int(x) for x in str(args.concurrency).split(",") if x]
    stats = bench_tiny(conc, args.windows, args.threads)
    print(format_table(stats))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lychee-rtc bench")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args(["lychee-step", *(argv or [])])
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
