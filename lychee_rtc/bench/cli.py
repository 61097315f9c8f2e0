"""``lychee-rtc bench …`` subcommands."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="measure latency, load and engine speed",
                           description="Benchmarks; results and method are written down in docs/benchmarks.md.")
    bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
