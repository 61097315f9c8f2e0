"""``lychee-rtc bench …`` subcommands."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure latency, load and engine speed",
                           description="Benchmarks; the method and the results are in docs/benchmarks.md.")
    benches = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    from lychee_rtc.bench import latency, load, lychee_step, telephony, token2wav_bench

    latency.add_parser(benches)
    load.add_parser(benches)
    lychee_step.add_parser(benches)
    token2wav_bench.add_parser(benches)
    telephony.add_parser(benches)
