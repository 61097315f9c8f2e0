"""``lychee-rtc bench gpu``: the whole speaking path per 400 ms window, eager against CUDA graphs.

Builds Lychee-FD in the released layout (28/4/4/4 Qwen2 layers, hidden 3584, vocab 158363, 32-layer
audio encoder) and Token2Wav in its released shapes with random weights, directly on the device in
the chosen dtype (no checkpoint needed: speed does not depend on the weight values), or both at tiny
size (``--size tiny``, for a check on a CPU). For each concurrency C it opens C sessions in one
runner and measures two steady states:

* listening: every session listening, one 10-position forward per window for the batch;
* speaking: every session speaking, ten lockstep decode steps per window, plus one Token2Wav hop
  (10 codes = 400 ms of audio) for each of the C streams, batched.

Each state is measured twice on the same runner, sessions and caches: eager (every kernel launched
from Python) and replaying the captured CUDA graphs (the LM's window programs and the flow's per-hop
solve); on a CPU only eager runs. Per window it records the LM step (``LycheeRunner.step``:
front-end, audio encoder, the window's forward(s), sampling, the per-slot state machine), the
vocoder time, their total, RTF = total / 400 ms, and reports p50 / p95 / max, the peak GPU memory, and the launch-overhead share of the eager window, 1 - graph p50 / eager
p50, for the LM step and for the total (the part of an eager window that replaying graphs removes).
Decisions are biased to "keep" so that each state holds; windows where a session left the state are
not counted.

The command exits with status 1 when the report is not the one asked for: no row was measured (for
example ``--modes graphs`` without CUDA), a row has fewer windows than ``--windows`` (a state that
did not hold), a (C, state, mode) asked for has no row, or a C ran out of GPU memory. The report is
written either way, and says what is missing.

    lychee-rtc bench gpu --out bench-gpu                          # full size, CUDA, C = 1,2,4,8,16
    lychee-rtc bench gpu --size tiny --device cpu --windows 3 --concurrency 1,2 --out bench-tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:  # heavy modules are imported where used, never while the CLI builds its parser
    import torch

    from lychee_rtc.engine.lychee.runner import LycheeRunner

WINDOW_MS = 400.0
STATES = ("listen", "speak")


@dataclass
class Series:
    p50: float
    p95: float
    max: float
    mean: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Series":
        q = sorted(values)
        return cls(q[len(q) // 2], q[min(len(q) - 1, int(0.95 * len(q)))], q[-1], statistics.fmean(q))


@dataclass
class Row:
    sessions: int
    state: str  # listen | speak
    mode: str  # eager | graphs
    windows: int
    lm_ms: Series
    vocoder_ms: Series
    total_ms: Series
    rtf: Series  # total / 400 ms
    peak_gib: float | None  # CUDA peak allocated over this C (both modes), None on CPU
    launch_overhead_lm: float | None = None  # eager rows: 1 - graph p50 / eager p50 of the LM step
    launch_overhead_total: float | None = None  # the same for LM step + vocoder
    raw_lm_ms: list[float] = field(default_factory=list)
    raw_vocoder_ms: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
# models


def released_lychee_spec():
    """The released Lychee-FD dimensions (docs/lychee_fd.md), as a spec the tiny writer understands."""
    from dataclasses import replace

    from lychee_rtc.engine.lychee.random_checkpoint import RELEASED_SPEC

    return replace(RELEASED_SPEC, decision_bias=4.0)


def build_lychee(size: str, device: "torch.device", dtype: "torch.dtype", seed: int = 0):
    """(model, tokenizer, raw config) with random weights, materialised on ``device`` in ``dtype``."""
    import torch

    from lychee_rtc.engine.lychee.config import parse_config
    from lychee_rtc.engine.lychee.model import LycheeFD, checkpoint_targets
    from lychee_rtc.engine.lychee.tiny import TinySpec, bias_decisions, randomize_, tiny_config, tiny_vocab
    from lychee_rtc.engine.lychee.tokenizer import Tokenizer

    spec = released_lychee_spec() if size == "full" else TinySpec(decision_bias=4.0)
    raw = tiny_config(spec)
    cfg = parse_config(raw)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LycheeFD(cfg)
    finally:
        torch.set_default_dtype(old)
    randomize_(model, seed=seed)
    with torch.no_grad():
        bias_decisions(checkpoint_targets(model), raw, spec.decision_bias)
    byte_tokens, added = tiny_vocab(spec)
    return model.eval(), Tokenizer.from_parts(byte_tokens, [], added), raw


def build_vocoder(size: str, device: "torch.device", dtype: "torch.dtype"):
    from lychee_rtc.bench.token2wav_bench import random_model

    return random_model(size, device, dtype)


# --------------------------------------------------------------------------------------------------
# measurement


class VocoderLoad:
    """C Token2Wav streams fed 10 random codes each per window and run as one batch."""

    def __init__(self, model, sessions: int, prompt_tokens: int, seed: int = 0):
        import torch

        from lychee_rtc.bench.token2wav_bench import random_voice
        from lychee_rtc.engine.lychee.token2wav_stream import VocoderStream

        self.model = model
        self.voices = [random_voice(model, prompt_tokens, seed + i) for i in range(sessions)]
        for v in self.voices:
            model.prime(v)
        self.streams = [VocoderStream(model, v, 0, f"bench{i}", seed=seed + i) for i, v in enumerate(self.voices)]
        self.seq = [0] * sessions
        self.g = torch.Generator().manual_seed(seed)

    def window(self) -> None:
        import torch

        from lychee_rtc.engine.lychee.token2wav_stream import synthesize_hops

        vocab = self.model.config.vocab_size
        for i, s in enumerate(self.streams):
            s.feed(torch.randint(0, vocab, (10,), generator=self.g).tolist(), 0, s.response_id, self.seq[i])
            self.seq[i] += 1
        synthesize_hops(self.streams)
        failed = [s.response_id for s in self.streams if not s.active]
        if failed:
            raise RuntimeError(f"vocoder streams failed during the benchmark: {failed}")


def _drive_state(runner: "LycheeRunner", state: str, sessions: int, audio: list, windows: int, warmup: int,
                 sync: Callable[[], None], vocoder: VocoderLoad | None,
                 k0: int) -> tuple[list[float], list[float], int]:
    """Step the open sessions until ``windows`` windows were measured with every session in ``state``."""
    from lychee_rtc.engine.base import Control, ControlKind
    from lychee_rtc.engine.lychee.slot import Mode

    want = Mode.LISTENING if state == "listen" else Mode.SPEAKING
    lm: list[float] = []
    voc: list[float] = []
    k = k0
    tries = 0
    while len(lm) < windows:
        tries += 1
        if tries > warmup + 20 * windows:
            break  # a state that does not hold: report what was measured
        if state == "speak":
            for s in range(sessions):
                if runner.slots[s].mode is Mode.LISTENING:
                    runner.apply_controls(s, [Control(ControlKind.COMMIT, 0)])
        before = {runner.slots[s].mode for s in range(sessions)}
        items = [(s, audio[(k + s) % len(audio)], 0) for s in range(sessions)]
        k += 1
        sync()
        t0 = time.perf_counter()
        runner.step(items)
        sync()
        t1 = time.perf_counter()
        if vocoder is not None and state == "speak":
            vocoder.window()
            sync()
        t2 = time.perf_counter()
        if tries > warmup and before == {want}:
            lm.append((t1 - t0) * 1000.0)
            voc.append((t2 - t1) * 1000.0)
    return lm, voc, k


def measure(model, tokenizer, vocoder_model, sessions: int, *, windows: int, warmup: int, max_seq: int,
            modes: Sequence[str], prompt_tokens: int, seed: int = 0) -> list[Row]:
    import numpy as np
    import torch

    from lychee_rtc.engine.base import SessionOptions
    from lychee_rtc.engine.lychee.runner import LycheeRunner, RunnerSettings

    device = model.lm_head.weight.device
    cuda = device.type == "cuda"
    gc.collect()  # the previous C's runner (its programs refer back to it) and its graph pools
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    graphs = "graphs" in modes and cuda
    settings = RunnerSettings(max_seq=max_seq, max_speech_tokens=10**6, max_text_tokens=10**6,
                              cuda_graphs="on" if graphs else "off")
    runner = LycheeRunner(model, tokenizer, sessions, settings)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    rng = np.random.default_rng(seed)
    audio = [(0.05 * rng.standard_normal(6400)).astype(np.float32) for _ in range(8)]
    run_modes = [m for m in modes if m == "eager" or graphs]
    out: list[Row] = []
    with torch.no_grad():
        for state in STATES:
            for s in range(sessions):
                if runner.slots[s] is not None:
                    runner.close(s)
                runner.open(s, SessionOptions(seed=seed + s))
            vocoder = (VocoderLoad(vocoder_model, sessions, prompt_tokens, seed)
                       if vocoder_model is not None and state == "speak" else None)
            k = 0
            measured = {}
            for mode in run_modes:
                runner.use_graphs = mode == "graphs"
                if vocoder_model is not None:
                    vocoder_model.flow.decoder.use_graphs = mode == "graphs"
                lm, voc, k = _drive_state(runner, state, sessions, audio, windows, warmup, sync, vocoder, k)
                measured[mode] = (lm, voc)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
            for mode, (lm, voc) in measured.items():
                if not lm:
                    continue
                total = [a + b for a, b in zip(lm, voc)]
                out.append(Row(sessions, state, mode, len(lm), Series.of(lm), Series.of(voc), Series.of(total),
                               Series.of([t / WINDOW_MS for t in total]), peak, raw_lm_ms=lm, raw_vocoder_ms=voc))
            eager = next((r for r in out if (r.sessions, r.state, r.mode) == (sessions, state, "eager")), None)
            graph = next((r for r in out if (r.sessions, r.state, r.mode) == (sessions, state, "graphs")), None)
            if eager and graph:
                eager.launch_overhead_lm = 1.0 - graph.lm_ms.p50 / eager.lm_ms.p50
                eager.launch_overhead_total = 1.0 - graph.total_ms.p50 / eager.total_ms.p50
    for s in range(sessions):
        if runner.slots[s] is not None:
            runner.close(s)
    return out


# --------------------------------------------------------------------------------------------------
# report


def environment(device: "torch.device") -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "device": str(device), "argv": sys.argv[1:],
                           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env |= {"gpu": p.name, "gpu_memory_gib": round(p.total_memory / 2**30, 1)}
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["torch_threads"] = torch.get_num_threads()
    return env


def format_table(rows: Sequence[Row]) -> str:
    def s3(x: Series, f: str = ".1f") -> str:
        return f"{x.p50:{f}} / {x.p95:{f}} / {x.max:{f}}"

    lines = ["| C | state | mode | windows | LM step ms p50 / p95 / max | vocoder ms p50 / p95 / max "
             "| total ms p50 / p95 / max | RTF p50 / p95 / max | peak GiB | launch overhead LM / total |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak = "-" if r.peak_gib is None else f"{r.peak_gib:.1f}"
        over = ("-" if r.launch_overhead_lm is None or r.launch_overhead_total is None
                else f"{100 * r.launch_overhead_lm:.0f} % / {100 * r.launch_overhead_total:.0f} %")
        lines.append(f"| C{r.sessions} | {r.state} | {r.mode} | {r.windows} | {s3(r.lm_ms)} | {s3(r.vocoder_ms)} "
                     f"| {s3(r.total_ms)} | {s3(r.rtf, '.3f')} | {peak} | {over} |")
    return "\n".join(lines)


def shortfalls(rows: Sequence[Row], concurrency: Sequence[int], modes: Sequence[str], windows: int,
               skipped: dict[int, str]) -> list[str]:
    """What the report lacks against what was asked: one line per missing or short row."""
    if not rows:
        return ["no row was measured"]
    got = {(r.sessions, r.state, r.mode): r for r in rows}
    out = [f"C{c} not run: {why}" for c, why in skipped.items()]
    for c in concurrency:
        if c in skipped:
            continue
        for state in STATES:
            for mode in modes:
                r = got.get((c, state, mode))
                if r is None:
                    out.append(f"C{c} {state} {mode}: no windows measured")
                elif r.windows < windows:
                    out.append(f"C{c} {state} {mode}: {r.windows} of {windows} windows measured")
    return out


def write_report(out: Path, env: dict, setup: dict, rows: Sequence[Row], skipped: dict[int, str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu.json").write_text(json.dumps(
        {"environment": env, "setup": setup, "rows": [asdict(r) for r in rows], "skipped": skipped}, indent=2))
    head = [f"# lychee-rtc bench gpu ({env.get('gpu') or env.get('cpu')}, torch {env['torch']}, "
            f"CUDA {env.get('cuda')}, driver {env.get('driver', '-')})", "",
            f"Command: `lychee-rtc {' '.join(env['argv'])}`", "",
            "Setup: " + ", ".join(f"{k} {v}" for k, v in setup.items()), ""]
    tail = [""] + [f"* C{c} not run: {why}" for c, why in skipped.items()]
    (out / "bench_gpu.md").write_text("\n".join(head + [format_table(rows)] + tail) + "\n")


# --------------------------------------------------------------------------------------------------
# command line


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gpu", help="LM step + vocoder per window at C1..C16, eager vs CUDA graphs (full size)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=["full", "tiny"], default="full",
                   help="released shapes (default) or the tiny test shapes, random weights either way")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda[:N]")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="LM and flow dtype (default bf16 on CUDA, fp32 on CPU; HiFT stays fp32)")
    p.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated session counts")
    p.add_argument("--windows", type=int, default=30, help="measured windows per state and mode (default 30)")
    p.add_argument("--warmup", type=int, default=3, help="windows not counted at the start of each mode")
    p.add_argument("--max-seq", type=int, default=None, help="KV positions per session (default 8192, tiny 1024)")
    p.add_argument("--modes", default="eager,graphs", help="eager, graphs or both (graphs need CUDA)")
    p.add_argument("--no-vocoder", action="store_true", help="LM only")
    p.add_argument("--prompt-seconds", type=float, default=6.0, help="voice prompt length of each stream")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", default="bench-gpu", help="folder for bench_gpu.json and bench_gpu.md")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    modes = [m for m in str(args.modes).split(",") if m]
    if not set(modes) <= {"eager", "graphs"} or not modes:
        print(f"--modes: expected eager and/or graphs, got {args.modes!r}", file=sys.stderr)
        return 2
    if "graphs" in modes and device.type != "cuda":
        print("note: CUDA graphs need a CUDA device; measuring eager only", file=sys.stderr)
    conc = [int(x) for x in str(args.concurrency).split(",") if x]
    max_seq = args.max_seq or (8192 if args.size == "full" else 1024)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    t0 = time.monotonic()
    model, tokenizer, raw = build_lychee(args.size, device, dtype)
    vocoder = None if args.no_vocoder else build_vocoder(args.size, device, dtype)
    if vocoder is not None and device.type == "cuda" and "graphs" in modes:
        vocoder.flow.decoder.enable_cuda_graphs()  # toggled per mode below, like the runner's
    built_s = time.monotonic() - t0
    params = sum(p.numel() for p in model.parameters())
    setup = {"size": args.size, "dtype": dtype_name, "max_seq": max_seq, "lm_params_b": round(params / 1e9, 3),
             "vocoder": None if vocoder is None else f"random Token2Wav ({args.size}), prompt {args.prompt_seconds} s",
             "windows": args.windows, "warmup": args.warmup, "modes": ",".join(modes), "build_s": round(built_s, 1)}
    print(f"built LM ({params / 1e9:.2f} B parameters) and vocoder in {built_s:.1f} s on {device}", flush=True)
    rows: list[Row] = []
    skipped: dict[int, str] = {}
    env = environment(device)
    out = Path(args.out)
    for c in conc:
        try:
            got = measure(model, tokenizer, vocoder, c, windows=args.windows, warmup=args.warmup, max_seq=max_seq,
                          modes=modes, prompt_tokens=int(round(args.prompt_seconds * 25)))
        except torch.cuda.OutOfMemoryError as exc:
            skipped[c] = f"out of GPU memory ({str(exc).splitlines()[0]})"
            print(f"C{c}: {skipped[c]}", flush=True)
            torch.cuda.empty_cache()
            break
        rows += got
        print(format_table(got), flush=True)
        write_report(out, env, setup, rows, skipped)  # a partial run still leaves its results
    write_report(out, env, setup, rows, skipped)
    print(format_table(rows))
    print(f"results in {out / 'bench_gpu.json'} and {out / 'bench_gpu.md'}")
    run_modes = [m for m in modes if m == "eager" or device.type == "cuda"]
    missing = shortfalls(rows, conc, run_modes, args.windows, skipped)
    for line in missing:
        print(f"incomplete: {line}", file=sys.stderr)
    return 1 if missing else 0
