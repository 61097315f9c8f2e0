"""``lychee-rtc bench …`` subcommands.

Building the parser imports only the bench modules' argument definitions: torch and the model code
are imported by each benchmark's ``run`` when it is chosen.
"""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure latency, load and engine speed",
                           description="Benchmarks; the method and the results are in docs/benchmarks.md.")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    from lychee_rtc.bench import gpu, latency, load, lychee_step, token2wav_bench

    latency.add_parser(benches)
    load.add_parser(benches)
    lychee_step.add_parser(benches)
    token2wav_bench.add_parser(benches)
    gpu.add_parser(benches)
