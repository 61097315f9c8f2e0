"""``lychee-rtc bench …`` subcommands.

Each bench lives in its own module with heavy imports (aiortc, torch); the top-level parser only
knows their names, and a bench's own parser is built when that bench runs, so ``lychee-rtc --help``
imports none of them.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

# name -> (module, one-line summary); the module's add_parser() registers the same name.
BENCHES: dict[str, tuple[str, str]] = {
    "latency": ("lychee_rtc.bench.latency", "mouth-to-ear latency with chirps against the loopback engine"),
    "load": ("lychee_rtc.bench.load", "N concurrent calls; the largest N within a latency budget"),
    "signaling": ("lychee_rtc.bench.signaling", "offer -> answer time of running servers (a cluster entry, a worker)"),
    "lychee-step": ("lychee_rtc.bench.lychee_step", "per-window step time of the Lychee-FD runner (tiny model, CPU)"),
    "vocoder": ("lychee_rtc.bench.token2wav_bench", "Token2Wav streaming time and RTF per hop at C1/C2/C4"),
    "browser": ("lychee_rtc.bench.browser", "the /latency tester page in headless Chromium (mouth-to-ear, response latency); prints its JSON"),
    "levers": ("lychee_rtc.bench.levers", "each browser latency lever (10 ms packets, loopback window, jitterBufferTarget) against the default and the aiortc relay"),
    "telephony": ("lychee_rtc.bench.telephony", "mouth-to-ear of a phone call through the carrier WebSocket (loopback engine)"),
    "soak": ("lychee_rtc.bench.soak", "calls that come and go for minutes; server memory, threads and fds over time"),
    "gpu": ("lychee_rtc.bench.gpu", "Lychee-FD + Token2Wav at full size on one GPU: eager vs CUDA graphs, C1-C16"),
    "aec": ("lychee_rtc.bench.aec", "echo cancellation and noise suppression on a simulated speakerphone: ERLE, distortion, CPU"),
    "recording": ("lychee_rtc.bench.recording", "CPU and disk per recorded call-minute (Ogg/Opus + sidecar)"),
    "e2e": ("lychee_rtc.bench.e2e", "N callers speaking recorded utterances through the server (lychee profile)"),
    "websocket": ("lychee_rtc.bench.websocket", "the realtime WebSocket beside WebRTC: latency, CPU, capacity, throughput, vLLM-Omni's ttfp/RTF"),
    "long-call": ("lychee_rtc.bench.long_call", "long conversations on the Lychee-FD engine (tiny, CPU), faster than real time: memory, step time, slides"),
    "slide": ("lychee_rtc.bench.slide", "window step time around context slides and each slide's cost (tiny on CPU, full size on a GPU)"),
}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure latency, load and engine speed",
                           description="Benchmarks; the method and the results are in docs/benchmarks.md. "
                                       "'lychee-rtc bench NAME --help' lists a bench's options.")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for name, (_, summary) in BENCHES.items():
        # add_help=False: "--help" after the name belongs to the bench's own parser.
        p = benches.add_parser(name, help=summary, add_help=False)
        p.set_defaults(func=run_bench, passes_extra_args=True)


def run_bench(args: argparse.Namespace) -> Any:
    module = importlib.import_module(BENCHES[args.bench][0])
    parser = argparse.ArgumentParser(prog="lychee-rtc bench")
    module.add_parser(parser.add_subparsers(dest="bench", required=True, metavar="BENCH"))
    bench_args = parser.parse_args([args.bench, *args.extra_args])
    return bench_args.func(bench_args)
