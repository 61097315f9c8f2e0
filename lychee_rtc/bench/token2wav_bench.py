"""Token2Wav streaming speed: wall time and real-time factor per hop, at several concurrencies.

Each round gives every stream one hop (10 new codes = 400 ms of audio; the first round 14 codes,
as a hop waits for more than hop + look-ahead codes) and runs ``synthesize_hops`` over all streams
(batched, the way the engine runs them) or one stream after another (``--sequential``). Reported per round: wall ms, and RTF = round time /
400 ms (the time to make 400 ms of audio for *every* stream; <= 1 is real time, the target on one
H200 is <= 0.1 at C4). The first round (prompt already primed) is reported apart, as is priming.

Weights are random (``--size tiny`` or ``--size full`` = the released shapes, built in memory, no
files needed) or a real folder (``--folder``, with ``--prompt`` WAV). Speed does not depend on the
weight values. Voices are random prompt features of ``--prompt-seconds``.

    lychee-rtc bench vocoder --size tiny --device cpu
    lychee-rtc bench vocoder --size full --device cuda --dtype bf16 --concurrency 1 2 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch and the vocoder are imported when the benchmark runs, not by the CLI parser
    import torch

    from lychee_rtc.vocoder.token2wav.model import Token2Wav, Voice

DTYPE_NAMES = ("fp32", "fp16", "bf16")


def _dtype(name: str) -> "torch.dtype":
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


@dataclass
class VocoderBenchResult:
    size: str
    device: str
    dtype: str
    concurrency: int
    batched: bool
    prompt_tokens: int
    rounds: int
    prime_ms: float  # one voice, once (cached afterwards)
    first_hop_ms: float  # the round producing the first 240 ms of every stream
    hop_ms_mean: float
    hop_ms_p50: float
    hop_ms_p95: float
    hop_ms_max: float
    rtf_mean: float  # hop_ms_mean / 400 ms
    rtf_p95: float
    peak_mem_mb: float | None  # CUDA peak allocated, or None on CPU
    params_flow: int
    params_hift: int


def random_model(size: str, device: "str | torch.device", dtype: "torch.dtype", seed: int = 0) -> "Token2Wav":
    """A Token2Wav with random weights in the tiny or the released (full) shapes, no files."""
    import torch

    from lychee_rtc.vocoder.token2wav.config import FlowConfig, HiftConfig
    from lychee_rtc.vocoder.token2wav.flow import Flow
    from lychee_rtc.vocoder.token2wav.hift import HiFTGenerator
    from lychee_rtc.vocoder.token2wav.model import Token2Wav
    from lychee_rtc.vocoder.token2wav.tiny import TINY_FLOW, TINY_HIFT

    torch.manual_seed(seed)
    flow_cfg, hift_cfg = (TINY_FLOW, TINY_HIFT) if size == "tiny" else (FlowConfig(), HiftConfig())
    device = torch.device(device)
    with torch.device(device):
        flow = Flow(flow_cfg, noise_seed=seed)
        hift = HiFTGenerator(hift_cfg)
    # keep activations in a sane range with random weights (timing does not depend on values)
    with torch.no_grad():
        for p in list(flow.parameters()) + list(hift.parameters()):
            if p.dim() > 1:
                p.mul_(0.5)
    return Token2Wav(flow.to(dtype).eval(), hift.eval(), None, device)


def random_voice(model: "Token2Wav", prompt_tokens: int, seed: int = 0) -> "Voice":
    import torch

    from lychee_rtc.vocoder.token2wav.frontend import PromptFeatures

    g = torch.Generator().manual_seed(seed)
    feats = PromptFeatures(
        tokens=torch.randint(0, model.config.vocab_size, (1, prompt_tokens), generator=g, dtype=torch.int32),
        embedding=torch.randn(1, model.config.spk_embed_dim, generator=g),
        mel=torch.randn(1, 2 * prompt_tokens, model.config.output_size, generator=g) - 5.0)
    return model.voice_from_features(f"random{seed}", feats)


def _sync(device: "torch.device") -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_vocoder(model: "Token2Wav", size: str, concurrency: int, rounds: int = 20, prompt_tokens: int = 150,
                  batched: bool = True, seed: int = 0) -> VocoderBenchResult:
    import torch

    from lychee_rtc.engine.lychee.token2wav_stream import StreamRules, VocoderStream, synthesize_hops

    device = model.device
    voices = [random_voice(model, prompt_tokens, seed + i) for i in range(concurrency)]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t = time.perf_counter()
    model.prime(voices[0])
    _sync(device)
    prime_ms = (time.perf_counter() - t) * 1000
    for v in voices[1:]:
        model.prime(v)
    streams = [VocoderStream(model, v, 0, f"bench{i}", rules=StreamRules(hop=10), seed=seed + i)
               for i, v in enumerate(voices)]
    g = torch.Generator().manual_seed(seed)
    seqs = [0] * concurrency
    times = []
    for r in range(rounds + 1):
        n = 14 if r == 0 else 10  # then 4 stay pending: each round of 10 makes exactly one hop
        for i, s in enumerate(streams):
            s.feed(torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist(), 0, s.response_id, seqs[i])
            seqs[i] += 1
        _sync(device)
        t = time.perf_counter()
        if batched:
            out = synthesize_hops(streams)
        else:
            out = [synthesize_hops([s])[0] for s in streams]
        _sync(device)
        times.append((time.perf_counter() - t) * 1000)
        if any(not ev for ev in out):
            raise RuntimeError(f"round {r}: a stream produced no audio: {out}")
    hop = times[1:]
    q = statistics.quantiles(hop, n=20, method="inclusive") if len(hop) >= 2 else hop * 19
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return VocoderBenchResult(
        size=size, device=str(device), dtype=str(model.flow.dtype).removeprefix("torch."),
        concurrency=concurrency, batched=batched, prompt_tokens=prompt_tokens, rounds=rounds,
        prime_ms=prime_ms, first_hop_ms=times[0], hop_ms_mean=statistics.fmean(hop),
        hop_ms_p50=statistics.median(hop), hop_ms_p95=q[18], hop_ms_max=max(hop),
        rtf_mean=statistics.fmean(hop) / 400.0, rtf_p95=q[18] / 400.0, peak_mem_mb=peak,
        params_flow=sum(p.numel() for p in model.flow.parameters()),
        params_hift=sum(p.numel() for p in model.hift.parameters()))


def format_table(results: list[VocoderBenchResult]) -> str:
    head = ("| size | device | dtype | C | mode | prompt | prime ms | first hop ms | hop ms mean / p95 / max "
            "| RTF mean / p95 | peak MiB |\n|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [f"| {r.size} | {r.device} | {r.dtype} | {r.concurrency} | {'batched' if r.batched else 'sequential'} "
            f"| {r.prompt_tokens / 25:.1f} s | {r.prime_ms:.1f} | {r.first_hop_ms:.1f} "
            f"| {r.hop_ms_mean:.1f} / {r.hop_ms_p95:.1f} / {r.hop_ms_max:.1f} | {r.rtf_mean:.3f} / {r.rtf_p95:.3f} "
            f"| {'-' if r.peak_mem_mb is None else f'{r.peak_mem_mb:.0f}'} |" for r in results]
    return "\n".join([head] + rows)


def run_vocoder_bench(size: str = "tiny", device: str = "cpu", dtype: str = "fp32",
                      concurrency: tuple[int, ...] = (1, 2, 4), rounds: int = 20, prompt_seconds: float = 6.0,
                      sequential: bool = False, folder: str | None = None, prompt: str | None = None,
                      threads: int | None = None) -> list[VocoderBenchResult]:
    """What ``lychee-rtc bench vocoder`` runs; returns one result per (concurrency, mode)."""
    import torch

    from lychee_rtc.vocoder.token2wav.model import Token2Wav

    if threads:
        torch.set_num_threads(threads)
    if folder:
        model = Token2Wav.load(folder, device=device, dtype=_dtype(dtype))
        size = "folder"
        if prompt:
            model.prepare_voice("bench", prompt)  # front-end check only; random voices are timed
    else:
        model = random_model(size, device, _dtype(dtype))
    results = []
    for c in concurrency:
        for batched in ((True, False) if sequential and c > 1 else (True,)):
            results.append(bench_vocoder(model, size, c, rounds, int(round(prompt_seconds * 25)), batched))
    return results


def _main(args: argparse.Namespace) -> int:
    results = run_vocoder_bench(args.size, args.device, args.dtype, tuple(args.concurrency), args.rounds,
                                args.prompt_seconds, args.sequential, args.folder, args.prompt, args.threads)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("vocoder", help="Token2Wav streaming time and RTF per hop at C1/C2/C4",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=["tiny", "full"], default="tiny", help="random weights of this size")
    p.add_argument("--folder", help="a real token2wav/ folder instead of random weights")
    p.add_argument("--prompt", help="with --folder: a prompt WAV to check the front-end")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="fp32", help="flow dtype (HiFT stays fp32)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=20, help="timed hops per stream (after the first)")
    p.add_argument("--prompt-seconds", type=float, default=6.0)
    p.add_argument("--sequential", action="store_true", help="also time streams one after another")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--json", help="also write the results as JSON here")
    p.set_defaults(func=_main)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="token2wav_bench")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_parser(sub)
    args = parser.parse_args(["vocoder"] + list(argv or []))
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main(__import__("sys").argv[1:]))
